"""DeepSpeed ZeRO rule: suffix backwards accumulate inside the window; Phase C is the engine's boundary backward.

Accelerate steps a DeepSpeed engine inside the backward of the last microbatch, and ZeRO reduces (ZeRO-2) or
reduce-scatters (ZeRO-3) at that boundary, so a Phase C run after it would be lost or crash. Here every suffix
backward runs as a non-boundary micro-step, and Phase C goes through the engine as one scalar backward,
`sum((live * gK).sum())`, whose gradient w.r.t. the live prefix K/V is exactly the accumulated gK/gV; that backward
is the boundary, and the engine then steps. gK already carries the loss's scaling (`scale_wrt_gas=False`).
"""

from __future__ import annotations

import contextlib

import torch

from .. import _compat as compat
from ..errors import PrefixFlowError


@contextlib.contextmanager
def inside_window(accelerator):
    """Run a microbatch's own backward as a non-boundary micro-step, whatever Accelerate planned."""
    boundary = accelerator.sync_gradients
    compat.set_sync_gradients(accelerator, False)
    try:
        yield boundary
    finally:
        compat.set_sync_gradients(accelerator, boundary)


def boundary_backward(accelerator):
    """A `backward(outputs, grads)` for `GroupSession.close` that makes Phase C the engine's boundary backward."""

    def backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        surrogate = sum((output * grad).sum() for output, grad in zip(outputs, grads))
        accelerator.backward(surrogate, scale_wrt_gas=False)

    return backward


def check_config(accelerator) -> None:
    if accelerator.mixed_precision == "fp16":
        raise PrefixFlowError(
            "DeepSpeed fp16 loss scaling is not supported with PrefixFlow (gK/gV would carry the scale twice); "
            "use bf16 or fp32."
        )
