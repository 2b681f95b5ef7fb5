"""One stage of a pipeline-parallel run on CPU (gloo), for tests/test_pipeline.py: PP against one-process training.

    python -m torch.distributed.run --nproc_per_node STAGES tests/pipeline_worker.py MODES FAMILY LAYERS [BOUNDS]

Every rank trains a full-sequence reference of the whole model alone and its stage under PrefixFlow on the same
groups, then checks its own parameters: loss (last stage), every gradient and the weights after each SGD step.
MODES, comma-separated: `plain`; `offload` (the host pool, recomputing half the prefix layers); `checkpointing`
(non-reentrant, on both models); `lora` (both models under the same LoRA adapters); `refusals` (first, bad groups
that must raise on every rank and leave the pipeline in step); `stage_local` (the last stage finishes its Phase A only
once the first stage has run a suffix wave: it would wait forever if a stage's Phase B waited for later stages'
Phase A); `dp2` (two pipeline replicas over the processes, each training its own groups, gradients summed over
each stage's replicas; the reference trains both replicas' groups); or a deliberately broken `no_boundary` (Phase C
drops the gradient coming back from the next stage), which must fail. Rank 0 prints `max_rel <worst relative error>`
over all ranks.
"""

import os
import re
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import equivalence as eq  # noqa: E402
from launcher import finish_worker  # noqa: E402
from models import build  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from hf_prefixflow import _compat
import hf_prefixflow  # noqa: E402
from hf_prefixflow import PrefixFlowError  # noqa: E402
from hf_prefixflow.distributed import pipeline  # noqa: E402
from hf_prefixflow.distributed.data_parallel import reduce_trainable_gradients  # noqa: E402

# (prefix length, suffix lengths, microbatches) per stage count: uneven suffixes are right-padded to one width;
# P=1 caches nothing.
GROUPS = {
    2: [(13, [5, 3, 7, 1], 2), (9, [4, 6, 2, 2, 5, 1], 3), (1, [3, 5], 2), (20, [2, 6, 4, 3], 4)],
    3: [(11, [5, 3, 7], 3), (17, [4, 6, 2, 2, 5, 1], 6), (1, [2, 4, 3], 3)],
}
WORST = [0.0]


def rel(actual, expected, what):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    WORST[0] = max(WORST[0], (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-300))
    eq.assert_rel_close(actual, expected, what)


def pipeline_backward(model, group: eq.Group, microbatches: int, first: bool, pp_group=None) -> float | None:
    ids, mask = eq.pad(group.suffixes, torch.Generator().manual_seed(1))

    def loss_fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return sum(eq.token_loss(logits[r, : len(group.suffixes[i])], group.suffixes[i], group.weights[i])
                   for r, i in enumerate(rows.tolist()))

    loss = pipeline.train_group(model, group.prefix, ids if first else None, mask, loss_fn, microbatches, pp_group)
    return None if loss is None else loss.item()


def check_refusals(model, rank: int, stages: int) -> None:
    """Bad groups, some bad on one rank only: every rank raises the same way."""
    ids, mask = torch.zeros(2 * stages, 3, dtype=torch.long), torch.ones(2 * stages, 3, dtype=torch.long)
    prompt = torch.arange(6)
    cases = [  # (prompt, suffix ids, mask, microbatches) on this rank, the message every rank must raise
        ((prompt, ids if rank else None, mask, stages), "first stage needs suffix_ids|another pipeline stage refused"),
        ((prompt, ids, mask, stages + 1), "equal microbatches, at least one per stage"),
        ((prompt[: 5 + rank], ids, mask, stages), "different groups"),
        ((prompt, ids, mask, stages * (1 + (rank == 0))), "different groups"),
        ((prompt + (rank == 0), ids, mask, stages), "different groups"),  # same shapes, other ids
        ((prompt, ids, torch.cat([mask[:, :1] * 0, mask[:, 1:]], 1) if rank else mask, stages),
         "right-padded|another pipeline stage refused"),
        ((prompt, ids, mask[None] if rank == 0 else mask, stages), r"must be \[N, S\]|another pipeline stage refused"),
    ]
    for (prompt_ids, suffix_ids, attention_mask, microbatches), message in cases:
        try:
            pipeline.train_group(model, prompt_ids, suffix_ids, attention_mask, lambda logits, r: logits.sum(),
                                 microbatches)
        except PrefixFlowError as error:
            assert re.search(message, str(error)), str(error)
        else:
            raise AssertionError(f"stage {rank}: no error for {message}")


