"""Recurrent prefix state: what K/V is to attention, a recurrent layer's state is to hybrid models.

A recurrent mixer (gated delta-net, KDA, Mamba2, a gated short convolution) continues a sequence from its state at
the end of the prefix: its convolution window (the last `k` inputs) and, for a scan, its recurrent state. The
transformers mixers read and write these through the cache API (`get_conv_state`, `update_conv_state`,
`get_recurrent_state`, `update_recurrent_state`). `enable_states` hooks each such mixer: when a forward carries a
PrefixFlow pass marker, the mixer gets a `StateView` of the group's cache as its `cache` argument.

- Phase A (`PrefixPass`): no previous state; the update calls capture the live window and final state (attached to
  the prefix graph) once per layer, return them unchanged, and store nothing. A checkpoint recompute in Phase C
  finds them captured.
- Phase B (`SuffixPass`): the previous state is the captured leaf, expanded over the wave's rows; the window update
  returns `cat(window, x)`, nothing is written, so autograd sums each wave's gradient into the leaves (in float32
  for float32 states, whatever the weights' dtype).
- Phase C: `kv_cache.delayed_backward` injects those gradients with gK/gV.

transformers' cache writes in place (`copy_` into fixed buffers), which a leaf cannot take, and under gradient
checkpointing a decoder layer drops its `cache`; this view writes nothing and rides the pass marker, which
checkpointing binds, so both work. A one-token input would take the mixers' single-step kernels, which write the
state in place (and in NemotronH skip a floor the chunked path applies): a wave one token wide runs its mixers on
that token plus a trailing zero token, whose output is dropped (causal: the real token's output is unchanged).
"""

from __future__ import annotations

import functools
import inspect

import torch

from .access import attribute
from .attention import PASS_KWARG, PrefixPass, SuffixPass
from ..errors import PrefixFlowError
from .kv_cache import TrainingKVCache

CONV, RECURRENT = "conv", "recurrent"
_MARKER_KWARGS = ("prefixflow_pass", "prefixflow_routes", "prefixflow_sp")
_CACHE_PARAMETERS = ("cache", "cache_params")
_HOOKED = "_prefixflow_state_mixer"
# How a mixer reads its previous state from the cache (transformers 5.24; and before it, `update_*` with
# `cache.layers[i].conv_states`); MiniMax's lightning attention through its own cache's `get_linear_cache`.
_STATE_CALLS = ("get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state",
                "get_linear_cache")
_TRIM = "_prefixflow_trim"


