"""The training-time KV cache: live prefix K/V, the detached leaves suffix waves read, and their gK/gV.

One `TrainingKVCache` lives for one prefix group. Phase A captures, per attention layer, the live post-RoPE
K/V (still attached to the prefix graph) and hands Phase B detached leaves of the same values. Autograd
accumulates every wave's gradient into the leaves' `.grad` (gK/gV). Phase C feeds those gradients into the live
tensors in one backward through the prefix graph. Nothing outlives `free()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CachedTensor:
    """One prefix tensor (a layer's K or V, or router logits): live in the prefix graph, a leaf for the waves, and
    the gradient the waves give it.

    Each wave's gradient is moved off the leaf into `grad` as soon as autograd accumulates it and summed in
    `sum_dtype` (promoted with the gradient's own): the precision in which the model's own gradients accumulate
    (see `model.kv_grad_dtype`). A single wave's gradient stays as autograd made it until a second one arrives.

    Args:
        live: the tensor as Phase A computed it, attached to the prefix graph: post-RoPE K or V `[1, H_kv, P', D]`,
            or router logits `[P', E]`.
        sum_dtype: the dtype gradients sum in across waves.

    Attributes:
        live: as given (None after `release`).
        leaf: `live` detached, same shape, dtype and device; requires grad iff `live` does (it leads back to a
            trainable parameter).
        grad: the waves' summed gradient, shaped like `leaf`, or None before the first backward.
    """

    def __init__(self, live: torch.Tensor, sum_dtype: torch.dtype = torch.float32):
        self.live = live
        self.sum_dtype = sum_dtype
        # Only tensors that reach trainable parameters need a gradient; the others stay plain constants.
        self.leaf = live.detach().requires_grad_(live.requires_grad)
        self.grad: torch.Tensor | None = None
        self._casts: dict[torch.dtype, torch.Tensor] = {}
        self._hooks = [self._watch(self.leaf)]

    def _watch(self, leaf: torch.Tensor):
        return leaf.register_post_accumulate_grad_hook(self._accumulate) if leaf.requires_grad else None

    def leaf_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The leaf in `dtype`, cast once for the group's life (not once per wave), its gradient summed into `grad`
        like the leaf's own (under autocast with fp32 weights, RoPE leaves K in fp32 while kernels read bf16).

        Args:
            dtype: the dtype a kernel reads.

        Returns:
            `leaf` itself if already in `dtype`, else its cached cast, shaped like `leaf`.
        """
        if dtype == self.leaf.dtype:
            return self.leaf
        if dtype not in self._casts:
            cast = self.leaf.detach().to(dtype).requires_grad_(self.leaf.requires_grad)
            self._hooks.append(self._watch(cast))
            self._casts[dtype] = cast
        return self._casts[dtype]

    def _accumulate(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if self.grad is None:
            self.grad = grad
        elif self.grad.dtype != (dtype := torch.promote_types(grad.dtype, self.sum_dtype)):
            self.grad = self.grad.to(dtype) + grad  # exact: as if accumulated in `dtype` all along
        else:
            self.grad += grad

    def release(self) -> None:
        """Drop the live tensor, the leaves and the gradient."""
        # The hooks refer back to this object: remove them, or the leaves and the prefix graph would stay alive.
        for hook in self._hooks:
            if hook is not None:
                hook.remove()
        self.live = self.leaf = self.grad = None
        self._hooks, self._casts = [], {}


@dataclass
class LayerKV:
    """One attention layer's cached prefix key and value."""

    key: CachedTensor
    value: CachedTensor


class TrainingKVCache:
    """Per-layer prefix K/V for one group, with gK/gV accumulated across suffix waves.

    Args:
        prefix_length: `P'`, the prefix tokens cached (the prefix without its last token).
        grad_dtype: the dtype gK/gV sum in across waves (promoted with their own).

    Attributes:
        layers: attention `layer_idx` -> `LayerKV`, K and V `[1, H_kv, P', D]` post-RoPE, in the model's layout.
        router_logits: MoE `layer_idx` -> `CachedTensor` of the prefix's router logits `[P', E]` (when collected).
        anchor: the prefix forward's output, under engines that gather weights in hooks on module outputs (ZeRO-3,
            FSDP2), else None.
    """

    def __init__(self, prefix_length: int, grad_dtype: torch.dtype = torch.float32):
        self.prefix_length = prefix_length
        self.grad_dtype = grad_dtype  # gK/gV sum in this dtype (promoted with theirs) across waves
        self.layers: dict[int, LayerKV] = {}
        self.router_logits: dict[int, CachedTensor] = {}  # MoE: prefix router logits, for the load-balancing loss
        # The prefix forward's output, set under engines that gather weights in hooks on module outputs (ZeRO-3,
        # FSDP2): Phase C then also starts there with a zero gradient, so every module enters the backward through
        # its output, the last layer's included, as those hooks require (otherwise Phase C would reach it only at
        # its K/V).
        self.anchor: torch.Tensor | None = None

    def capture(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Record a layer's live prefix K/V. Idempotent: a checkpoint recompute in Phase C must not replace them.

        Args:
            layer_idx: the attention module's `layer_idx`.
            key, value: post-RoPE `[1, H_kv, P', D]`, attached to the prefix graph.
        """
        if layer_idx not in self.layers:
            self.layers[layer_idx] = LayerKV(CachedTensor(key, self.grad_dtype), CachedTensor(value, self.grad_dtype))

    def capture_router(self, layer_idx: int, logits: torch.Tensor) -> None:
        """Record a layer's live prefix router logits (idempotent, like `capture`): the load-balancing loss reads
        their leaf in each microbatch and Phase C carries its gradient into the prefix graph.

        Args:
            layer_idx: the decoder layer's index.
            logits: `[P', E]`, attached to the prefix graph.
        """
        if layer_idx not in self.router_logits:
            self.router_logits[layer_idx] = CachedTensor(logits, self.grad_dtype)

    def leaves(self, layer_idx: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's K/V leaves, read by the waves.

        Args:
            layer_idx: the attention module's `layer_idx`.
            dtype: the dtype to read them in (see `CachedTensor.leaf_as`); None: as captured.

        Returns:
            `(key, value)`, each `[1, H_kv, P', D]`, or None if the layer captured nothing.
        """
        entry = self.layers.get(layer_idx)
        if entry is None:
            return None
        if dtype is None:
            return entry.key.leaf, entry.value.leaf
        return entry.key.leaf_as(dtype), entry.value.leaf_as(dtype)

    def tensors(self) -> list[CachedTensor]:
        """Every cached tensor: each layer's K and V, then the router logits."""
        kv = [t for entry in self.layers.values() for t in (entry.key, entry.value)]
        return kv + list(self.router_logits.values())

    def needs_gradients(self) -> bool:
        """Whether any cached K/V leads back to a trainable parameter."""
        return any(t.leaf.requires_grad for t in self.tensors())

    def received_gradients(self) -> bool:
        """Whether any wave's backward reached a cached tensor."""
        return any(t.grad is not None for t in self.tensors())

    def pending(self) -> list[CachedTensor]:
        """Cached tensors that received gK/gV and lead back into the prefix graph."""
        return [t for t in self.tensors() if t.grad is not None and t.live.grad_fn is not None]

    def free(self) -> None:
        """Drop every reference, which releases the prefix graph and its saved activations."""
        for tensor in self.tensors():
            tensor.release()
        self.layers.clear()
        self.router_logits.clear()
        self.anchor = None


def delayed_backward(caches: list[TrainingKVCache], backward=torch.autograd.backward) -> int:
    """Phase C: inject every cache's gK/gV into its live prefix K/V and run one backward through all prefix graphs.

    Each gradient is handed over in its live tensor's dtype and dropped from the cache. A cache's `anchor`, if set,
    joins the outputs with a zero gradient.

    Args:
        caches: the groups' caches; those with nothing `pending` add nothing.
        backward: `backward(outputs, grads)`, two equal-length lists of tensors and their gradients; autograd's by
            default. An engine that must own the backward (DeepSpeed) passes its own, e.g. one scalar
            `sum((output * grad).sum())` whose gradient is exactly `grads`.

    Returns:
        How many cached tensors fed the backward; 0 (and no backward call) when none has a gradient.
    """
    pending = [t for cache in caches for t in cache.pending()]
    if not pending:
        return 0
    anchors = [c.anchor for c in caches if c.anchor is not None and c.pending()]
    backward([t.live for t in pending] + anchors,
             [_handed_over(t) for t in pending] + [torch.zeros_like(a) for a in anchors])
    return len(pending)


def _handed_over(tensor: CachedTensor) -> torch.Tensor:
    """A tensor's gK/gV in its live dtype, its fp32 accumulator dropped as soon as it is cast: otherwise every
    layer's accumulator and its cast copy would live together through the whole of Phase C. A gradient already in
    that dtype (one wave) is handed over as it is."""
    grad, tensor.grad = tensor.grad, None
    return grad.to(tensor.live.dtype)
