"""DDP rule: a window's backwards (suffix waves and Phase C) run without DDP's hooks; one all-reduce follows.

DDP reduces gradients inside the backward of the last microbatch, but Phase C runs after that backward and touches
only the prefix's parameters, which would leave its gradients unreduced (and DDP's reducer unprepared). So every
backward of an accumulation window accumulates locally, and the gradients are averaged once, in one flattened
all-reduce, before the optimizer step: the same number of collectives on every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .collectives import per_dtype


def local_gradients(model: torch.nn.Module):
    """DDP's `no_sync` for a DDP-wrapped model; nothing otherwise."""
    return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Average the trainable parameters' gradients across ranks, as DDP would have (a missing gradient counts 0)."""
    if isinstance(model, DistributedDataParallel) and dist.is_initialized():
        reduce_trainable_gradients(model, average=True)


def reduce_trainable_gradients(model: torch.nn.Module, group=None, average: bool = False) -> None:
    """Sum (or average) every trainable parameter's gradient over `group` in one flattened all-reduce per dtype;
    every rank joins the same collectives, a missing gradient counting as zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    size = dist.get_world_size(group)

    def reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size

    per_dtype([p.grad for p in params], reduce)  # parameter order: the same on every rank