class StateView:
    """The cache a recurrent mixer sees inside a prefix group: capture-once in Phase A, read-only in Phase B.

    Implements the part of transformers' `Cache` API the mixers call. States are keyed by
    `(layer_idx, kind, state_idx)` in the group's `TrainingKVCache.states`.

    Args:
        cache: the group's cache.
        capturing: Phase A (True) or a wave (False).
        rows: the wave's batch size `B` (Phase B), which each state is expanded to.
    """

    def __init__(self, cache: TrainingKVCache, capturing: bool, rows: int = 1):
        self.cache, self.capturing, self.rows = cache, capturing, rows

    # -- reads -------------------------------------------------------------------------------------------------

    def _previous(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        if self.capturing or self.cache.prefix_length == 0:
            return None
        self.cache.state_reads.add(layer_idx)
        entry = self.cache.states.get((layer_idx, kind, state_idx))
        if entry is None:
            raise PrefixFlowError(
                f"layer {layer_idx} has no cached prefix {kind} state: its mixer did not run in Phase A, or ran "
                "without PrefixFlow's state cache. A suffix would start from a zero state; refusing.")
        leaf = entry.leaf
        return leaf.expand(self.rows, *leaf.shape[1:])

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The convolution window `[B, C, k]` at the end of the prefix (None in Phase A or with no prefix)."""
        return self._previous(layer_idx, CONV, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The recurrent state at the end of the prefix, `[B, ...]` (None in Phase A or with no prefix)."""
        return self._previous(layer_idx, RECURRENT, state_idx)

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's lightning attention: its decayed `K^T V` state `[B, H, D, D]` at the end of the prefix (None in
        Phase A, where the mixer then runs its block path from zero; a wave continues token by token from it)."""
        return self._previous(layer_idx, RECURRENT, 0)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether a state precedes this forward: in a wave of a group with a cached prefix."""
        return not self.capturing and self.cache.prefix_length > 0

    @property
    def layers(self) -> "_Layers":
        """transformers before 5.24 reads states as `cache.layers[i].conv_states[j]` (and `.recurrent_states`)."""
        return _Layers(self)

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: a mixer never takes its in-place single-step path on this view."""
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens before this forward: 0 in Phase A, the cached prefix length in a wave."""
        return 0 if self.capturing else self.cache.prefix_length

    # -- writes --------------------------------------------------------------------------------------------------

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Phase A: capture the window (the last `k` inputs, zero-filled on the left when the prefix is shorter)
        and return the inputs as they are. A wave: return `cat(window, inputs)` along the sequence.

        Args:
            conv_states: the convolution's inputs `[B, C, L]`.
            layer_idx: the mixer's layer index.
            state_idx: which of the layer's states.
            conv_kernel_size: `k`, the window kept; None: the captured window's own width.
        """
        if not self.capturing:
            window = self._previous(layer_idx, CONV, state_idx)
            if window is None:
                return conv_states
            return torch.cat([window.to(conv_states.dtype), conv_states], dim=-1)
        key = (layer_idx, CONV, state_idx)
        if key not in self.cache.states:
            width = conv_kernel_size or conv_states.shape[-1]
            short = width - conv_states.shape[-1]
            window = torch.nn.functional.pad(conv_states, (short, 0)) if short > 0 else conv_states[..., -width:]
            self.cache.capture_state(key, window)
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Phase A: capture the final state; a wave: nothing (the state after a suffix is never read)."""
        if self.capturing:
            self.cache.capture_state((layer_idx, RECURRENT, state_idx), recurrent_states)
        return recurrent_states

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """MiniMax's lightning attention after its forward: captured in Phase A, dropped in a wave."""
        self.update_recurrent_state(linear_cache, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attention inside a hybrid layer: K/V pass through (PrefixFlow's attention function reads its own)."""
        return key_states, value_states


class _Layers:
    """`StateView.layers[layer_idx]`: one layer's states in the older cache API's shape."""

    def __init__(self, view: StateView):
        self.view = view

    def __getitem__(self, layer_idx: int) -> "_LayerStates":
        return _LayerStates(self.view, layer_idx)


class _LayerStates:
    record_past = True  # as `is_recording_past`: never the in-place single-step path

    def __init__(self, view: StateView, layer_idx: int):
        self.view, self.layer_idx = view, layer_idx

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:
        return _States(self.view, self.layer_idx, CONV)

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:
        return _States(self.view, self.layer_idx, RECURRENT)


class _States(dict):
    def __init__(self, view: StateView, layer_idx: int, kind: str):
        super().__init__()
        self.view, self.layer_idx, self.kind = view, layer_idx, kind

    def __missing__(self, state_idx: int) -> torch.Tensor | None:
        return self.view._previous(self.layer_idx, self.kind, state_idx)


def mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's recurrent mixers: modules with a `layer_idx` that take the cache as an argument and read a
    convolution or recurrent state through it (their only way to a previous state).

    Args:
        model: the unwrapped transformers model.
    """
    return [m for m in model.modules() if hasattr(m, "layer_idx") and is_state_mixer(type(m))]


@functools.lru_cache(maxsize=None)
def is_state_mixer(cls: type) -> bool:
    """Whether `cls.forward` takes a `cache` (or `cache_params`) and reads or writes a state through it
    (`_STATE_CALLS`): what `StateView` serves."""
    parameters = inspect.signature(cls.forward).parameters
    if not any(name in parameters for name in _CACHE_PARAMETERS):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return any(call in source for call in _STATE_CALLS)


def enable_states(model: torch.nn.Module) -> int:
    """Hook every recurrent mixer of `model` (see `mixers`) to use the group's state cache inside prefix groups.
    Idempotent.

    Returns:
        How many mixers are hooked (0: an attention-only model).
    """
    found = mixers(model)
    for module in found:
        if not getattr(module, _HOOKED, False):
            setattr(module, _HOOKED, True)
            module.register_forward_pre_hook(_before_mixer, with_kwargs=True)
            module.register_forward_hook(_after_mixer)
    return len(found)


def mixer_layers(model: torch.nn.Module) -> set[int]:
    """The layer indices of `model`'s hooked recurrent mixers."""
    return {m.layer_idx for m in model.modules() if attribute(m, _HOOKED, False)}


def has_states(model: torch.nn.Module) -> bool:
    """Whether `model` has recurrent mixers hooked by `enable_states`."""
    return any(attribute(m, _HOOKED, False) for m in model.modules())


def _cache_parameter(module: torch.nn.Module) -> str:
    parameters = inspect.signature(module.forward).parameters
    return next(name for name in _CACHE_PARAMETERS if name in parameters)


def _before_mixer(module: torch.nn.Module, args: tuple, kwargs: dict):
    marker = kwargs.get(PASS_KWARG)
    if not isinstance(marker, (PrefixPass, SuffixPass)):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in _MARKER_KWARGS}
    hidden, where = (args[0], "arg") if args else (kwargs["hidden_states"], "kwarg")
    capturing = isinstance(marker, PrefixPass)
    kwargs[_cache_parameter(module)] = StateView(marker.cache, capturing, hidden.shape[0])
    setattr(module, _TRIM, False)
    if not capturing and hidden.shape[1] == 1:  # keep the mixer off its in-place single-step path
        hidden = torch.cat([hidden, torch.zeros_like(hidden)], dim=1)
        kwargs.pop("attention_mask", None)  # the wave's mask is None; its pads follow its real tokens
        setattr(module, _TRIM, True)
        if where == "arg":
            args = (hidden, *args[1:])
        else:
            kwargs["hidden_states"] = hidden
    return args, kwargs


def _after_mixer(module: torch.nn.Module, args: tuple, output):
    if not getattr(module, _TRIM, False):
        return None
    setattr(module, _TRIM, False)
    if isinstance(output, torch.Tensor):
        return output[:, :1]
    return (output[0][:, :1], *output[1:])
