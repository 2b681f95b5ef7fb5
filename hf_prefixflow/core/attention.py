"""The PrefixFlow attention function, registered through transformers' `AttentionInterface`, wrapping the model's own.

`apply_prefixflow` switches a model from attention `X` to `prefixflow_X`. The function behaves exactly like `X`
unless a forward carries a pass marker in its kwargs (transformers hands model kwargs to attention unfiltered, and
checkpointing binds them, so a recompute sees the same marker):
- `PrefixPass` (Phase A): plain causal attention through `X`, plus an idempotent capture of the post-RoPE K/V.
- `SuffixPass` (Phase B): suffix queries attend to the cached prefix K/V and their own. A padded `sdpa` wave with no
  window, softcap or sinks runs `split_attention` (the cache read in place, merged by log-sum-exp); any other wave
  attends to `[cached prefix K/V ; suffix K/V]` under its visibility mask, in the form `X` takes (bottom-right
  causal bias, boolean or additive mask, or a flex BlockMask).
In a layer with an MoE router, every call also hands the routes the forward carries (if any) to that router.

Decoder layers that call their attention with a fixed argument list (StableLM, Nemotron) drop the model's kwargs,
marker included. `bridge_layers` hooks such layers: the layer's own PrefixFlow kwargs ride a context variable for
the duration of the layer's call and are handed to its attention modules' calls. A checkpoint recompute calls the
layer again with the same kwargs, so it sees the same marker.
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Protocol

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .. import _compat as compat
from . import split_attention
from ..errors import PrefixFlowError
from .access import attribute
from .kv_cache import TrainingKVCache
from .layouts import PADDING, PREFIX, Wave
from .moe import PUBLISHES, ROUTES_KWARG, publish

class Replay(Protocol):
    """Phase A attention results a recomputed layer replays in Phase C (`recompute.AttentionReplay`)."""

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None) -> torch.Tensor | None: ...


NAME_PREFIX = "prefixflow_"
SUPPORTED_BASES = ("sdpa", "eager", "flex_attention")
PASS_KWARG = "prefixflow_pass"
SP_KWARG = "prefixflow_sp"  # a `distributed.ulysses.SequenceParallel`: this forward is sharded along the sequence
TOWER = "_prefixflow_tower"  # set on modules outside the decoder of an image-text model: they cache nothing

# The dynamo recompile limit PrefixFlow's phases need (the trainer sets it; torch's default is 8): compiled variants
# of one code object for Phase A, the waves and Phase C's recompute (with and without a graph), each with layer
# inputs that need a gradient and, with frozen embeddings (LoRA), without; transformers' `deprecate_kwarg` wrapper
# shares one code object between a decoder layer's forward and its attention's. Counts: docs/compile.md.
RECOMPILE_LIMIT = 16


CARRIED_KWARGS = (PASS_KWARG, ROUTES_KWARG, SP_KWARG)
_layer_kwargs: ContextVar[dict | None] = ContextVar("prefixflow_layer_kwargs", default=None)


class _Reach:
    """A marker `probe` sends through the model to see which attention calls receive the model's kwargs."""

    calls: list[tuple[torch.nn.Module, bool]] | None = None  # (attention module, got the marker), while probing


REACH = _Reach()


@dataclass(frozen=True, eq=False)
class PrefixPass:
    """Phase A marker, passed as the `prefixflow_pass` kwarg: capture each layer's K/V into `cache`.

    Attributes:
        cache: the group's cache (or a stand-in with its `capture` / `capture_router`).
        collect_router_logits: also capture each MoE layer's router logits.
        replay: the recomputed layers' attention results, replayed in Phase C (offload with recompute), or None.
    """

    cache: TrainingKVCache
    collect_router_logits: bool = False
    replay: Replay | None = None


@dataclass(frozen=True, eq=False)
class SuffixPass:
    """Phase B marker, passed as the `prefixflow_pass` kwarg: attend over `cache`'s prefix K/V plus `wave`'s own.

    Attributes:
        cache: the group's cache, read through `cache.leaves(layer_idx)`.
        wave: the wave being run; its geometry gives the visibility.
        concatenated: attend over `[prefix ; suffix]` K/V concatenated per wave, in one kernel, instead of the split
            attention's two kernels merged by log-sum-exp: one bf16 rounding of the output and of dQ instead of two,
            for a copy of the cache per layer and wave (pair trainers' two-row waves; `docs/dpo.md`).
    """

    cache: TrainingKVCache
    wave: Wave
    concatenated: bool = False


