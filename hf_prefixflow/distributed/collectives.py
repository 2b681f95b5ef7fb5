"""What the parallel rules share: per-dtype flattened transfers, all-gathers, the model's device, and the settings
none of them runs yet."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .._compat import _flatten_dense_tensors, _unflatten_dense_tensors
from ..errors import PrefixFlowError
from ..core.access import config_of


def device_of(model: torch.nn.Module) -> torch.device:
    """Where `model`'s (first) parameters live: the device its collectives run on."""
    return next(model.parameters()).device


def refuse_offload_kv(model: torch.nn.Module, rule: str) -> None:
    """`offload_kv` keeps each group's K/V on its own process's host; the parallel rules move or shard K/V.

    Raises:
        PrefixFlowError: `model`'s config has `offload_kv`.
    """
    if config_of(model).offload_kv:
        raise PrefixFlowError(f"offload_kv is not available with {rule} yet: it streams a group's K/V from one "
                              "process's host memory. Use offload=True (the prompt's activations still wait on the "
                              "host), or train without it.")


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
