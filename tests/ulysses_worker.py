"""One rank of a Ulysses SP run on CPU (gloo), for tests/test_ulysses.py: SP training against one-process training.

    python -m torch.distributed.run --nproc_per_node 2 tests/ulysses_worker.py MODE

Every rank trains a full-sequence reference alone and the same model under SP on the same groups, then checks loss,
every gradient and the weights after each SGD step. MODE: `exact`, or a deliberately broken `no_phase_c` /
`no_reduce`, which must fail. Rank 0 prints `max_rel <worst relative error>`.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import equivalence as eq  # noqa: E402
from launcher import finish_worker  # noqa: E402
from models import build  # noqa: E402

import hf_prefixflow  # noqa: E402
from hf_prefixflow.core import scheduler  # noqa: E402
from hf_prefixflow.distributed import ulysses  # noqa: E402

# (prefix length, suffix lengths, waves): P-1 odd moves one prompt token into the suffixes, P=2 caches nothing.
GROUPS = [(14, [5, 3, 7], [[0, 1], [2]]), (9, [4, 1, 6, 2], [[3], [0, 1, 2]]), (2, [3, 5], [[0, 1]])]
WORST = [0.0]


def rel(actual, expected, what):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    WORST[0] = max(WORST[0], (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-300))
    eq.assert_rel_close(actual, expected, what)


def sharded_loss(out: ulysses.ShardedOutput, suffixes, weights) -> torch.Tensor:
    """This rank's part of the loss: the completion tokens its positions predict."""
    loss = out.logits.new_zeros((), dtype=torch.float64)
    for row, (suffix, weight) in enumerate(zip(suffixes, weights)):
        real = (out.token_index >= 0) & (out.token_index < len(suffix))
        tokens = out.token_index[real]
        loss = loss + eq.token_loss(out.logits[row, real], suffix[tokens], weight[tokens])
    return loss


def sp_backward(model, sp, group: eq.Group, waves, mode: str) -> float:
    gen = torch.Generator().manual_seed(1)
    total = torch.zeros((), dtype=torch.float64)
    with ulysses.prefix_group(model, group.prefix, sp) as g:
        for rows in waves:
            ids, mask = eq.pad([group.suffixes[i] for i in rows], gen)
            out = g(ids, attention_mask=mask)
            loss = sharded_loss(out, [group.suffixes[i] for i in rows], [group.weights[i] for i in rows])
            loss.backward()
            total += loss.detach()
    if mode != "no_reduce":
        ulysses.reduce_gradients(model, sp)
    dist.all_reduce(total, group=sp.group)
    return total.item()


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    sp = ulysses.SequenceParallel()
    reference = build("qwen3").train()  # 4 query and 2 key/value heads: one KV head per rank
    candidate = hf_prefixflow.apply_prefixflow(build("qwen3").train())
    if mode == "no_phase_c":  # after apply_prefixflow, whose probe would refuse the broken schedule itself
        scheduler.delayed_backward = lambda caches, *args: 0
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (reference, candidate)]
    gen = torch.Generator().manual_seed(0)
    for step, (length, lengths, waves) in enumerate(GROUPS):
        group = eq.drawn_group(gen, length, lengths)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ref_loss = eq.full_sequence_backward(reference, group)
        sp_loss = sp_backward(candidate, sp, group, waves, mode)
        rel(sp_loss, ref_loss, f"step {step} loss")
        ref_grads, sp_grads = eq.gradients(reference), eq.gradients(candidate)
        assert ref_grads.keys() == sp_grads.keys()
        for name in ref_grads:
            rel(sp_grads[name], ref_grads[name], f"step {step} grad {name}")
        for opt in opts:
            opt.step()
        for (name, p_ref), (_, p_sp) in zip(reference.named_parameters(), candidate.named_parameters()):
            rel(p_sp - start[name], p_ref - start[name], f"step {step} update {name}")
    if dist.get_rank() == 0:
        print(f"max_rel {WORST[0]:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    finish_worker()
