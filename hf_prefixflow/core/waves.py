"""Suffix waves sized from free device memory, so the HBM the prefix no longer holds becomes larger waves.

    auto = hf_prefixflow.AutoWaves()     # CUDA; on the CPU: AutoWaves(row_bytes=..., budget_bytes=...)
    with hf_prefixflow.prefix_group(model, prompt_ids) as group:
        for rows in auto.waves(completion_lengths, prefix_length=len(prompt_ids), device=prompt_ids.device):
            out = group(completion_ids[rows], attention_mask=completion_mask[rows])
            loss_fn(out.logits, completion_ids[rows]).backward()

Rows go widest first. A wave's working set is estimated per row from one measured single-row wave (the loop
body, whatever it does: forward and backward here, forward only in the trainer, whose loss backpropagates later),
then each wave takes as many rows as the memory free when it starts allows. Wave sizes change only the schedule,
never the gradients: every split of the rows is exact.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..errors import PrefixFlowError


@contextlib.contextmanager
def _measured(device: torch.device, record) -> Iterator[None]:
    """Peak allocated bytes of the block above what was allocated before it (resets CUDA's peak statistics)."""
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    record(torch.cuda.max_memory_allocated(device) - base)


def free_device_bytes(device: torch.device) -> int:
    """Bytes the next allocations on a CUDA device can use: free device memory plus the caching allocator's
    reserved but unallocated blocks. A cap set with `torch.cuda.set_per_process_memory_fraction` is not reflected
    (give `AutoWaves` a `budget_bytes` then).

    Args:
        device: a CUDA device.

    Returns:
        The byte count.
    """
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def rows_that_fit(row_bytes: float, budget_bytes: float, rows: int) -> int:
    """How many rows of `row_bytes` each fit in `budget_bytes`.

    Args:
        row_bytes: one row's estimated working set, > 0.
        budget_bytes: the bytes a wave may use.
        rows: the rows left; the result is at most this.

    Returns:
        The wave size, in `[1, rows]`.

    Raises:
        PrefixFlowError: `row_bytes <= 0`, or not even one row fits.
    """
    if row_bytes <= 0:
        raise PrefixFlowError(f"the per-row estimate must be positive, got {row_bytes}.")
    count = min(rows, int(budget_bytes // row_bytes))
    if count < 1:
        raise PrefixFlowError(
            f"one suffix row needs about {row_bytes / 2**30:.2f} GiB but {budget_bytes / 2**30:.2f} GiB are free: "
            "shorten the completions, enable prefix offload (apply_prefixflow(model, offload=True)) or activation "
            "checkpointing, or free device memory."
        )
    return count


class AutoWaves:
    """Splits a group's suffix rows into the largest waves that fit in device memory.

    Reuse one instance across groups: the per-row estimate measured on one group serves the later ones, scaled to
    their widths and prefix lengths.

    Args:
        row_bytes: one row's working set in bytes at `reference`; None: measured on the first group with two rows
            or more (CUDA only: the CPU has no allocator statistics). Another width or prefix length scales it by
            the larger of the two ratios, an upper bound for costs linear in each.
        reference: `(suffix width, prefix length)` in tokens at which `row_bytes` holds; given with `row_bytes`.
        budget_bytes: a fixed byte budget per wave; None: `headroom` x `free_device_bytes` when each wave starts
            (CUDA only).
        headroom: the fraction of free memory a wave may use, in (0, 1].

    Attributes:
        sizes: every wave's row count so far, in order (for logging).

    Raises:
        PrefixFlowError: `row_bytes` without `reference` or the reverse; `headroom` outside (0, 1].
    """

    def __init__(self, row_bytes: float | None = None, reference: tuple[int, int] | None = None,
                 budget_bytes: float | None = None, headroom: float = 0.85):
        if (row_bytes is None) != (reference is None):
            raise PrefixFlowError("give row_bytes together with its reference (suffix width, prefix length).")
        if not 0 < headroom <= 1:
            raise PrefixFlowError(f"headroom is a fraction of free memory in (0, 1], got {headroom}.")
        self.row_bytes = row_bytes
        self.reference = reference
        self.budget_bytes = budget_bytes
        self.headroom = headroom
        self.sizes: list[int] = []  # every wave's size so far, for logging

    def estimate(self, width: int, prefix_length: int) -> float:
        """Bytes one row is expected to need (requires `row_bytes`, given or measured).

        Args:
            width: the wave's suffix width in tokens (its widest row's length).
            prefix_length: the group's prefix length in tokens.

        Returns:
            `row_bytes` scaled by the larger of `width / reference[0]` and `prefix_length / reference[1]`.
        """
        ref_width, ref_prefix = self.reference
        return self.row_bytes * max(width / max(ref_width, 1), prefix_length / max(ref_prefix, 1))

    def budget(self, device: torch.device) -> float:
        """Bytes the next wave may use on `device`.

        Args:
            device: the group's device.

        Returns:
            `budget_bytes` if given, else `headroom` x `free_device_bytes(device)`, read now.

        Raises:
            PrefixFlowError: no `budget_bytes` and `device` is not CUDA.
        """
        if self.budget_bytes is not None:
            return self.budget_bytes
        if device.type != "cuda":
            raise PrefixFlowError(
                f"automatic wave sizes read free memory on CUDA devices; on {device.type} pass budget_bytes (and "
                "row_bytes with its reference) to AutoWaves, or choose the waves yourself."
            )
        return self.headroom * free_device_bytes(device)

    def waves(self, lengths: Sequence[int], prefix_length: int, device: torch.device | str) -> Iterator[list[int]]:
        """Yield the waves of one group as lists of row indices, widest rows first.

        Run each wave (its forward, and its backward if the loop body does one) before asking for the next: the
        next wave's size reads the memory free then, and without `row_bytes` the first two waves are single rows,
        the second one measured.

        Args:
            lengths: `[N]` suffix lengths in tokens, one per row (a sequence of ints or a 1-D tensor).
            prefix_length: the group's prefix length in tokens.
            device: the group's device.

        Yields:
            Lists of row indices into `lengths`; together they cover every row exactly once.

        Raises:
            PrefixFlowError: a non-CUDA device without `row_bytes` (and `budget_bytes`); one row needs more than
                the budget.
        """
        device = torch.device(device)
        order = sorted(range(len(lengths)), key=lambda row: -int(lengths[row]))
        while order:
            if self.row_bytes is None and len(order) >= 2:
                if device.type != "cuda":
                    raise PrefixFlowError(
                        f"automatic wave sizes measure a row on CUDA devices; on {device.type} pass row_bytes with "
                        "its reference (and budget_bytes) to AutoWaves, or choose the waves yourself."
                    )
                yield from self._calibrate(order[:2], lengths, prefix_length, device)
                order = order[2:]
                continue
            count = 1  # a lone row needs no estimate
            if self.row_bytes is not None:
                width = int(lengths[order[0]])  # the widest remaining row pads the wave
                count = rows_that_fit(self.estimate(width, prefix_length), self.budget(device), len(order))
            self.sizes.append(count)
            yield order[:count]
            order = order[count:]

    def _calibrate(self, rows: list[int], lengths: Sequence[int], prefix_length: int,
                   device: torch.device) -> Iterator[list[int]]:
        """Two single-row waves; the second is measured (the first allocates gradients and gK/gV)."""
        self.sizes.append(1)
        yield rows[:1]

        def record(peak: int) -> None:
            self.row_bytes, self.reference = float(peak), (int(lengths[rows[1]]), prefix_length)

        self.sizes.append(1)
        with _measured(device, record):
            yield rows[1:]