def wrapped_name(base: str) -> str:
    """The registered name of PrefixFlow's wrapper of implementation `base` (`"sdpa"` -> `"prefixflow_sdpa"`)."""
    return NAME_PREFIX + base


def base_name(name: str) -> str:
    """The implementation a (possibly) wrapped attention name delegates to (`"prefixflow_sdpa"` -> `"sdpa"`)."""
    return name.removeprefix(NAME_PREFIX)


def is_wrapped(name: str | None) -> bool:
    """Whether an `_attn_implementation` name is PrefixFlow's, i.e. `apply_prefixflow` switched the model."""
    return bool(name) and name.startswith(NAME_PREFIX)


@lru_cache(maxsize=None)
def _eager_function(module_type: type) -> Callable:
    # "eager" is each model file's own function (Gemma2's adds softcapping, gpt-oss's adds sinks).
    return getattr(sys.modules[module_type.__module__], "eager_attention_forward")


def _base_function(module: torch.nn.Module, base: str) -> Callable:
    return _eager_function(type(module)) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]


def _check_call(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if dropout:
        raise PrefixFlowError(
            f"attention dropout ({dropout}) draws a new mask every forward, so no prefix pass can stand for N "
            "full sequences. Set config.attention_dropout = 0.0 (or train with dropout off) to use PrefixFlow."
        )
    if kwargs.get("output_attentions"):
        raise PrefixFlowError("output_attentions is not available inside a prefix group; call the model outside it.")


def chunk_size(module: torch.nn.Module) -> int | None:
    """The attention chunk of `module`'s layer, or None: in a `chunked_attention` layer (Llama 4) a token attends to
    the keys of its own chunk of `config.attention_chunk_size` positions only, counted from the sequence's first token
    (transformers' `chunked_overlay`). The layer's kind is read as transformers' masks read it: `layer_types`, or
    every layer when the config has a chunk size and neither layer types nor a sliding window."""
    config = getattr(module, "config", None)
    try:
        size = getattr(config, "attention_chunk_size", None)
        if not isinstance(size, int) or isinstance(size, bool):
            return None
        kinds, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
        if kinds:
            return size if isinstance(index, int) and index < len(kinds) and kinds[index] == "chunked_attention" \
                else None
        return size if getattr(config, "sliding_window", None) is None else None
    except Exception:  # noqa: BLE001 - a config that refuses the read (per-layer attributes) has no chunks
        return None


_UNSET = object()


def layer_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window of `module`'s layer in tokens, or None: as its attention call receives it (the
    `sliding_window` argument, else the module's attribute), else as transformers' masks read it from the config:
    `config.sliding_window` on a layer whose `layer_types` kind names "sliding", or on every layer where the config
    has no layer types (Phi-MoE's attention receives no window; its masks carry the config's)."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    own = attribute(module, "sliding_window", _UNSET)
    if own is not _UNSET:
        return own
    config = getattr(module, "config", None)
    try:
        size = getattr(config, "sliding_window", None)
        if not isinstance(size, int) or isinstance(size, bool):
            return None
        kinds, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
        if kinds:
            return size if isinstance(index, int) and index < len(kinds) and "sliding" in kinds[index] else None
        return size
    except Exception:  # noqa: BLE001 - a config that refuses the read (per-layer attributes) sets no window here
        return None


def _wave_mask(wave: Wave, base: str, window: int | None, query: torch.Tensor, kv_length: int,
               chunk: int | None = None):
    """The wave's visibility in the form the wrapped implementation consumes."""
    if base == "sdpa" and wave.is_plain_causal and (window is None or window >= kv_length) and chunk is None:
        return causal_lower_right(query.shape[2], kv_length)
    if base == "flex_attention":
        return _block_mask(wave, window, query, kv_length, chunk)
    visible = wave.visible(window) if chunk is None else wave.visible(window, chunk)
    if base == "eager":
        additive = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        return additive.masked_fill_(~visible, torch.finfo(query.dtype).min)
    return visible


def _block_mask(wave: Wave, window: int | None, query: torch.Tensor, kv_length: int, chunk: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    key_seg, key_pos = wave.key_geometry()
    q_seg, q_pos, cached, first = wave.segment_ids, wave.position_ids, wave.cached_length, wave.position_offset
    sees_row = wave.padding_sees_row

    def mask_mod(b, h, q, kv):
        own = (key_seg[b, kv] == q_seg[b, q]) & (key_seg[b, kv] >= 0) & (key_pos[b, kv] <= q_pos[b, q])
        allowed = (key_seg[b, kv] == PREFIX) | own
        if window is not None:
            allowed = allowed & (q_pos[b, q] - key_pos[b, kv] < window)
        if chunk is not None:
            allowed = allowed & ((q_pos[b, q] - first) // chunk == (key_pos[b, kv] - first) // chunk)
        if sees_row:  # a padding query: its row's earlier real keys, not itself (`Wave.padding_sees_row`)
            pad = q_seg[b, q] == PADDING
            row = pad & (key_seg[b, kv] >= 0) & (key_pos[b, kv] <= q_pos[b, q])
            return allowed | row | ((kv - cached == q) & ~pad)
        return allowed | (kv - cached == q)

    return create_block_mask(mask_mod, query.shape[0], None, query.shape[2], kv_length, device=query.device)


def _check_prefix(cache: TrainingKVCache, module, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether this layer has cached prefix K/V for the wave (checked against the wave's own K/V)."""
    entry = cache.layers.get(module.layer_idx)
    if entry is None:
        if cache.prefix_length:
            raise PrefixFlowError(f"layer {module.layer_idx} has no cached prefix K/V; was Phase A skipped?")
        return False
    for cached, current in zip((entry.key, entry.value), (key, value)):
        if cached.dtype != current.dtype or cached.device != current.device:
            raise PrefixFlowError(
                f"the prefix K/V of layer {module.layer_idx} are {cached.dtype} on {cached.device} but this wave "
                f"computes {current.dtype} on {current.device}: enter the group and run its waves under the same "
                "autocast, dtype and device."
            )
    return True


def index_scaled_query(module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`query` with Llama 4's attention temperature at the tokens' `positions` instead of their indices in the forward.

    Llama 4's layers without RoPE multiply each query by `log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`, `i`
    the token's index in the forward's input plus the inference cache's length (`Llama4TextAttention`,
    `attn_temperature_tuning`). PrefixFlow's forwards hold no such cache, so a wave's tokens get their index in the
    wave, and a left-padded prompt's Phase A its index without the padding; the full sequence gives each token its
    index in `[P || S]`, which is its position. Other modules: `query` as it is.

    Args:
        module: the attention module; acts where it has `attn_temperature_tuning` on and `use_rope` off.
        query: `[B, H, S, D]`, scaled at indices `0 .. S-1`.
        positions: `[B, S]` or `[1, S]` int, each token's index in its full sequence.

    Returns:
        `[B, H, S, D]` in `query`'s dtype.
    """
    if not attribute(module, "attn_temperature_tuning", False) or attribute(module, "use_rope", True):
        return query

    def temperature(index: torch.Tensor) -> torch.Tensor:  # as the module computes it, from float positions
        return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    index = torch.arange(query.shape[2], device=query.device)
    ratio = temperature(positions.to(query.device)) / temperature(index)
    return (query * ratio[:, None, :, None]).to(query.dtype)


def _suffix_attention(module, query, key, value, marker: SuffixPass, base: str, base_fn, dropout, scaling, kwargs):
    cache = marker.cache
    query = index_scaled_query(module, query, marker.wave.position_ids)
    cached = _check_prefix(cache, module, key, value)
    window = layer_window(module, kwargs)
    chunk = chunk_size(module)
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    split = plain and not marker.concatenated and base == "sdpa" and marker.wave.is_plain_causal and chunk is None
    if cached and split and (window is None or window >= cache.prefix_length + key.shape[2]):
        query, key, value = _autocast_inputs(query, key, value)
        kernel = split_attention.kernel_for(query, key, value)
        if kernel is not None:  # the cache read in place, no per-wave concatenation (see split_attention.py)
            prefix = cache.leaves(module.layer_idx, query.dtype)
            return split_attention.split_attention(query, *prefix, key, value, scaling, kernel).transpose(1, 2), None
    if cached:  # read once per call: with `offload_kv` each read is a copy from the host
        leaves = cache.leaves(module.layer_idx)
        batch = query.shape[0]
        key = torch.cat([leaves[0].expand(batch, -1, -1, -1), key], dim=2)
        value = torch.cat([leaves[1].expand(batch, -1, -1, -1), value], dim=2)
    mask = _wave_mask(marker.wave, base, window, query, key.shape[2], chunk)
    if isinstance(mask, CausalBias) and plain:
        return _bottom_right_sdpa(query, key, value, mask, scaling), None
    return base_fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _replayed_prefix_attention(module, query, key, value, attention_mask, marker: PrefixPass, base: str, scaling,
                               kwargs) -> torch.Tensor | None:
    """Phase A's plain causal `sdpa` attention of a recomputed layer through `marker.replay`, else None."""
    window = layer_window(module, kwargs)
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None and attention_mask is None
    if marker.replay is None or base != "sdpa" or not plain or (window is not None and window < key.shape[2]):
        return None
    return marker.replay.attend(module, *_autocast_inputs(query, key, value), scaling)


def _bottom_right_sdpa(query, key, value, mask: CausalBias, scaling: float | None) -> torch.Tensor:
    """SDPA with a bottom-right causal bias and native GQA: the flash kernel, no mask and no repeated K/V.

    (transformers' sdpa wrapper would repeat K/V for any mask.) Inputs are cast to the autocast dtype up front,
    since a CausalBias dispatches before autocast would unify the q/k/v dtypes.
    """
    query, key, value = _autocast_inputs(query, key, value)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous()


def _autocast_inputs(query, key, value):
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return query, key, value


def prefixflow_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """Attention function for `prefixflow_<base>`: the base outside a group, Phase A or B inside one.

    Called by transformers' attention modules through `AttentionInterface`, with the signature and layouts of its
    attention functions.

    Args:
        module: the attention module; reads `module.config._attn_implementation`, `module.layer_idx` and its layer's
            sliding window and chunk (`layer_window`, `chunk_size`).
        query: `[B, H_q, S, D]`, post-RoPE.
        key, value: `[B, H_kv, S, D]`, post-RoPE (`H_q` a multiple of `H_kv`); the wave's own K/V in Phase B.
        attention_mask: the mask transformers built for the base (or None). Used outside a group and in Phase A;
            a wave replaces it with its own visibility (`Wave.visible`).
        dropout: attention dropout probability; must be 0 inside a group.
        scaling: softmax scale; None: `D ** -0.5`.
        **kwargs: the base's keyword arguments (`sliding_window`, `softcap`, `s_aux` ...), plus PrefixFlow's, which
            are consumed here: `prefixflow_pass` (a `PrefixPass` or `SuffixPass`), `prefixflow_routes` (MoE) and
            `prefixflow_sp` (Ulysses).

    Returns:
        `(attn_output, attn_weights)`: `attn_output [B, S, H_q, D]` in the query's dtype (the autocast dtype under
        autocast); `attn_weights` as the base returns them, None from PrefixFlow's own kernels.

    Raises:
        PrefixFlowError: inside a group, attention dropout or `output_attentions`; in a wave, a layer with no
            cached prefix K/V, or K/V of another dtype or device than the cached ones.
    """
    sequence_parallel = kwargs.pop(SP_KWARG, None)
    if sequence_parallel is not None:  # Ulysses: re-enters here on full-length sequences of a head shard
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            raise PrefixFlowError(
                f"{type(module).__name__} scales its queries by their index in the process's shard of the sequence "
                "(Llama 4's attention temperature without RoPE), which sequence parallelism shifts. Train it with "
                "prefixflow_sp_size=1, or with attn_temperature_tuning=False."
            )
        return sequence_parallel.attend(prefixflow_attention, module, query, key, value, dropout, scaling, kwargs)
    base = base_name(module.config._attn_implementation)
    base_fn = _base_function(module, base)
    marker = kwargs.pop(PASS_KWARG, None)
    if marker is not None and attribute(module, TOWER, False):
        marker = None  # a vision tower's attention, reached by Phase A's kwargs (see `multimodal.mark_towers`)
    if REACH.calls is not None:
        REACH.calls.append((module, marker is REACH))
        marker = None if marker is REACH else marker
    routes = kwargs.pop(ROUTES_KWARG, None)
    if attribute(module, PUBLISHES, False):
        _publish(module, routes, marker)
    if marker is None:
        return base_fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return _marked_attention(module, query, key, value, attention_mask, marker, base, base_fn, dropout, scaling,
                             kwargs)


# Reads and writes the cache by layer index: compiled inline, every decoder layer would be a graph of its own and
# torch.compile's recompile limit would send most layers back to eager. Its kernels are opaque to the compiler anyway.
@compat.dynamo_disable
def _marked_attention(module, query, key, value, attention_mask, marker, base: str, base_fn, dropout, scaling,
                      kwargs):
    """Phase A or B attention for the pass `marker`."""
    _check_call(module, dropout, kwargs)
    if isinstance(marker, PrefixPass):
        marker.cache.capture(module.layer_idx, key, value)
        offset = getattr(marker.cache, "position_offset", 0)
        if offset:  # the prompt's first token sits at `offset` in the left-padded full sequence
            query = index_scaled_query(module, query, offset + torch.arange(query.shape[2], device=query.device)[None])
        replayed = _replayed_prefix_attention(module, query, key, value, attention_mask, marker, base, scaling, kwargs)
        if replayed is not None:
            return replayed, None
        return base_fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return _suffix_attention(module, query, key, value, marker, base, base_fn, dropout, scaling, kwargs)


@compat.dynamo_disable  # keyed by layer index, like `_marked_attention`
def _publish(module: torch.nn.Module, routes: torch.Tensor | None, marker) -> None:
    publish(module.layer_idx, routes, _router_sink(marker))  # for this layer's MoE router


def _router_sink(marker) -> Callable | None:
    if isinstance(marker, PrefixPass) and marker.collect_router_logits:
        return marker.cache.capture_router
    if isinstance(marker, SuffixPass) and marker.wave.router_logits is not None:
        return marker.wave.router_logits.__setitem__  # a checkpoint recompute overwrites with equal values
    return None


@lru_cache(maxsize=None)
def _bridged_class(cls: type, carries: bool) -> type:
    """`cls` with a forward that puts its PrefixFlow kwargs on the bridge (`carries`: a decoder layer) or takes them
    from it (an attention module inside such a layer). A subclass rather than hooks: transformers checkpoints a
    layer's `forward`, outside its hooks, and the recompute must carry the kwargs too."""
    parent_forward = cls.forward

    @functools.wraps(parent_forward)
    def carry(self, *args, **kwargs):
        carried = {name: kwargs[name] for name in CARRIED_KWARGS if name in kwargs}
        token = _layer_kwargs.set(carried or None)
        try:
            return super(bridged, self).forward(*args, **kwargs)
        finally:
            _layer_kwargs.reset(token)

    @functools.wraps(parent_forward)
    def receive(self, *args, **kwargs):
        carried = _layer_kwargs.get()
        return super(bridged, self).forward(*args, **({**carried, **kwargs} if carried else kwargs))

    bridged = type(cls.__name__, (cls,), {"forward": carry if carries else receive, "_prefixflow_bridged": True,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return bridged


def bridge_layers(layers: list[torch.nn.Module], attention_modules: list[torch.nn.Module]) -> None:
    """Carry each of `layers`' PrefixFlow kwargs to `attention_modules` (inside those layers), which the layers call
    without them. Idempotent.

    Args:
        layers: decoder layers that call their attention without the model's kwargs; their class is swapped for a
            subclass whose forward puts the kwargs on a context variable.
        attention_modules: the attention modules inside them; their class is swapped for a subclass whose forward
            takes the kwargs from it.
    """
    for modules, carries in ((layers, True), (attention_modules, False)):
        for module in modules:
            if not getattr(module, "_prefixflow_bridged", False):
                module.__class__ = _bridged_class(type(module), carries)


def _mask_for(base: str) -> Callable:
    def mask_function(*args, **kwargs):
        return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)

    return mask_function


def register() -> None:
    """Register `prefixflow_<base>` for every supported base, with the base's own mask builder."""
    for base in SUPPORTED_BASES:
        AttentionInterface.register(wrapped_name(base), prefixflow_attention)
        AttentionMaskInterface.register(wrapped_name(base), _mask_for(base))


register()
