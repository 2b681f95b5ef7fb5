"""Collectives the parallel rules share: per-dtype flattened transfers, all-gathers, and the model's device."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .._compat import _flatten_dense_tensors, _unflatten_dense_tensors


def device_of(model: torch.nn.Module) -> torch.device:
    """Where `model`'s (first) parameters live: the device its collectives run on."""
    return next(model.parameters()).device


def per_dtype(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Run `collective` in place on one flattened buffer per dtype of `tensors`, then copy the result back into
    them. Dtypes go in first-appearance order, so ranks holding the same list run the same collectives."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        collective(flat)
        for tensor, result in zip(same, _unflatten_dense_tensors(flat, same)):
            tensor.copy_(result)


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on every rank), in rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered
