"""Group-aware data flow for TRL batches: keep a prompt's completions together and find the shared prefix by tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_prefixflow import PrefixFlowError


def check_geometry(per_device_batch: int, num_generations: int, steps_per_generation: int) -> None:
    """Microbatches must hold whole groups, or a whole group must span a whole number of microbatches; and each
    process must hold whole groups, since a group's prefix K/V live on one process."""
    if per_device_batch % num_generations and num_generations % per_device_batch:
        raise PrefixFlowError(
            f"per_device_train_batch_size={per_device_batch} splits groups of num_generations={num_generations} "
            "unevenly across microbatches. Set per_device_train_batch_size to a multiple of num_generations (whole "
            "groups per microbatch) or to a divisor of it (a group spans several microbatches)."
        )
    rows = per_device_batch * steps_per_generation
    if rows % num_generations:
        steps = num_generations // math.gcd(per_device_batch, num_generations)
        raise PrefixFlowError(
            f"each process holds per_device_train_batch_size * steps_per_generation = {per_device_batch} * "
            f"{steps_per_generation} = {rows} rows of a generation, not a whole number of groups of "
            f"num_generations={num_generations}, so a group would straddle processes. Set steps_per_generation to a "
            f"multiple of {steps} (or per_device_train_batch_size to a multiple of {num_generations})."
        )


def _permute(value, rows: torch.Tensor):
    if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return [value[i] for i in rows.tolist()]


def check_group_prompts(batch: dict, group_size: int) -> None:
    """Every block of `group_size` rows (one prompt's completions, as TRL's sampler emits them) shares its prompt."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    if ids.shape[0] % group_size:
        raise PrefixFlowError(
            f"this process holds {ids.shape[0]} rows, not a whole number of groups of {group_size}: a group straddles "
            "processes. Make per_device_train_batch_size * steps_per_generation a multiple of num_generations."
        )
    tokens = ids.masked_fill(mask == 0, -1).view(-1, group_size, ids.shape[1])
    differs = (tokens != tokens[:, :1]).any(dim=2).any(dim=1)
    if differs.any():
        first = int(differs.nonzero()[0]) * group_size
        raise PrefixFlowError(
            f"rows {first}..{first + group_size - 1} come from one prompt (num_generations={group_size}) but their "
            "prompt tokens differ, so they share no prefix. Make the prompt deterministic per dataset row (no random "
            "system prompt or date per generation), or train this data with GRPOTrainer."
        )


def shuffle_groups(batch: dict, group_size: int, generator: torch.Generator | None = None) -> dict:
    """TRL's row shuffle at group granularity: groups move as blocks, so microbatches keep completions together."""
    check_group_prompts(batch, group_size)
    # Draw exactly what TRL's row shuffle draws, so the RNG stream (and with it every later sample) stays the
    # stock trainer's; groups then move in the order their rows first appear in that permutation.
    rows = torch.randperm(batch["prompt_ids"].shape[0], generator=generator)
    groups = rows // group_size
    first = torch.full((len(rows) // group_size,), len(rows)).scatter_reduce(0, groups, torch.arange(len(rows)), "amin")
    order = first.argsort()
    permutation = (order[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    return {key: _permute(value, permutation) for key, value in batch.items()}


@dataclass(frozen=True)
class BatchGroup:
    """Rows of a `[prompt | completion]` batch that share one prompt."""

    rows: list[int]
    prefix_ids: torch.Tensor  # [P] real prompt tokens (left padding stripped)
    position_offset: int  # left padding: where the stock trainer places the first prompt token

    @property
    def key(self) -> tuple:
        return (self.position_offset, tuple(self.prefix_ids.tolist()))


def find_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> list[BatchGroup]:
    """Group rows by identical real prompt tokens (left-padded prompts, as TRL lays them out)."""
    width = input_ids.shape[1] - completion_length
    prompt, mask = input_ids[:, :width], attention_mask[:, :width].bool()
    if (mask[:, :-1] & ~mask[:, 1:]).any():
        raise PrefixFlowError("prompts must be left-padded (mask 0...0 1...1), as TRL pads them.")
    keyed = prompt.masked_fill(~mask, -1)
    unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    padding = (~mask).sum(dim=1)
    groups = []
    for index, rows in enumerate(_rows_by_label(inverse.tolist(), len(unique))):
        offset = int(padding[rows[0]])
        groups.append(BatchGroup(rows, prompt[rows[0], offset:], offset))
    return groups


def _rows_by_label(labels: list[int], count: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(count)]
    for row, label in enumerate(labels):
        rows[label].append(row)
    return rows
