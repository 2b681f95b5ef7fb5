"""Ulysses sequence parallelism in `PrefixFlowGRPOTrainer`: SP ranks pool their rollouts and run them sharded.

TRL stays data parallel over all processes: each generates, scores and normalises its own rows, exactly as under
DDP. The log-probs of a microbatch are where SP enters: the ranks of an SP group exchange their rows, so every rank
sees the same rollouts, run each group's prefix and completions sharded along the sequence
(`hf_prefixflow/distributed/ulysses.py`), gather the per-token log-probs, and each rank keeps its own rows for TRL's
loss. The gather's backward hands every rank the sum of all ranks' gradients for its shard, so the gradients summed
over all processes equal DDP's over the same rows; the DDP rule's one averaging all-reduce after Phase C follows.
Groups stay open until the optimizer step, when one Phase C closes them in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.core.scheduler import GroupSession
from hf_prefixflow.distributed import ulysses

from .grouping import index_batch
from .window import OpenWindow

PoolRows = list[tuple[torch.Tensor, torch.Tensor, int]]


def sp_size_from(parallelism_config, sp_size: int) -> int:
    """Accelerate's `ParallelismConfig(sp_size=N, sp_backend="deepspeed")`, read as PrefixFlow's own Ulysses SP."""
    pc = parallelism_config
    others = {"dp_replicate_size": pc.dp_replicate_size, "dp_shard_size": pc.dp_shard_size, "tp_size": pc.tp_size,
              "cp_size": pc.cp_size}
    if any((size or 1) > 1 for size in others.values()):
        raise PrefixFlowError(f"with sequence parallelism PrefixFlow composes only with data parallelism over the "
                              f"remaining processes; set {', '.join(others)} to 1.")
    if sp_size not in (1, pc.sp_size):
        raise PrefixFlowError(f"prefixflow_sp_size={sp_size} contradicts parallelism_config.sp_size={pc.sp_size}; "
                              "set one of them.")
    return pc.sp_size


def setup(trainer, size: int) -> ulysses.SequenceParallel | None:
    """Check the run can be sharded (before any step) and build this rank's SP group; None without SP."""
    if size == 1:
        return None
    if trainer.accelerator.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise PrefixFlowError(
            f"prefixflow_sp_size={size} needs a multi-process DDP launch (e.g. accelerate launch --config_file "
            f"examples/accelerate/ulysses_sp2.yaml), not {trainer.accelerator.distributed_type}; DeepSpeed ZeRO and "
            "FSDP with sequence parallelism are not supported yet."
        )
    ulysses.check_model(trainer.model, size)
    if trainer.ref_model is not None:
        ulysses.check_model(trainer.ref_model, size)
    return ulysses.consecutive_groups(size)


def pool_rows(sp: ulysses.SequenceParallel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              logits_to_keep: int) -> PoolRows:
    """Every SP rank's `(ids, mask, completion width)` in rank order, in each rank's own layout."""
    shape = torch.tensor([input_ids.shape[0], input_ids.shape[1] - logits_to_keep, logits_to_keep],
                         device=input_ids.device)
    shapes = [torch.empty_like(shape) for _ in range(sp.size)]
    dist.all_gather(shapes, shape, group=sp.group)
    rows, prompt, keep = (max(int(s[i]) for s in shapes) for i in range(3))

    def padded(x: torch.Tensor) -> torch.Tensor:  # prompts are left-padded, completions right-padded
        width = x.shape[1] - logits_to_keep
        x = torch.nn.functional.pad(x, (prompt - width, keep - logits_to_keep, 0, rows - x.shape[0]))
        gathered = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(gathered, x.contiguous(), group=sp.group)
        return gathered

    pooled = []
    for ids, mask, (count, width, completion) in zip(padded(input_ids), padded(attention_mask),
                                                      [s.tolist() for s in shapes]):
        columns = slice(prompt - width, prompt + completion)
        pooled.append((ids[:count, columns], mask[:count, columns], completion))
    return pooled


def logps(window: OpenWindow, sp: ulysses.SequenceParallel, autocast: Callable[[], ContextManager], model,
          input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
          compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """`_get_per_token_logps_and_entropies` under SP: this rank's rows, computed with its SP group; training opens
    its groups in `window` (they stay open until the optimizer step), scoring in a session of its own. `autocast`:
    the trainer's mixed-precision context (`accelerator.autocast`)."""
    training = torch.is_grad_enabled()
    pooled = pool_rows(sp, input_ids, attention_mask, logits_to_keep)
    with contextlib.nullcontext(window.started(model)) if training else GroupSession(model) as session:
        opened = window.open_groups if training else None
        per_rank = [_rank_rows(sp, autocast, session, opened, model, rank, *rows, compute_entropy)
                    for rank, rows in enumerate(pooled)]
    # One tensor of every rank's rows: its slice below still backpropagates (zeros) through the other ranks' gathers,
    # so every rank runs the same collectives in its backward.
    width = max(rows[2] for rows in pooled)
    start = sum(rows[0].shape[0] for rows in pooled[: sp.rank])
    own = slice(start, start + input_ids.shape[0])

    def mine(index: int) -> torch.Tensor:
        every = torch.cat([torch.nn.functional.pad(r[index], (0, width - r[index].shape[1])) for r in per_rank])
        return every[own, :logits_to_keep]

    return mine(0), (mine(1) if compute_entropy else None), None


def _rank_rows(sp: ulysses.SequenceParallel, autocast: Callable[[], ContextManager], session: GroupSession,
               opened: dict | None, model, rank: int, ids: torch.Tensor, mask: torch.Tensor, keep: int,
               compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) `[B, keep]` of one SP rank's rows, every group sharded over the SP group; groups
    are kept in and reused from `opened` (training), else fresh."""
    completions, completion_mask = ids[:, -keep:], mask[:, -keep:]
    rows, logp_parts, entropy_parts = [], [], []
    for g in index_batch(ids, mask, keep).groups:
        key = (rank, g.key)
        group = opened.get(key) if opened is not None else None
        if group is None:
            with autocast():
                group = session.add(ulysses.UlyssesGroup(model, g.prefix_ids, sp, g.position_offset))
            if opened is not None:
                opened[key] = group
        wave_ids, wave_mask = completions[g.rows], completion_mask[g.rows]
        with autocast():
            out = group(wave_ids, attention_mask=wave_mask, shift_labels=wave_ids.masked_fill(wave_mask == 0, -100),
                        fused_lm_head=True)
        rows += g.rows
        logp_parts.append(out.gather(out.raw.log_probs))
        entropy_parts.append(out.gather(out.raw.entropy) if compute_entropy else None)
    inverse = torch.empty(len(rows), dtype=torch.long, device=ids.device)
    inverse[torch.tensor(rows, device=ids.device)] = torch.arange(len(rows), device=ids.device)
    logps = torch.cat(logp_parts)[inverse]
    return logps, (torch.cat(entropy_parts)[inverse] if compute_entropy else None)
