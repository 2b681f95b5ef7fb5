"""Prefix recompute: a share of prefix layers checkpointed in Phase A and recomputed in Phase C, attention replayed.

Phase A checkpoints `share` of the decoder layers (non-reentrant): only their inputs are kept (on the host, with
offload) and Phase C recomputes the rest of their activations from them, exactly (the same kernels on the same
inputs). Attention is the one part whose recompute costs far more than keeping its result: over a 10k prefix its
forward is about a quarter of a layer's FLOPs, its output one hidden state per token. With offload,
`AttentionReplay` keeps each recomputed layer's attention output and log-sum-exp on the host beside the layer
input, and the recompute replays them instead of running the kernel again; the backward runs the kernel's own
backward on the recomputed q/k/v, equal to Phase A's.

A torch.compile'd layer is not handed to `torch.utils.checkpoint`: torch runs a checkpointed region with a graph
break (PrefixFlow's attention is one) uncompiled. `replay_layer` recomputes it instead, calling the compiled layer
itself: without a graph in Phase A and with one in Phase C, its K/V outputs of its own autograd node. Phase C's
call leaves out the layer's last matrix multiply where its result only feeds the layer output, which the recompute
discards (`DiscardedLinear`); `torch.utils.checkpoint` stops before it in the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import _compat as compat
from . import split_attention
from .attention import PASS_KWARG
from ..errors import PrefixFlowError
from .kv_cache import TrainingKVCache


def _spread(count: int, share: float) -> list[int]:
    """Indices of round(share * count) of `count` layers, evenly spaced and ending at the last one (Phase C starts
    there, with nothing prefetched yet, so it should need only a layer input)."""
    chosen = round(share * count)
    return sorted({count - 1 - (i * count) // chosen for i in range(chosen)}) if chosen else []


def decoder_layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The checkpointable decoder layers (`GradientCheckpointingLayer`s) of `decoder`, in module order."""
    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]


def _attention_indices(layer: torch.nn.Module) -> set[int]:
    return {m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}


def _compiled(layer: torch.nn.Module) -> bool:
    return compat.is_compiled(layer)


