"""One rank of the split-group check (tests/test_placement.py), two gloo processes in fp64.

    python -m torch.distributed.run --nproc_per_node 2 tests/placement_worker.py OUT_DIR

Three groups over two ranks: A split 2/3 (owner rank 0), B held by rank 1 only but opened as a split group (rank 0
joins its collectives without rows, owner rank 1), C an ordinary local group of rank 0. Under the DDP rule the
averaged gradients times the world size must equal one process training every row on the full sequences; with the
gK/gV reduce skipped they must not.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402
from launcher import finish_worker  # noqa: E402
from equivalence import full_sequence_backward, gradients, pad, random_group, token_loss  # noqa: E402

import hf_prefixflow  # noqa: E402
from hf_prefixflow.distributed import data_parallel, placement  # noqa: E402

# group -> rows per rank, each rank's rows as waves: ("padded" | "packed", rows)
PLAN = {
    "A": {0: [("padded", [0, 1])], 1: [("padded", [2]), ("packed", [3, 4])]},
    "B": {1: [("padded", [0, 1, 2])]},
    "C": {0: [("padded", [0, 1])]},
}
SIZES = {"A": 5, "B": 3, "C": 2}


def make_groups() -> dict:
    gen = torch.Generator().manual_seed(7)  # the same on every rank
    return {name: random_group(gen, prefix=(6, 20), suffix=(1, 8), n=(count, count)) for name, count in SIZES.items()}


def run_waves(group, data, waves) -> None:
    gen = torch.Generator().manual_seed(dist.get_rank())
    for layout, rows in waves:
        suffixes = [data.suffixes[i] for i in rows]
        if layout == "padded":
            ids, mask = pad(suffixes, gen)
            logits = group(ids, attention_mask=mask).logits
            per_row = [logits[r, : len(s)] for r, s in enumerate(suffixes)]
        else:
            out = group.packed(suffixes)
            per_row = out.split(out.logits)
        sum(token_loss(lg, s, data.weights[i]) for lg, s, i in zip(per_row, suffixes, rows)).backward()


def prefixflow_gradients(model, groups: dict, reduce: bool) -> dict:
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model)
    with data_parallel.local_gradients(ddp), hf_prefixflow.GroupSession(ddp) as session:
        splits = {}
        for name in ("A", "B"):  # every rank, same order
            holders = tuple(PLAN[name])
            prefix = groups[name].prefix if rank in holders else None
            splits[name] = placement.open_split(session, prefix, holders)
        local = session.open(groups["C"].prefix) if rank in PLAN["C"] else None
        for name, split in splits.items():
            if split.group is not None:
                run_waves(split.group, groups[name], PLAN[name][rank])
        if local is not None:
            run_waves(local, groups["C"], PLAN["C"][rank])
        if reduce:
            placement.reduce_gradients(list(splits.values()))
    data_parallel.all_reduce_gradients(ddp)
    world = dist.get_world_size()
    return {name: grad * world for name, grad in gradients(model).items()}  # DDP averages; the reference sums


def mismatch_raises(base, prefix: torch.Tensor) -> bool:
    """Rank 1 passes a shorter prompt for a split group: every rank must raise (none may wait in a broadcast)."""
    model = hf_prefixflow.apply_prefixflow(copy.deepcopy(base))
    with torch.no_grad(), hf_prefixflow.GroupSession(model) as session:
        try:
            placement.open_split(session, prefix[: len(prefix) - dist.get_rank()], holders=(0, 1))
        except hf_prefixflow.PrefixFlowError as exc:
            return "same prompt" in str(exc)
    return False


def max_relative(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys(), actual.keys() ^ expected.keys()
    return max(((actual[n] - expected[n]).abs().max() / expected[n].abs().max()).item() for n in expected)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    base = models.build("qwen3", dtype=torch.float64)
    groups = make_groups()
    reference = copy.deepcopy(base)
    for data in groups.values():
        full_sequence_backward(reference, data)
    expected = gradients(reference)
    result = {}
    for reduce in (True, False):
        model = hf_prefixflow.apply_prefixflow(copy.deepcopy(base))
        result["exact" if reduce else "broken"] = max_relative(prefixflow_gradients(model, groups, reduce), expected)
    result["mismatch_raised_everywhere"] = mismatch_raises(base, groups["A"].prefix)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    finish_worker()
