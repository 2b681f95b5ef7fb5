"""The training-time KV cache: live prefix K/V, the detached leaves suffix waves read, and their gK/gV.

One `TrainingKVCache` lives for one prefix group. Phase A captures, per attention layer, the live post-RoPE
K/V (still attached to the prefix graph) and hands Phase B detached leaves of the same values. Autograd
accumulates every wave's gradient into the leaves' `.grad` (gK/gV). Phase C feeds those gradients into the live
tensors in one backward through the prefix graph. Nothing outlives `free()`.

With `offload_kv` the K/V and their gradient sums live on the host instead (`StreamedTensor`): a wave brings each
layer's K/V in for its turn, and each layer's sum crosses to the device to take the wave's gradient and goes back;
Phase C brings each sum in as its layer's backward starts. The device then holds a layer or two of them, not all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PrefixFlowError


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
        self.requires_grad = live.requires_grad
        self.shape, self.dtype, self.device = live.shape, live.dtype, live.device
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

    def handover(self) -> torch.Tensor:
        """Phase C: the gradient to seed `live` with, in its dtype; the fp32 accumulator is dropped as soon as it is
        cast (otherwise every layer's accumulator and its cast copy would live together through Phase C). A gradient
        already in that dtype (one wave) is handed over as it is."""
        grad, self.grad = self.grad, None
        return grad.to(self.live.dtype)


class StreamedTensor:
    """One prefix K or V kept on the host from Phase A to Phase C, with its gradient sum (`offload_kv`).

    Phase A parks the value on the host; `live` is then a 0-dim handle on the prefix graph whose backward emits the
    summed gradient into the real K or V (`_Handle`), so the device copy is freed once the layer's forward is done.
    Each `fetch` brings a device copy whose backward adds the wave's gradient into the host sum (`_Fetched`). Host
    copies go through `host` (an `offload.PrefixOffload`: its pool and copy stream).

    Args:
        live: post-RoPE K or V `[1, H_kv, P', D]`, attached to the prefix graph (or not, when scoring).
        sum_dtype: the dtype gradients sum in across waves (promoted with the gradient's own).
        host: the group's offloader.
        order: the group's streamed tensors in capture order, which this one joins (for prefetching in Phase C).

    Attributes:
        live: the handle `[]` (None when `live` needed no gradient or after `release`).
        grad: the host sum's parked copy, or None before the first backward.
    """

    def __init__(self, live: torch.Tensor, sum_dtype: torch.dtype, host, order: list["StreamedTensor"]):
        self.requires_grad = live.requires_grad
        self.shape, self.dtype, self.device = live.shape, live.dtype, live.device
        self.sum_dtype = sum_dtype
        self.host, self.order, self.index = host, order, len(order)
        order.append(self)
        self.value = host.park(live.detach())
        self.grad = None
        # Scoring (no gradient) needs no handle: nothing runs Phase C.
        self.live = _Handle.apply(live, self) if live.requires_grad else None
        # A leaf that requires grad makes each wave's copy an autograd node whose backward is `accumulate`.
        self._anchor = torch.empty(0, device=live.device, requires_grad=True) if live.requires_grad else None

    def prefetch(self) -> None:
        """Start bringing the value to the device for the next `fetch`."""
        self.host.prefetch(self.value)

    def fetch(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A device copy of the value for one wave's layer.

        Args:
            dtype: the dtype to read it in; None: as captured.

        Returns:
            `[1, H_kv, P', D]`; when training, an autograd node whose gradient `accumulate` adds to the host sum.
        """
        if self._anchor is None or not torch.is_grad_enabled():
            return self.host.load(self.value).to(dtype or self.dtype)
        return _Fetched.apply(self._anchor, self, dtype or self.dtype)

    def accumulate(self, grad: torch.Tensor) -> None:
        """Add one wave's gradient to the host sum: the sum comes to the device, takes it, and goes back. Starts
        bringing in the previous layer's sum of the same kind, whose turn comes next in the backward."""
        if self.value is None:
            raise PrefixFlowError("a suffix wave's backward ran after its prefix group closed: its gradient would "
                                  "never reach the prompt. Call backward on each wave while the group is open.")
        dtype = torch.promote_types(grad.dtype, self.sum_dtype)
        if self.grad is None:
            self.grad = self.host.park(grad.to(dtype))
        else:
            total = self.host.load(self.grad)
            if total.dtype != dtype:  # a wider gradient: the sum goes on in its dtype, in a buffer of that size
                self.grad = self.host.park(total.to(dtype) + grad)
            else:
                self.host.repark(self.grad, total.add_(grad))
        self._prefetch_previous()

    def _prefetch_previous(self) -> None:
        if self.index >= 2:  # [K0, V0, K1, V1, ...]: a sum is only ever rewritten right after it is loaded
            self.order[self.index - 2].prefetch_grad()

    def prefetch_grad(self) -> None:
        """Start bringing the gradient sum to the device."""
        if self.grad is not None:
            self.host.prefetch(self.grad)

    def handover(self) -> torch.Tensor:
        """Phase C: the seed of the handle (one); the summed gradient itself enters through the handle's backward.
        The last tensor captured, whose backward runs first, starts bringing its sum in."""
        if self.index == len(self.order) - 1:
            self.prefetch_grad()
        return torch.ones((), dtype=self.live.dtype, device=self.live.device)

    def emit(self) -> torch.Tensor:
        """Phase C: the summed gradient on the device in the captured dtype; starts bringing in the one before."""
        if self.index > 0:
            self.order[self.index - 1].prefetch_grad()
        grad, self.grad = self.grad, None
        return self.host.load(grad).to(self.dtype)

    def release(self) -> None:
        """Drop the handle and the parked copies (their host buffers return with the offloader's)."""
        self.live = self.value = self.grad = self._anchor = None


class _Fetched(torch.autograd.Function):
    """A wave's device copy of a streamed tensor; its backward adds the wave's gradient into the host sum."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, tensor: StreamedTensor, dtype: torch.dtype):
        ctx.tensor = tensor
        return tensor.host.load(tensor.value).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.tensor.accumulate(grad)
        return None, None, None


class _Handle(torch.autograd.Function):
    """Phase C's entry into a streamed tensor's prefix graph: seeded with one, it emits the waves' summed gradient
    into the live K or V, when autograd reaches its layer (the last layer's first)."""

    @staticmethod
    def forward(ctx, live: torch.Tensor, tensor: StreamedTensor):
        ctx.tensor = tensor
        return live.new_zeros(())

    @staticmethod
    def backward(ctx, seed):
        return ctx.tensor.emit() * seed, None


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
        # `offload_kv`: the group's offloader, which parks each captured K/V on the host (`StreamedTensor`).
        self.host = None
        self._streamed: list[StreamedTensor] = []
        self._last_read: int | None = None  # the layer the last wave read, for the direction to prefetch in
        self.grad_dtype = grad_dtype  # gK/gV sum in this dtype (promoted with theirs) across waves
        self.layers: dict[int, LayerKV] = {}
        self.router_logits: dict[int, CachedTensor] = {}  # MoE: prefix router logits, for the load-balancing loss
        # Recurrent layers' state at the end of the prefix (`states.StateView`): (layer_idx, kind, state_idx) ->
        # convolution window `[1, C, k]` or recurrent state `[1, ...]`.
        self.states: dict[tuple[int, str, int], CachedTensor] = {}
        self.state_reads: set[int] = set()  # the recurrent layers the current wave served their state to
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
        if layer_idx in self.layers:
            return
        if self.host is None or key.device != self.host.device:  # streams serve the offloader's device only
            self.layers[layer_idx] = LayerKV(CachedTensor(key, self.grad_dtype), CachedTensor(value, self.grad_dtype))
        else:
            self.layers[layer_idx] = LayerKV(*(StreamedTensor(t, self.grad_dtype, self.host, self._streamed)
                                               for t in (key, value)))

    def capture_router(self, layer_idx: int, logits: torch.Tensor) -> None:
        """Record a layer's live prefix router logits (idempotent, like `capture`): the load-balancing loss reads
        their leaf in each microbatch and Phase C carries its gradient into the prefix graph.

        Args:
            layer_idx: the decoder layer's index.
            logits: `[P', E]`, attached to the prefix graph.
        """
        if layer_idx not in self.router_logits:
            self.router_logits[layer_idx] = CachedTensor(logits, self.grad_dtype)

    def capture_state(self, key: tuple[int, str, int], live: torch.Tensor) -> None:
        """Record a recurrent layer's live prefix state (idempotent, like `capture`). Its gradient sums in at least
        float32 for a float32 state (`CachedTensor` promotes), and Phase C seeds it in the state's own dtype.

        Args:
            key: `(layer_idx, kind, state_idx)`, kind `"conv"` or `"recurrent"`.
            live: `[1, ...]`, attached to the prefix graph.
        """
        if key not in self.states:
            self.states[key] = CachedTensor(live, self.grad_dtype)

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
        if self.host is not None:
            return self._fetch(layer_idx, entry, dtype)
        if dtype is None:
            return entry.key.leaf, entry.value.leaf
        return entry.key.leaf_as(dtype), entry.value.leaf_as(dtype)

    def _fetch(self, layer_idx: int, entry: LayerKV, dtype: torch.dtype | None):
        """Streamed K/V for one layer, and the next layer's started on their way: upwards in a forward, downwards in
        a checkpointed backward's recompute (it starts at the last layer, the one the forward ended on)."""
        layers = list(self.layers)
        position = layers.index(layer_idx)
        step = -1 if self._last_read is not None and layer_idx <= self._last_read else 1
        self._last_read = layer_idx
        key, value = entry.key.fetch(dtype), entry.value.fetch(dtype)
        if 0 <= position + step < len(layers):
            following = self.layers[layers[position + step]]
            following.key.prefetch()
            following.value.prefetch()
        return key, value

    def tensors(self) -> list[CachedTensor]:
        """Every cached tensor: each layer's K and V, the router logits, then the recurrent states."""
        kv = [t for entry in self.layers.values() for t in (entry.key, entry.value)]
        return kv + list(self.router_logits.values()) + list(self.states.values())

    def needs_gradients(self) -> bool:
        """Whether any cached K/V leads back to a trainable parameter."""
        return any(t.requires_grad for t in self.tensors())

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
        self.states.clear()
        self.anchor = None
        self._streamed = []


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
             [t.handover() for t in pending] + [torch.zeros_like(a) for a in anchors])
    return len(pending)