def _hooked(layer: torch.nn.Module) -> bool:
    """Module hooks (ZeRO-3, FSDP2) run around the layer's call, which `replay_layer` repeats."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks)


@contextlib.contextmanager
def recomputed_layers(decoder: torch.nn.Module, share: float):
    """Checkpoint `share` of `decoder`'s layers for the enclosed prefix forward: compiled ones through
    `replay_layer`, the others with non-reentrant `torch.utils.checkpoint`; layers the user already checkpoints stay
    as they are. Restores every switched layer on exit.

    Args:
        decoder: the decoder stack (`model.decoder_of`).
        share: the fraction of layers in [0, 1], evenly spaced and ending at the last layer.

    Yields:
        The set of attention `layer_idx` of every checkpointed layer in training mode (the user's included).
    """
    layers = decoder_layers(decoder)
    switched = [layers[i] for i in _spread(len(layers), share) if not layers[i].gradient_checkpointing]
    if any(_compiled(layer) and _hooked(layer) for layer in switched):
        warnings.warn(
            "torch.compile runs a checkpointed layer eagerly when it has a graph break, and PrefixFlow's attention is "
            "one: the prefix layers recomputed in Phase C (prefix_recompute) run uncompiled in Phase A and C, because "
            "module hooks (ZeRO-3, FSDP) on them rule out PrefixFlow's own recompute. prefix_recompute=0 keeps them "
            "compiled, at the cost of Phase-B memory.", stacklevel=3)
    previous = [compat.own_checkpoint_function(layer) for layer in switched]
    recompute = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for layer in switched:
        layer.gradient_checkpointing = True
        compat.set_checkpoint_function(layer, replay_layer if _compiled(layer) and not _hooked(layer) else recompute)
    try:
        yield {i for layer in layers if layer.gradient_checkpointing and layer.training
               for i in _attention_indices(layer)}
    finally:
        for layer, func in zip(switched, previous):
            layer.gradient_checkpointing = False
            compat.set_checkpoint_function(layer, func)


def _layer_of(function: functools.partial) -> torch.nn.Module:
    """The layer of a transformers checkpoint call: `partial(forward, layer, **kwargs)` (5.24) or
    `partial(nn.Module.__call__ bound to the layer, **kwargs)` (5.17)."""
    return function.args[0] if function.args else function.func.__self__


# The checkpoint function of every compiled layer: one object, since dynamo guards on it, and opaque to dynamo (a
# graph break in the layer's compiled call), since it calls the compiled layer itself.
@compat.dynamo_disable
def replay_layer(function: functools.partial, hidden: torch.Tensor, *args):
    """The checkpoint function of a compiled prefix layer: run it under `_LayerReplay`, no graph kept in Phase A,
    recomputed in Phase C.

    Args:
        function: transformers' checkpoint call, a `functools.partial` of the layer's forward with its kwargs
            (the pass marker among them).
        hidden: the layer's input hidden states `[B, T, d]`, the only input gradients flow through.
        *args: the layer's other positional inputs.

    Returns:
        The layer's output, in its own structure.

    Raises:
        PrefixFlowError: another positional input requires grad.
    """
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise PrefixFlowError("PrefixFlow's recompute of a compiled layer takes gradients through the hidden states "
                              "only; this layer gets another positional input that requires grad.")
    call = _LayerCall(_layer_of(function), hidden, args, function.keywords)
    trainable = any(p.requires_grad for p in call.layer.parameters())
    # An autograd node whose inputs need no gradient would give none: a layer after frozen embeddings still trains.
    anchor = torch.empty(0, device=hidden.device, requires_grad=trainable)
    flat = _LayerReplay.apply(call, anchor, hidden)
    outputs, captured = flat[:len(flat) - call.captured_count], flat[len(flat) - call.captured_count:]
    call.recapture(captured)
    return tree_unflatten(list(outputs), call.spec)


class _LayerCall:
    """One compiled layer's prefix call: run it again, with its captures going to a scratch cache."""

    def __init__(self, layer: torch.nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict):
        self.layer, self.args, self.kwargs = layer, args, kwargs
        device_type = hidden.device.type
        # Phase A's autocast, which Phase C's recompute runs under again (as torch.utils.checkpoint does)
        self.autocast = [dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                              dtype=torch.get_autocast_dtype(kind), cache_enabled=torch.is_autocast_cache_enabled())
                         for kind in sorted({device_type, "cpu"})]
        # Phase A's random state, drawn from again by the recompute (dropout masks), as torch.utils.checkpoint does
        self.cpu_rng = torch.get_rng_state()
        self.rng_devices, self.device_rng = torch.utils.checkpoint.get_device_states(hidden)
        self.rng_type = device_type
        self.cache: TrainingKVCache = kwargs[PASS_KWARG].cache  # the group's: receives the node's K/V outputs
        self.spec = None  # the layer output's pytree structure
        self.kv_layers: list[int] = []
        self.router_layers: list[int] = []

    @property
    def captured_count(self) -> int:
        return 2 * len(self.kv_layers) + len(self.router_layers)

    def run(self, hidden: torch.Tensor, recompute: bool = False) -> tuple[list, list[torch.Tensor]]:
        """The layer's compiled forward on `hidden`: its flat outputs, and the K/V (router logits) it captured. A
        `recompute`'s outputs only root a backward: their values are not computed where that can be skipped."""
        scratch = TrainingKVCache(self.cache.prefix_length, self.cache.grad_dtype)
        kwargs = {**self.kwargs, PASS_KWARG: dataclasses.replace(self.kwargs[PASS_KWARG], cache=scratch)}
        switched, self.layer.gradient_checkpointing = self.layer.gradient_checkpointing, False  # a plain call
        last = discardable_projection(self.layer) if recompute else None
        try:
            if last is not None:
                last.__class__ = DiscardedLinear  # one class for every layer: one more graph variant, not one per layer
            with contextlib.ExitStack() as stack:
                if recompute:
                    stack.enter_context(self._phase_a_rng())
                for state in self.autocast:
                    stack.enter_context(torch.autocast(**state))
                flat, self.spec = tree_flatten(self.layer(hidden, *self.args, **kwargs))
        finally:
            self.layer.gradient_checkpointing = switched  # on in Phase A, off again by Phase C
            if last is not None:
                last.__class__ = torch.nn.Linear
        self.kv_layers, self.router_layers = sorted(scratch.layers), sorted(scratch.router_logits)
        captured = [t.live for i in self.kv_layers for t in (scratch.layers[i].key, scratch.layers[i].value)]
        captured += [scratch.router_logits[i].live for i in self.router_layers]
        scratch.free()
        return flat, captured

    @contextlib.contextmanager
    def _phase_a_rng(self):
        accelerator = {"device_type": self.rng_type} if self.rng_devices else {}  # torch 2.11 refuses None
        with torch.random.fork_rng(devices=self.rng_devices, **accelerator):
            torch.set_rng_state(self.cpu_rng)
            if self.rng_devices:
                torch.utils.checkpoint.set_device_states(self.rng_devices, self.device_rng, **accelerator)
            yield

    def recapture(self, captured: tuple[torch.Tensor, ...]) -> None:
        """Hand the group's cache the node's outputs: their gradients enter Phase C through the node."""
        kv, router = captured[:2 * len(self.kv_layers)], captured[2 * len(self.kv_layers):]
        for i, layer_idx in enumerate(self.kv_layers):
            self.cache.capture(layer_idx, kv[2 * i], kv[2 * i + 1])
        for layer_idx, logits in zip(self.router_layers, router):
            self.cache.capture_router(layer_idx, logits)


