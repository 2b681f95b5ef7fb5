"""Group-aware data flow for TRL batches: keep a prompt's completions together and find the shared prefix by tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.core.layouts import right_padded


def check_geometry(per_device_batch: int, num_generations: int, steps_per_generation: int,
                   can_split: bool = False) -> bool:
    """Returns whether a group straddles processes, which only engines that can split a group (`can_split`: plain
    DDP) accept; the others need each process to hold whole groups. Within a process a group may span microbatches
    in any proportion: its prompt stays cached until the last microbatch that reads it."""
    rows = per_device_batch * steps_per_generation
    straddles = bool(rows % num_generations)
    if straddles and not can_split:
        steps = num_generations // math.gcd(per_device_batch, num_generations)
        raise PrefixFlowError(
            f"each process holds per_device_train_batch_size * steps_per_generation = {per_device_batch} * "
            f"{steps_per_generation} = {rows} rows of a generation, not a whole number of groups of "
            f"num_generations={num_generations}, so a group would straddle processes, which PrefixFlow splits only "
            f"under plain DDP (not DeepSpeed ZeRO, FSDP2 or sequence parallelism). Set steps_per_generation to a "
            f"multiple of {steps} (or per_device_train_batch_size to a multiple of {num_generations})."
        )
    return straddles


def _permute(value, rows: torch.Tensor):
    if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return [value[i] for i in rows.tolist()]


def _blocks(rows: int, group_size: int, offset: int) -> torch.Tensor:
    """Each row's group, counting from this process's first row, which is row `offset` of its group."""
    return (torch.arange(rows) + offset) // group_size


def check_group_prompts(batch: dict, group_size: int, offset: int = 0) -> None:
    """Every block of `group_size` rows (one prompt's completions, as TRL's sampler emits them) shares its prompt.
    The first block starts `offset` rows into its group and the last may end early: those groups straddle processes
    (`check_geometry` refuses that at construction where it is not supported)."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    tokens = ids.masked_fill(mask == 0, -1)
    blocks = _blocks(ids.shape[0], group_size, offset).to(ids.device)
    first_row = torch.searchsorted(blocks, blocks)  # each block's first row (blocks are sorted)
    differs = (tokens != tokens[first_row]).any(dim=1)
    if differs.any():
        block = blocks[int(differs.nonzero()[0])]
        rows = (blocks == block).nonzero()[:, 0].tolist()
        raise PrefixFlowError(
            f"rows {rows[0]}..{rows[-1]} come from one prompt (num_generations={group_size}) but their "
            "prompt tokens differ, so they share no prefix. Make the prompt deterministic per dataset row (no random "
            "system prompt or date per generation), or train this data with GRPOTrainer."
        )


def shuffle_groups(batch: dict, group_size: int, generator: torch.Generator | None = None, offset: int = 0) -> dict:
    """TRL's row shuffle at group granularity: groups move as blocks, so microbatches keep completions together.
    `offset`: this process's first row is row `offset` of its group (the rest of that group is on other ranks)."""
    check_group_prompts(batch, group_size, offset)
    # Draw exactly what TRL's row shuffle draws, so the RNG stream (and with it every later sample) stays the
    # stock trainer's; groups then move in the order their rows first appear in that permutation.
    count = batch["prompt_ids"].shape[0]
    rows = torch.randperm(count, generator=generator)
    blocks = _blocks(count, group_size, offset)
    blocks_count = int(blocks[-1]) + 1
    first = torch.full((blocks_count,), count).scatter_reduce(0, blocks[rows], torch.arange(count), "amin")
    rank_of_block = torch.empty(blocks_count, dtype=torch.long)
    rank_of_block[first.argsort()] = torch.arange(blocks_count)
    permutation = rank_of_block[blocks].argsort(stable=True)
    return {key: _permute(value, permutation) for key, value in batch.items()}


@dataclass(frozen=True)
class BatchGroup:
    """Rows of a `[prompt | completion]` batch that share one prompt."""

    rows: list[int]
    prefix_ids: torch.Tensor  # [P] real prompt tokens (left padding stripped), on the batch's device
    position_offset: int  # left padding: where the stock trainer places the first prompt token
    key: tuple  # (position_offset, prompt tokens): the same prompt in any microbatch or process


@dataclass(frozen=True)
class BatchIndex:
    """A batch's prompt groups and each row's completion length, as the host knows them."""

    groups: list[BatchGroup]
    lengths: list[int]  # real completion tokens per row

    def rows_in(self, start: int, stop: int) -> "BatchIndex":
        """The index of rows `start:stop` (a microbatch, or a run of them), rows renumbered from `start`."""
        groups = []
        for group in self.groups:
            rows = [row - start for row in group.rows if start <= row < stop]
            if rows:
                groups.append(replace(group, rows=rows))
        return BatchIndex(groups, self.lengths[start:stop])


def index_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> BatchIndex:
    """Group rows by identical real prompt tokens and count their completion tokens, checking TRL's layout (prompts
    left-padded, completions right-padded). Read on the host after one copy: one device synchronisation per batch,
    none per group or row."""
    width = input_ids.shape[1] - completion_length
    prompt = input_ids[:, :width]
    host = torch.cat([prompt, attention_mask.to(prompt.dtype)], dim=1).cpu()
    host_ids, mask = host[:, :width], host[:, width:].bool()
    prompt_mask, completion_mask = mask[:, :width], mask[:, width:]
    if (prompt_mask[:, :-1] & ~prompt_mask[:, 1:]).any():
        raise PrefixFlowError("prompts must be left-padded (mask 0...0 1...1), as TRL pads them.")
    if not right_padded(completion_mask):
        raise PrefixFlowError("completions must be right-padded (mask 1...1 0...0), as TRL pads them.")
    keyed = host_ids.masked_fill(~prompt_mask, -1)
    unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    padding = (~prompt_mask).sum(dim=1).tolist()
    groups = []
    for rows in _rows_by_label(inverse.tolist(), len(unique)):
        offset = padding[rows[0]]
        key = (offset, tuple(host_ids[rows[0], offset:].tolist()))
        groups.append(BatchGroup(rows, prompt[rows[0], offset:], offset, key))
    return BatchIndex(groups, completion_mask.sum(dim=1).tolist())


def _rows_by_label(labels: list[int], count: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(count)]
    for row, label in enumerate(labels):
        rows[label].append(row)
    return rows
