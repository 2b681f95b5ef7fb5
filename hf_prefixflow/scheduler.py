"""The phase scheduler: `prefix_group` runs Phase A on entry, suffix waves inside, and Phase C on a clean exit.

    with prefix_group(model, prefix_ids) as group:   # Phase A: prefix forward once, K/V captured
        out = group(suffix_ids, attention_mask=mask)  # Phase B: a padded wave (or group.packed([...]))
        loss_fn(out.logits).backward()                # suffix backward; gK/gV accumulate in the cache
    # Phase C: gK/gV injected into the live prefix K/V, one delayed prefix backward; everything freed

The prefix's last token is not cached: each wave re-reads it as its first input, so `out.logits[:, t]` predicts
suffix token `t` exactly as position `P-1+t` of `[P || S]` does, and no hidden state crosses the phases.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .attention import PASS_KWARG, PrefixPass, SuffixPass, is_wrapped
from .errors import PrefixFlowError
from .kv_cache import TrainingKVCache
from .layouts import Wave, packed_wave, padded_wave
from .model import check_checkpointing, decoder_of, unwrap

_active_groups: "weakref.WeakKeyDictionary[torch.nn.Module, PrefixGroup]" = weakref.WeakKeyDictionary()


@dataclass
class GroupStats:
    """What one group did, for logging and FLOP accounting."""

    prefix_tokens: int
    suffix_tokens: int = 0
    suffixes: int = 0
    waves: int = 0


@dataclass
class PackedOutput:
    """Output of a packed wave: `logits` is `[1, T, V]`; `split(x)` cuts any `[1, T, ...]` tensor per suffix."""

    logits: torch.Tensor
    segment_lengths: list[int]
    raw: object

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor[0].split(self.segment_lengths))


class PrefixGroup:
    """One rollout group's shared prefix, run through Phases A, B and C. Create it with `prefix_group`."""

    def __init__(self, model: torch.nn.Module, prefix_ids: torch.Tensor):
        self.model = model
        self._inner = unwrap(model)
        if not is_wrapped(self._inner.config._attn_implementation):
            raise PrefixFlowError("call hf_prefixflow.apply_prefixflow(model) before opening a prefix group.")
        self.prefix_ids = self._check_prefix(prefix_ids)
        self.cache = TrainingKVCache(self.prefix_ids.shape[1] - 1)
        self.stats = GroupStats(prefix_tokens=self.prefix_ids.shape[1])
        self._open = False
        self._closed = False
        self._trains = False

    def _check_prefix(self, prefix_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(prefix_ids, torch.Tensor) or prefix_ids.dtype not in (torch.int64, torch.int32):
            raise PrefixFlowError("prefix_ids must be an integer tensor of token ids, [P] or [1, P].")
        if prefix_ids.dim() == 2 and prefix_ids.shape[0] != 1:
            raise PrefixFlowError(
                f"prefix_ids has batch {prefix_ids.shape[0]}: a group shares exactly one prefix. "
                "Open one prefix_group per distinct prompt."
            )
        ids = prefix_ids.reshape(1, -1)
        if prefix_ids.dim() > 2 or ids.shape[1] == 0:
            raise PrefixFlowError(f"prefix_ids must be a non-empty [P] or [1, P] tensor, got {tuple(prefix_ids.shape)}.")
        self._check_device(ids, "prefix_ids")
        return ids.long()

    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        device = self._inner.get_input_embeddings().weight.device
        if tensor.device != device:
            raise PrefixFlowError(f"{name} is on {tensor.device} but the model's embeddings are on {device}; move it with .to({str(device)!r}).")

    # -- Phase A ---------------------------------------------------------------------------------------------

    def __enter__(self) -> "PrefixGroup":
        if self._open or self._closed:
            raise PrefixFlowError("a PrefixGroup is entered once; open a new prefix_group for the next prompt.")
        if self._inner in _active_groups:
            raise PrefixFlowError("a prefix group is already open on this model; groups cannot nest. Exit it first.")
        _active_groups[self._inner] = self
        self._open = True
        try:
            self._trains = torch.is_grad_enabled()
            if self._trains:
                check_checkpointing(self.model)
            self._prefix_forward()
        except BaseException:
            self._release()
            raise
        return self

    def _prefix_forward(self) -> None:
        cached = self.cache.prefix_length
        if cached == 0:
            return
        positions = torch.arange(cached, device=self.prefix_ids.device)[None]
        out = decoder_of(self.model)(
            input_ids=self.prefix_ids[:, :-1],
            position_ids=positions,
            use_cache=False,
            **{PASS_KWARG: PrefixPass(self.cache)},
        )
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        if self._trains and hidden.requires_grad and not self.cache.needs_gradients():
            raise PrefixFlowError(
                "the prefix K/V came out of Phase A without a graph although the prefix output has one: reentrant "
                "activation checkpointing (or a custom checkpoint function) detached them. Use non-reentrant "
                "checkpointing: gradient_checkpointing_kwargs={'use_reentrant': False}."
            )

    # -- Phase B ---------------------------------------------------------------------------------------------

    def _run(self, wave: Wave, model_kwargs: dict):
        reserved = {"position_ids", "attention_mask", "past_key_values", "cache", "input_ids", PASS_KWARG}
        clash = reserved & model_kwargs.keys()
        if clash:
            raise PrefixFlowError(f"{sorted(clash)} are set by the prefix group; do not pass them to a wave.")
        self.stats.waves += 1
        return self.model(
            input_ids=wave.input_ids,
            position_ids=wave.position_ids,
            use_cache=False,
            **{PASS_KWARG: SuffixPass(self.cache, wave)},
            **model_kwargs,
        )

    def __call__(self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **model_kwargs):
        """A padded wave: right-padded `suffix_ids [B, S]`; `logits[:, t]` predicts `suffix_ids[:, t]`."""
        self._check_wave_inputs([suffix_ids])
        wave = padded_wave(self.prefix_ids[:, -1:], suffix_ids, attention_mask, self.cache.prefix_length)
        self.stats.suffixes += suffix_ids.shape[0]
        self.stats.suffix_tokens += int(wave.segment_ids.ge(0).sum())
        return self._run(wave, model_kwargs)

    def packed(self, suffixes: list[torch.Tensor], **model_kwargs) -> PackedOutput:
        """A packed wave: the suffixes laid end to end in one row; `split()` the outputs back per suffix."""
        self._check_wave_inputs(suffixes)
        wave = packed_wave(self.prefix_ids[:, -1:], suffixes, self.cache.prefix_length)
        self.stats.suffixes += len(suffixes)
        self.stats.suffix_tokens += sum(wave.segment_lengths)
        out = self._run(wave, model_kwargs)
        return PackedOutput(out.logits, wave.segment_lengths, out)

    def _check_wave_inputs(self, tensors: list[torch.Tensor]) -> None:
        if not self._open:
            raise PrefixFlowError("this prefix group is closed; waves must run inside its `with` block.")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._check_device(tensor, "suffix ids")

    # -- Phase C ---------------------------------------------------------------------------------------------

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._prefix_backward()
        finally:
            self._release()

    def _prefix_backward(self) -> None:
        if not (self._trains and self.cache.needs_gradients()):
            return
        if not self.cache.received_gradients():
            raise PrefixFlowError(
                "the group closed without any suffix backward, so the prefix would get no gradient. Call "
                "loss.backward() on each wave inside the block, or open the group under torch.no_grad() to score."
            )
        self.cache.backward()

    def _release(self) -> None:
        self.cache.free()
        self._open = False
        self._closed = True
        _active_groups.pop(self._inner, None)


def prefix_group(model: torch.nn.Module, prefix_ids: torch.Tensor) -> PrefixGroup:
    """Open a group over one shared prefix (`[P]` or `[1, P]`); use it as a context manager."""
    return PrefixGroup(model, prefix_ids)