class _LayerReplay(torch.autograd.Function):
    """A compiled layer as one autograd node: forward without a graph, backward recomputes it (attention replayed)
    and runs the recomputed graph's backward, the way reentrant checkpointing does, K/V outputs included."""

    @staticmethod
    def forward(ctx, call: _LayerCall, anchor: torch.Tensor, hidden: torch.Tensor):
        flat, captured = call.run(hidden)
        ctx.call = call
        ctx.save_for_backward(hidden)  # through the offload's hooks: the layer input waits on the host
        ctx.set_materialize_grads(False)
        return (*flat, *captured)

    @staticmethod
    def backward(ctx, *grads):
        (hidden,) = ctx.saved_tensors
        hidden = hidden.detach().requires_grad_(ctx.needs_input_grad[2])
        with torch.enable_grad():
            flat, captured = ctx.call.run(hidden, recompute=True)
        pairs = [(out, grad) for out, grad in zip([*flat, *captured], grads)
                 if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return None, None, hidden.grad


# Decoder layers whose MLP output goes straight into the residual sum that is the layer's output, read by nothing
# else (tests/test_compile.py trains each against the full-sequence path). Not Gemma2/3, which normalise it first.
RESIDUAL_MLP_LAYERS = frozenset({("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"),
                                 ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer")})


def discardable_projection(layer: torch.nn.Module) -> torch.nn.Linear | None:
    """The projection Phase C's recompute may leave uncomputed (`DiscardedLinear`).

    Args:
        layer: a decoder layer.

    Returns:
        The MLP's down projection of a `RESIDUAL_MLP_LAYERS` layer when it is a plain `nn.Linear` with a plain
        weight, no hooks could read its output and dynamo guards on its class (it inlines modules, torch's
        default); else None.
    """
    mlp = getattr(layer, "mlp", None)
    down = getattr(mlp, "down_proj", None)
    plain = type(down) is torch.nn.Linear and type(down.weight) is torch.nn.Parameter
    if (plain and (type(layer).__module__, type(layer).__name__) in RESIDUAL_MLP_LAYERS and not _hooked(mlp)
            and not _hooked(down) and not compat.global_forward_hooks()
            and compat.dynamo_inlines_modules()):
        return down
    return None


class DiscardedLinear(torch.nn.Linear):
    """A layer's last projection while the layer is recomputed for its backward: its output is never read, so only
    its backward runs (a third of the MLP's matrix multiplies). Inputs are cast as autocast casts a linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., in]` -> an uninitialised `[..., out]` whose backward is the linear's."""
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = _autocast(x, dtype), _autocast(weight, dtype)
            bias = None if bias is None else _autocast(bias, dtype)
        return _DiscardedProduct.apply(x, weight, bias)


def _autocast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Autocast's cast of a linear's input: float64 stays float64."""
    return tensor.to(dtype) if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16) else tensor


class _DiscardedProduct(torch.autograd.Function):
    """`x @ weight.T + bias`, left uncomputed: forward allocates the output, backward is the linear's."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


class AttentionReplay:
    """Phase A's attention results of the recomputed layers, kept through `offload` for their Phase-C recompute.

    Args:
        layers: the attention `layer_idx` of the recomputed layers (what `recomputed_layers` yields).
        offload: the group's `offload.PrefixOffload`: `pack` moves a tensor to the host, `unpack` brings it back.
    """

    def __init__(self, layers: set[int], offload):
        self.layers = layers
        self.offload = offload
        self.kept: dict[int, tuple] = {}
        self.replayed: set[int] = set()

    def attend(self, module: torch.nn.Module, query, key, value, scale: float | None) -> torch.Tensor | None:
        """Causal attention over one prefix, computed in Phase A and replayed in this layer's Phase-C recompute.
        The backward runs Phase A's kernel's, whatever Phase C's context would pick (the kept state and log-sum-exp
        are that kernel's).

        Args:
            module: the attention module (its `layer_idx`).
            query: `[1, H_q, T, D]`, post-RoPE, in the kernel's dtype.
            key, value: `[1, H_kv, T, D]`, post-RoPE.
            scale: softmax scale; None: `D ** -0.5`.

        Returns:
            `[1, T, H_q, D]`; None when the layer is not recomputed or no kernel returns a log-sum-exp for these
            tensors (the caller then runs the base attention).
        """
        layer = module.layer_idx
        if layer not in self.layers:
            return None
        kept = self.kept.get(layer)
        kernel = kept[-1] if kept is not None else split_attention.kernel_for(query, key, value)
        if kernel is None:
            return None
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return _ReplayedAttention.apply(query, key, value, scale, kernel, self, layer).transpose(1, 2)

    def keep(self, layer: int, out: torch.Tensor, lse: torch.Tensor, state: tuple, kernel) -> None:
        """Phase A: keep a layer's attention output, log-sum-exp and kernel state (tensors through the offload).

        Raises:
            PrefixFlowError: the layer's attention was already replayed (recomputed twice, or a shared layer_idx).
        """
        if layer in self.replayed:
            raise PrefixFlowError(f"layer {layer}'s prefix attention ran again after its Phase-C replay: a layer "
                                  "recomputed twice (or two modules sharing one layer_idx) is not supported.")
        self.kept[layer] = (self.offload.pack(out), self.offload.pack(lse), state, out.stride(), kernel)

    def take(self, layer: int) -> tuple | None:
        """Phase C: a layer's kept `(out, lse, state, out_stride)`, back on the device, or None in Phase A."""
        kept = self.kept.pop(layer, None)
        if kept is None:
            return None
        self.replayed.add(layer)
        out, lse, state, stride, _ = kept  # the kernel was read by `attend`
        return self.offload.unpack(out), self.offload.unpack(lse), state, stride


class _ReplayedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale, kernel, replay: AttentionReplay, layer: int):
        kept = replay.take(layer)
        if kept is None:  # Phase A
            out, lse, state = kernel.forward(query, key, value, True, scale)
            replay.keep(layer, out, lse, state, kernel)
            stride = out.stride()
        else:  # Phase C's recompute: the inputs are Phase A's, recomputed exactly, so the result is too
            out, lse, state, stride = kept  # `stride`: the layout the kernel returned `out` in, for its backward
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.meta = (scale, kernel, state, stride)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        scale, kernel, state, out_stride = ctx.meta
        out = split_attention.in_layout(out, out_stride)
        grad = split_attention.in_layout(grad, out_stride)
        dq, dk, dv = kernel.backward(grad, query, key, value, out, lse.contiguous(), True, scale, state)
        return dq, dk, dv, None, None, None, None
