"""The phase scheduler: Phase A when a group opens, suffix waves while it is open, Phase C when it closes.

    with prefix_group(model, prefix_ids) as group:   # Phase A: prefix forward once, K/V captured
        out = group(suffix_ids, attention_mask=mask)  # Phase B: a padded wave (or group.packed([...]))
        loss_fn(out.logits).backward()                # suffix backward; gK/gV accumulate in the cache
    # Phase C: gK/gV injected into the live prefix K/V, one delayed prefix backward; everything freed

`GroupSession` is the same lifecycle for several groups at once (a trainer's microbatch holds several prompts, and
a group may span microbatches): open groups one by one, close any subset with one combined prefix backward.

The prefix's last token is not cached: each wave re-reads it as its first input, so `out.logits[:, t]` predicts
suffix token `t` exactly as position `P-1+t` of `[P || S]` does, and no hidden state crosses the phases.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from .attention import PASS_KWARG, PrefixPass, SuffixPass, is_wrapped
from .engines import gathers_weights_in_hooks, prefix_module
from .errors import PrefixFlowError
from .kv_cache import TrainingKVCache, delayed_backward
from .layouts import Wave, packed_wave, padded_wave
from .model import (check_checkpointing, checkpointing_suspended, config_of, decoder_of, kv_grad_dtype, unwrap,
                    warn_shared_randomness)
from .moe import ROUTES_KWARG, check_replay_supported, check_routes, wave_routes
from .offload import HostPool, PrefixOffload
from .recompute import AttentionReplay, recomputed_layers

_sessions: "weakref.WeakKeyDictionary[torch.nn.Module, GroupSession]" = weakref.WeakKeyDictionary()


@dataclass
class PackedOutput:
    """Output of a packed wave: `logits` is `[1, T, V]`; `split(x)` cuts any `[1, T, ...]` tensor per suffix."""

    logits: torch.Tensor | None
    segment_lengths: list[int]
    raw: object

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor[0].split(self.segment_lengths))


class GroupRunner:
    """How a group runs its forwards on this process: the seam through which a parallel rule (`distributed/`)
    shards or splits them. The default runs the model (Phase B) or its decoder (Phase A) where its embeddings are."""

    def device(self, group: "PrefixGroup") -> torch.device:
        """Where the group's inputs must be."""
        return group.hf_model.get_input_embeddings().weight.device

    def forward(self, group: "PrefixGroup", module: torch.nn.Module, input_ids: torch.Tensor,
                position_ids: torch.Tensor, **kwargs):
        """One forward: Phase A's (`module` the decoder, or the FSDP2 root) or a wave's (the model).
        `input_ids`, `position_ids`: `[B, L]`; `kwargs` carry the pass marker and the model's own arguments."""
        return module(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


class PrefixGroup:
    """One shared prefix: its training-time KV cache and the suffix waves that read it."""

    def __init__(
        self, model: torch.nn.Module, prefix_ids: torch.Tensor, position_offset: int = 0,
        routes: torch.Tensor | None = None, collect_router_logits: bool = False, runner: GroupRunner | None = None,
        prefix_inputs: dict[str, torch.Tensor] | None = None,
    ):
        self.model = model
        self.collect_router_logits = collect_router_logits
        self.runner = runner or GroupRunner()
        self._inner = unwrap(model)
        if not is_wrapped(self._inner.config._attn_implementation):
            raise PrefixFlowError("call hf_prefixflow.apply_prefixflow(model) before opening a prefix group.")
        self.prefix_ids = self._check_prefix(prefix_ids)
        self.position_offset = int(position_offset)
        self.routes = self._check_routes(routes)
        if prefix_inputs or getattr(self._inner, "_prefixflow_prefix_lm", False):  # see `multimodal.check`
            self.runner = self._multimodal_runner(runner, prefix_inputs or {})
        self.cache = TrainingKVCache(self.prefix_ids.shape[1] - 1, kv_grad_dtype(model))
        self.state = "new"  # -> "open" -> "closed"
        self.trains = False
        # Per group, overriding the model's `suffix_checkpointing` (None: follow it); a trainer may set it per run.
        self.suffix_checkpointing: bool | None = None
        self.offload: PrefixOffload | None = None
        self.attention_replay: AttentionReplay | None = None

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
            raise PrefixFlowError(
                f"prefix_ids must be a non-empty [P] or [1, P] tensor, got {tuple(prefix_ids.shape)}.")
        self._check_device(ids, "prefix_ids")
        return ids.long()

    def _check_routes(self, routes: torch.Tensor | None) -> torch.Tensor | None:
        """The prefix's recorded MoE routes `[layers, P, k]`, shared by every suffix of the group."""
        if routes is None:
            return None
        if routes.dim() != 3 or routes.shape[1] != self.prefix_ids.shape[1]:
            raise PrefixFlowError(
                f"prefix routes must be [layers, P={self.prefix_ids.shape[1]}, k], got {tuple(routes.shape)}."
            )
        check_routes(self._inner, routes)
        return routes.to(self.prefix_ids.device)

    def _suffix_routes(self, routes, count: int) -> list[torch.Tensor] | None:
        if (routes is None) != (self.routes is None):
            raise PrefixFlowError(
                "routing replay data is missing: pass routes for the prefix and for every wave, or for none. "
                "A router never re-routes silently."
            )
        if routes is None:
            return None
        routes = list(routes.unbind(1)) if isinstance(routes, torch.Tensor) else list(routes)
        if len(routes) != count:
            raise PrefixFlowError(f"got routes for {len(routes)} suffixes but the wave has {count}.")
        check_routes(self._inner, torch.cat([r.reshape(-1, r.shape[-1]) for r in routes]))
        return wave_routes(self.routes, routes)

    def _multimodal_runner(self, runner: GroupRunner | None, prefix_inputs: dict) -> GroupRunner:
        """The runner of an image prompt (`multimodal.MultimodalRunner`), which takes its processor tensors."""
        from .multimodal import MultimodalRunner

        if runner is not None or self.routes is not None:
            raise PrefixFlowError("image prompts share their prefix on one process, without routing replay; "
                                  "sequence parallelism, pipelines and MoE replay train them on the plain path.")
        return MultimodalRunner(self, prefix_inputs)

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model inside any DDP / engine / PEFT wrapper."""
        return self._inner

    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        device = self.runner.device(self)
        if tensor.device != device:
            raise PrefixFlowError(
                f"{name} is on {tensor.device} but the model's embeddings are on {device}; "
                f"move it with .to({str(device)!r})."
            )

    # -- Phase A ---------------------------------------------------------------------------------------------

    def _prefix_forward(self) -> None:
        if self.state != "new":
            raise PrefixFlowError("a prefix group is opened once; open a new one for the next prompt.")
        self.state = "open"
        self.trains = torch.is_grad_enabled()
        if self.trains:
            check_checkpointing(self.model)
            warn_shared_randomness(self.model)
            if self.routes is not None:
                check_replay_supported(self._inner)
        cached = self.cache.prefix_length
        if cached == 0:
            return
        positions = self.position_offset + torch.arange(cached, device=self.prefix_ids.device)[None]
        replay = {} if self.routes is None else {ROUTES_KWARG: self.routes[:, None, :-1]}
        self.offload = self._offloader()
        with self.offload.hooks() if self.offload else contextlib.nullcontext(), self._recomputing() as recomputed:
            # With offload, recomputed layers keep their attention results on the host too (`recompute`).
            self.attention_replay = AttentionReplay(recomputed, self.offload) if self.offload and recomputed else None
            module, extra = prefix_module(self.model)
            marker = PrefixPass(self.cache, self.collect_router_logits, self.attention_replay)
            out = self.runner.forward(self, module, self.prefix_ids[:, :-1], positions, **{PASS_KWARG: marker},
                                      **replay, **extra)
        hidden = out[0]  # the last hidden state, or the logits when Phase A runs the whole model (FSDP2)
        if self.trains and hidden.requires_grad and not self.cache.needs_gradients():
            raise PrefixFlowError(
                "the prefix K/V came out of Phase A without a graph although the prefix output has one: reentrant "
                "activation checkpointing (or a custom checkpoint function) detached them. Use non-reentrant "
                "checkpointing: gradient_checkpointing_kwargs={'use_reentrant': False}."
            )
        if self.trains and hidden.requires_grad and gathers_weights_in_hooks(self.model):
            self.cache.anchor = hidden  # these engines gather weights in hooks on module outputs: see `anchor`

    def _offloader(self) -> PrefixOffload | None:
        """A saved-tensor offloader for this prefix forward, sharing the model's host pool across groups."""
        if not (self.trains and config_of(self._inner).offload):
            return None
        device = self.prefix_ids.device
        pool = getattr(self._inner, "_prefixflow_pool", None)
        if pool is None:
            pool = self._inner._prefixflow_pool = HostPool(pin=device.type == "cuda")
        offload = PrefixOffload(device, pool)
        offload.caches.append(self.cache)
        return offload

    def _recomputing(self) -> contextlib.AbstractContextManager:
        """Checkpoint the configured share of prefix layers; yields the checkpointed layers' indices."""
        if not self.trains:
            return contextlib.nullcontext(set())
        return recomputed_layers(decoder_of(self._inner), config_of(self._inner).recompute_share)

    def _adopt(self, cache: TrainingKVCache) -> None:
        """Open on prefix K/V computed by another rank's Phase A (`distributed.placement`): the waves read `cache`,
        whose leaves have no prefix graph behind them here, so closing this group runs no Phase C."""
        if self.state != "new":
            raise PrefixFlowError("a prefix group is opened once; open a new one for the next prompt.")
        self.state, self.trains, self.cache = "open", torch.is_grad_enabled(), cache

    # -- Phase B ---------------------------------------------------------------------------------------------

    def _check_wave_inputs(self, tensors: list[torch.Tensor]) -> None:
        if self.state != "open":
            raise PrefixFlowError("this prefix group is closed; waves must run while it is open (inside its block).")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._check_device(tensor, "suffix ids")

    def run_wave(self, wave: Wave, **model_kwargs):
        """Forward one prepared wave through the model (kwargs such as TRL's `shift_labels` pass through)."""
        reserved = {"position_ids", "attention_mask", "past_key_values", "cache", "input_ids", PASS_KWARG, ROUTES_KWARG}
        clash = reserved & model_kwargs.keys()
        if clash:
            raise PrefixFlowError(f"{sorted(clash)} are set by the prefix group; do not pass them to a wave.")
        if wave.routes is not None:
            model_kwargs[ROUTES_KWARG] = wave.routes
        marker = {PASS_KWARG: SuffixPass(self.cache, wave)}
        checkpointed = self.suffix_checkpointing
        keep = not (config_of(self._inner).suffix_checkpointing if checkpointed is None else checkpointed)
        with checkpointing_suspended(self._inner) if keep else contextlib.nullcontext():
            return self.runner.forward(self, self.model, wave.input_ids, wave.position_ids, **marker, **model_kwargs)

    def padded_wave(
        self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, routes: torch.Tensor | None = None
    ) -> Wave:
        """Lay out right-padded `suffix_ids [B, S]` as a wave of this group (see `layouts.padded_wave`); MoE
        `routes [layers, B, S, k]` replay each suffix token's recorded experts."""
        self._check_wave_inputs([suffix_ids, attention_mask])
        wave = padded_wave(
            self.prefix_ids[:, -1:], suffix_ids, attention_mask, self.cache.prefix_length, self.position_offset
        )
        per_row = self._suffix_routes(routes, suffix_ids.shape[0])
        if per_row is not None:
            wave.routes = torch.stack(per_row, dim=1)
        return wave

    def __call__(self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, routes=None,
                 **model_kwargs):
        """A padded wave: right-padded `suffix_ids [B, S]`; `logits[:, t]` predicts `suffix_ids[:, t]`."""
        return self.run_wave(self.padded_wave(suffix_ids, attention_mask, routes), **model_kwargs)

    def packed(self, suffixes: list[torch.Tensor], routes: list[torch.Tensor] | None = None, **model_kwargs):
        """A packed wave: the suffixes laid end to end in one row; `split()` the outputs back per suffix. MoE
        `routes`: one `[layers, L_i, k]` per suffix."""
        self._check_wave_inputs(suffixes)
        wave = packed_wave(self.prefix_ids[:, -1:], suffixes, self.cache.prefix_length, self.position_offset)
        per_suffix = self._suffix_routes(routes, len(suffixes))
        if per_suffix is not None:
            wave.routes = torch.cat(per_suffix, dim=1)[:, None]
        out = self.run_wave(wave, **model_kwargs)
        return PackedOutput(getattr(out, "logits", None), wave.segment_lengths, out)

    # -- Phase C (run by the session) ------------------------------------------------------------------------

    def _needs_prefix_backward(self) -> bool:
        if not (self.trains and self.cache.needs_gradients()):
            return False
        if not self.cache.received_gradients():
            raise PrefixFlowError(
                "a prefix group closed without any suffix backward, so the prefix would get no gradient. Call "
                "loss.backward() on each wave while the group is open, or open it under torch.no_grad() to score."
            )
        return True

    def _release(self) -> None:
        self.cache.free()
        self.attention_replay = None  # what it kept lived in the offload's buffers, returned next
        if self.offload is not None:
            self.offload.release()
        self.state = "closed"


class GroupSession:
    """Prefix groups open on one model: open them one by one, close any subset with one delayed prefix backward."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._inner = unwrap(model)
        self.groups: list[PrefixGroup] = []
        self._entered = False

    def start(self) -> "GroupSession":
        """Open the session: from here until `finish`, groups open and close on the model (an accumulation window
        of a trainer). `with GroupSession(model) as session:` calls both."""
        if self._entered:
            raise PrefixFlowError("a prefix group (or session) is entered once; open a new one for the next prompt.")
        if self._inner in _sessions:
            raise PrefixFlowError("a prefix group is already open on this model; groups cannot nest. Exit it first.")
        _sessions[self._inner] = self
        self._entered = True
        return self

    def __enter__(self) -> "GroupSession":
        return self.start()

    def open(self, prefix_ids: torch.Tensor, position_offset: int = 0, routes: torch.Tensor | None = None,
             collect_router_logits: bool = False, **prefix_inputs: torch.Tensor) -> PrefixGroup:
        """Phase A for one more prefix; returns its group. `collect_router_logits` keeps the prefix's MoE router
        logits as cached leaves (`group.cache.router_logits`) for a load-balancing loss. `prefix_inputs`: an image
        prompt's processor tensors (see `prefix_group`)."""
        return self.add(PrefixGroup(self.model, prefix_ids, position_offset, routes, collect_router_logits,
                                    prefix_inputs=prefix_inputs))

    def add(self, group: PrefixGroup) -> PrefixGroup:
        """Phase A for a group built beforehand (validated at construction)."""
        if _sessions.get(self._inner) is not self:
            raise PrefixFlowError("this session is not open; use it as `with GroupSession(model) as session:`.")
        try:
            group._prefix_forward()
        except BaseException:
            group._release()
            raise
        self.groups.append(group)
        return group

    def adopt(self, group: PrefixGroup, cache: TrainingKVCache) -> PrefixGroup:
        """Open `group` on another rank's prefix K/V (`cache`) instead of running Phase A here."""
        if _sessions.get(self._inner) is not self:
            raise PrefixFlowError("this session is not open; use it as `with GroupSession(model) as session:`.")
        group._adopt(cache)
        self.groups.append(group)
        return group

    def close(self, groups: list[PrefixGroup] | None = None, backward=None) -> int:
        """Phase C for `groups` (default: all open ones): one backward through their prefix graphs, then free them.
        `backward(outputs, grads)` replaces autograd's (see `kv_cache.delayed_backward`); returns the tensors fed."""
        closing = list(self.groups) if groups is None else list(groups)
        caches = [g.cache for g in closing if g._needs_prefix_backward()]
        try:
            return delayed_backward(caches, backward) if backward else delayed_backward(caches)
        finally:
            for group in closing:
                group._release()
            self.groups = [g for g in self.groups if g not in closing]

    def finish(self, error: BaseException | None = None) -> None:
        """Close the session: Phase C for the groups still open (none if `error`: they are only freed)."""
        try:
            if error is None:
                self.close()
        finally:
            for group in self.groups:
                group._release()
            self.groups = []
            _sessions.pop(self._inner, None)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exc)


