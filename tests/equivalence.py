"""Shared checks: random groups, the full-sequence reference, the PrefixFlow path, and relative comparison."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import hf_prefixflow
from models import VOCAB

RTOL = 1e-5


@dataclass
class Group:
    prefix: torch.Tensor  # [P]
    suffixes: list[torch.Tensor]  # N x [L_i]
    weights: list[torch.Tensor]  # N x [L_i], per-token loss weights (advantages / normalisers)


def random_group(gen: torch.Generator, prefix=(2, 24), suffix=(1, 9), n=(1, 6)) -> Group:
    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    count = randint(*n)
    prefix_ids = torch.randint(0, VOCAB, (randint(*prefix),), generator=gen)
    suffixes = [torch.randint(0, VOCAB, (randint(*suffix),), generator=gen) for _ in range(count)]
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in suffixes]
    return Group(prefix_ids, suffixes, weights)


def drawn_group(gen: torch.Generator, prefix_length: int, suffix_lengths: list[int]) -> Group:
    """A group of given lengths with random tokens and per-token weights."""
    return Group(torch.randint(0, VOCAB, (prefix_length,), generator=gen),
                 [torch.randint(0, VOCAB, (n,), generator=gen) for n in suffix_lengths],
                 [torch.randn(n, generator=gen, dtype=torch.float64) for n in suffix_lengths])


def random_plan(gen: torch.Generator, count: int, layouts=("padded", "packed")) -> list[tuple[str, list[int]]]:
    """Split suffix indices into waves of random sizes and random layouts, in random order."""
    order = torch.randperm(count, generator=gen).tolist()
    plan = []
    while order:
        size = int(torch.randint(1, len(order) + 1, (1,), generator=gen))
        layout = layouts[int(torch.randint(0, len(layouts), (1,), generator=gen))]
        plan.append((layout, order[:size]))
        order = order[size:]
    return plan


def token_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None])[:, 0]
    return (logp * weights.to(logp.device)).sum()


def pad(rows: list[torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with random ids (pad values must not matter) and a 1/0 mask."""
    width = max(len(r) for r in rows)
    ids = torch.randint(0, VOCAB, (len(rows), width), generator=gen)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def full_sequence_backward(model, group: Group, batched: bool = False, gen: torch.Generator | None = None) -> float:
    """Reference: every `[P || S_i]` as an ordinary sequence (one at a time, or one right-padded batch)."""
    p = len(group.prefix)
    device = model.get_input_embeddings().weight.device if hasattr(model, "get_input_embeddings") else "cpu"
    sequences = [torch.cat([group.prefix, s]) for s in group.suffixes]
    batches = [list(range(len(sequences)))] if batched else [[i] for i in range(len(sequences))]
    total = 0.0
    for rows in batches:
        ids, mask = pad([sequences[i] for i in rows], gen or torch.Generator().manual_seed(0))
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        loss = sum(
            token_loss(logits[r, p - 1 : p - 1 + len(group.suffixes[i])], group.suffixes[i].to(device), group.weights[i])
            for r, i in enumerate(rows)
        )
        loss.backward()
        total += loss.item()
    return total


def prefixflow_backward(model, group: Group, plan, gen: torch.Generator | None = None) -> float:
    """PrefixFlow: one group, waves as in `plan`, a backward per wave; Phase C on exit."""
    gen = gen or torch.Generator().manual_seed(1)
    device = model.get_input_embeddings().weight.device if hasattr(model, "get_input_embeddings") else "cpu"
    total = 0.0
    with hf_prefixflow.prefix_group(model, group.prefix.to(device)) as g:
        for layout, rows in plan:
            suffixes = [group.suffixes[i].to(device) for i in rows]
            if layout == "padded":
                ids, mask = pad(suffixes, gen)
                logits = g(ids.to(device), attention_mask=mask.to(device)).logits
                per_row = [logits[r, : len(s)] for r, s in enumerate(suffixes)]
            else:
                out = g.packed(suffixes)
                per_row = out.split(out.logits)
            loss = sum(token_loss(lg, s, group.weights[i]) for lg, s, i in zip(per_row, suffixes, rows))
            loss.backward()
            total += loss.item()
    return total


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """max|a - e| <= rtol * max|e| (a relative check that tiny entries cannot dominate)."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rtol * scale or err < 1e-14, f"{what}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


def assert_same_gradients(actual: dict, expected: dict, rtol: float = RTOL) -> None:
    assert actual.keys() == expected.keys(), f"different parameters got gradients: {actual.keys() ^ expected.keys()}"
    assert expected, "no parameter received a gradient"
    for name in expected:
        assert_rel_close(actual[name], expected[name], f"grad {name}", rtol)


def train_side_by_side(model, groups: list[Group], plans: list, lr: float = 1e-3, rtol: float = RTOL,
                       prepare=hf_prefixflow.apply_prefixflow) -> None:
    """Optimizer steps on two copies (full sequence vs PrefixFlow, the copy made so by `prepare`): loss, every
    gradient, weights after each step.

    SGD with momentum keeps updates linear in the gradients, so a relative gradient tolerance carries over to the
    weights; Adam's g / (sqrt(v) + eps) would turn harmless rounding in near-zero gradients into O(lr) noise.
    """
    reference, candidate = model, copy.deepcopy(model)
    prepare(candidate)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr, momentum=0.9) for m in (reference, candidate)]
    for step, (group, plan) in enumerate(zip(groups, plans)):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ref_loss = full_sequence_backward(reference, group)
        pf_loss = prefixflow_backward(candidate, group, plan)
        assert_rel_close(pf_loss, ref_loss, f"step {step} loss", rtol)
        assert_same_gradients(gradients(candidate), gradients(reference), rtol)
        for opt in opts:
            opt.step()
        for (name, p_ref), (_, p_pf) in zip(reference.named_parameters(), candidate.named_parameters()):
            assert_rel_close(p_pf - start[name], p_ref - start[name], f"step {step} update {name}", rtol)