def wait_for_first_wave(marker: str, rank: int, stages: int) -> None:
    """The first stage marks its first suffix wave; the last stage's Phase A waits for that mark."""
    forward, phase_a = pipeline._WaveStage.forward, pipeline._phase_a

    def marking(self, *args, **kwargs):
        open(marker, "a").close()
        return forward(self, *args, **kwargs)

    def waiting(*args, **kwargs):
        phase_a(*args, **kwargs)
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "the first stage never started Phase B before the last ended Phase A"
            time.sleep(0.01)
        os.remove(marker)

    if rank == 0:
        pipeline._WaveStage.forward = marking
    if rank == stages - 1:
        pipeline._phase_a = waiting


def prepared(family: str, layers: int, modes: set[str]) -> torch.nn.Module:
    model = build(family, num_hidden_layers=layers).train()
    if "checkpointing" in modes:
        _compat.enable_checkpointing(model)
    if "lora" in modes:
        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    return model


def process_groups(replicas: int) -> tuple[int, int, object, object]:
    """Stage index, stage count, this rank's pipeline group and its data-parallel group (replicas of its stage);
    one pipeline on the whole world: (rank, world, None, None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if replicas == 1:
        return rank, world, None, None
    stages = world // replicas
    pipelines = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(replicas)]
    replicas_of = [dist.new_group(list(range(s, world, stages))) for s in range(stages)]
    return rank % stages, stages, pipelines[rank // stages], replicas_of[rank % stages]


def main(modes: set[str], family: str, layers: int, bounds: list[int] | None) -> None:
    dist.init_process_group("gloo")
    replicas = 2 if "dp2" in modes else 1
    rank, stages, pp_group, dp_group = process_groups(replicas)
    replica = dist.get_rank() // stages
    if "no_boundary" in modes:
        recv = pipeline._Link.recv
        pipeline._Link.recv = lambda link, like, offset: torch.zeros_like(like) if offset > 0 else \
            recv(link, like, offset)
    if "stage_local" in modes:
        wait_for_first_wave(os.path.join(os.environ["PIPELINE_TMP"], "first_wave"), rank, stages)
    reference = prepared(family, layers, modes)
    candidate = pipeline.split_model(prepared(family, layers, modes), rank, stages, bounds)
    offload = "offload" in modes
    hf_prefixflow.apply_prefixflow(candidate, offload=offload, prefix_recompute=0.5 if offload else None)
    if "refusals" in modes:
        check_refusals(candidate, rank, stages)
    names = {n: p for n, p in candidate.named_parameters() if p.requires_grad}
    assert names and all(n in dict(reference.named_parameters()) for n in names)
    start = {n: p.detach().clone() for n, p in names.items()}
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
            for m in (reference, candidate)]
    gen = torch.Generator().manual_seed(0)
    for step, (length, lengths, microbatches) in enumerate(GROUPS[max(stages, 2)]):
        groups = [eq.drawn_group(gen, length, lengths) for _ in range(replicas)]  # one per pipeline replica
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ref_losses = [eq.full_sequence_backward(reference, group) for group in groups]
        pp_loss = pipeline_backward(candidate, groups[replica], microbatches, rank == 0, pp_group)
        if dp_group is not None:  # the replicas' gradients summed, as the reference's over all groups
            reduce_trainable_gradients(candidate, dp_group)
        if rank == stages - 1:
            rel(pp_loss, ref_losses[replica], f"step {step} loss")
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if n in names}
        pp_grads = {n: p.grad for n, p in names.items()}
        assert all(g is not None for g in pp_grads.values()), f"stage {rank}: a parameter got no gradient"
        for name in names:
            rel(pp_grads[name], ref_grads[name], f"step {step} grad {name}")
        for opt in opts:
            opt.step()
        for (name, p_ref) in reference.named_parameters():
            if name in names:
                rel(names[name] - start[name], p_ref - start[name], f"step {step} update {name}")
    if offload:
        assert hf_prefixflow.core.access.unwrap(candidate)._prefixflow_pool.allocated_bytes > 0, "nothing was offloaded"
    worst = torch.tensor([WORST[0]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"max_rel {worst.item():.3e}")


if __name__ == "__main__":
    bounds = [int(b) for b in sys.argv[4].split(",")] if len(sys.argv) > 4 else None
    main(set(sys.argv[1].split(",")), sys.argv[2], int(sys.argv[3]), bounds)
    finish_worker()