class _SingleGroup:
    """What `prefix_group` returns: a session holding exactly one group, entered once."""

    def __init__(self, model: torch.nn.Module, prefix_ids: torch.Tensor, position_offset: int, routes,
                 prefix_inputs: dict[str, torch.Tensor]):
        # validates now, before any `with`
        self.group = PrefixGroup(model, prefix_ids, position_offset, routes, prefix_inputs=prefix_inputs)
        self.session = GroupSession(model)

    def __enter__(self) -> PrefixGroup:
        self.session.start()
        try:
            return self.session.add(self.group)
        except BaseException as exc:
            self.session.finish(exc)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        self.session.finish(exc)


def prefix_group(
    model: torch.nn.Module, prefix_ids: torch.Tensor, position_offset: int = 0, routes: torch.Tensor | None = None,
    **prefix_inputs: torch.Tensor,
) -> _SingleGroup:
    """Open one group over a shared prefix (`[P]` or `[1, P]`) as a context manager; it yields the `PrefixGroup`.

    `position_offset` is the position of the prefix's first token (0 unless the stock path left-pads prompts).
    `routes` (MoE models) is the prefix's recorded routing `[layers, P, k]`, replayed in Phases A and C.
    `prefix_inputs`: an image prompt's processor tensors for this one prompt (`pixel_values`, `image_grid_thw`,
    `token_type_ids` ...): Phase A runs the vision tower and the image tokens once (see `hf_prefixflow.multimodal`).
    """
    return _SingleGroup(model, prefix_ids, position_offset, routes, prefix_inputs)
