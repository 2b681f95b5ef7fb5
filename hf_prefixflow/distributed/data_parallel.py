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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel


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
    for dtype in dict.fromkeys(p.grad.dtype for p in params):  # parameter order: the same on every rank
        grads = [p.grad for p in params if p.grad.dtype == dtype]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        if average:
            flat /= dist.get_world_size(group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
