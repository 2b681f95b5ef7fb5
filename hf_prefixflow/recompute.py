"""Prefix recompute: a share of prefix layers checkpointed in Phase A and recomputed in Phase C, attention replayed.

Phase A checkpoints `share` of the decoder layers (non-reentrant): only their inputs are kept (on the host, with
offload) and Phase C recomputes the rest of their activations from them, exactly (the same kernels on the same
inputs). Attention is the one part whose recompute costs far more than keeping its result: over a 10k prefix its
forward is about a quarter of a layer's FLOPs, its output one hidden state per token. With offload,
`AttentionReplay` keeps each recomputed layer's attention output and log-sum-exp on the host beside the layer
input, and the recompute replays them instead of running the kernel again; the backward runs the kernel's own
backward on the recomputed q/k/v, equal to Phase A's.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.utils.checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from . import split_attention
from .errors import PrefixFlowError

# Prefix layers recomputed in Phase C instead of copied back. Measured on an H200 (Qwen3-1.7B shape, 10k/2k, N=16,
# benchmarks/results/memory*.md): copying every layer back cost 13-19% of step time, recomputing all 0.5-15.5% (runs
# of the same code spread that widely), at the same Phase-B peak: a layer recomputes faster than its activations
# cross PCIe. Models with more compute per activation byte may prefer a share below 1.
RECOMPUTE_SHARE = 1.0


def check_recompute_share(share: float) -> float:
    if not 0.0 <= share <= 1.0:
        raise PrefixFlowError(f"prefix_recompute is the share of prefix layers that Phase C recomputes, a number in "
                              f"[0, 1]; got {share}.")
    return float(share)


def _spread(count: int, share: float) -> list[int]:
    """Indices of round(share * count) of `count` layers, evenly spaced and ending at the last one (Phase C starts
    there, with nothing prefetched yet, so it should need only a layer input)."""
    chosen = round(share * count)
    return sorted({count - 1 - (i * count) // chosen for i in range(chosen)}) if chosen else []


def decoder_layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]


def _attention_indices(layer: torch.nn.Module) -> set[int]:
    return {m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}


@contextlib.contextmanager
def recomputed_layers(decoder: torch.nn.Module, share: float):
    """Checkpoint `share` of `decoder`'s layers (non-reentrant) for the enclosed prefix forward; layers the user
    already checkpoints stay as they are. Yields the attention `layer_idx` of every checkpointed layer."""
    layers = decoder_layers(decoder)
    switched = [layers[i] for i in _spread(len(layers), share) if not layers[i].gradient_checkpointing]
    if any(getattr(layer, "_compiled_call_impl", None) is not None for layer in switched):
        warnings.warn(
            "torch.compile runs a checkpointed layer eagerly when it has a graph break, and PrefixFlow's attention is "
            "one: the prefix layers recomputed in Phase C (prefix_recompute) run uncompiled in Phase A and C. "
            "prefix_recompute=0 keeps them compiled, at the cost of Phase-B memory.", stacklevel=3)
    previous = [layer.__dict__.get("_gradient_checkpointing_func") for layer in switched]
    recompute = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for layer in switched:
        layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, recompute
    try:
        yield {i for layer in layers if layer.gradient_checkpointing and layer.training
               for i in _attention_indices(layer)}
    finally:
        for layer, func in zip(switched, previous):
            layer.gradient_checkpointing = False
            if func is None:
                del layer._gradient_checkpointing_func
            else:
                layer._gradient_checkpointing_func = func


class AttentionReplay:
    """Phase A's attention results of the recomputed layers, kept through `offload` for their Phase-C recompute."""

    def __init__(self, layers: set[int], offload):
        self.layers = layers
        self.offload = offload  # an `offload.PrefixOffload`: `pack` moves a tensor to the host, `unpack` brings it back
        self.kept: dict[int, tuple] = {}

    def attend(self, module: torch.nn.Module, query, key, value, scale: float | None) -> torch.Tensor | None:
        """Causal attention of one prefix `[1, H, P, D]` as `[1, P, Hq, D]`, replayed in this layer's recompute;
        None when the layer is not recomputed or no kernel returns a log-sum-exp for these tensors."""
        kernel = split_attention.kernel_for(query, key, value) if module.layer_idx in self.layers else None
        if kernel is None:
            return None
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return _ReplayedAttention.apply(query, key, value, scale, kernel, self, module.layer_idx).transpose(1, 2)

    def keep(self, layer: int, out: torch.Tensor, lse: torch.Tensor, state: tuple) -> None:
        self.kept[layer] = (self.offload.pack(out), self.offload.pack(lse), state)

    def take(self, layer: int) -> tuple | None:
        kept = self.kept.pop(layer, None)
        if kept is None:
            return None
        out, lse, state = kept
        return self.offload.unpack(out), self.offload.unpack(lse), state


class _ReplayedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale, kernel, replay: AttentionReplay, layer: int):
        kept = replay.take(layer)
        if kept is None:  # Phase A
            out, lse, state = kernel.forward(query, key, value, True, scale)
            replay.keep(layer, out, lse, state)
        else:  # Phase C's recompute: the inputs are Phase A's, recomputed exactly, so the result is too
            out, lse, state = kept
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.meta = (scale, kernel, state)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        scale, kernel, state = ctx.meta
        dq, dk, dv = kernel.backward(grad, query, key, value, out, lse, True, scale, state)
        return dq, dk, dv, None, None, None, None
