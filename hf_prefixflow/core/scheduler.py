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
from ..errors import PrefixFlowError
from .kv_cache import TrainingKVCache, delayed_backward
from .layouts import Wave, packed_wave, padded_wave
from .access import (check_checkpointing, checkpointing_suspended, config_of, decoder_of, kv_grad_dtype, unwrap,
                    warn_shared_randomness)
from .moe import ROUTES_KWARG, check_replay_supported, check_routes, wave_routes
from .offload import HostPool, PrefixOffload
from .recompute import AttentionReplay, recomputed_layers
from .states import has_states, mixer_layers

# Recurrent states are cached on the process that ran Phase A; the parallel rules move K/V only.
# The runner class of image prompts, set on a model by `models.multimodal.check` (the scheduler does not know them).
PROMPT_RUNNER = "_prefixflow_prompt_runner"
STATES_ON_ONE_PROCESS = (
    "this model's recurrent layers (convolution or state-space mixers) keep a prefix state that PrefixFlow caches on "
    "the process running the group; sequence parallelism, pipelines and groups split across ranks move only K/V. "
    "Train it with plain data parallelism (each group on one rank) or with the plain trainer.")

_sessions: "weakref.WeakKeyDictionary[torch.nn.Module, GroupSession]" = weakref.WeakKeyDictionary()


def host_pool(model: torch.nn.Module) -> HostPool | None:
    """The host pool the model's offloading groups share (created by the first one), if any."""
    return getattr(unwrap(model), "_prefixflow_pool", None)


@dataclass
class PackedOutput:
    """The output of a packed wave (`PrefixGroup.packed`).

    Attributes:
        logits: `[1, T, V]`, `T = sum(L_i)`, the suffixes end to end in the order given; `logits[0, t]` predicts
            the token at packed position `t`. None when the model's output has no `logits` (then read `raw`).
        segment_lengths: `[L_1, ..., L_n]`, tokens per suffix.
        raw: the model's own output object; its per-token fields are laid out like `logits`.
    """

    logits: torch.Tensor | None
    segment_lengths: list[int]
    raw: object

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Cut a packed tensor back per suffix.

        Args:
            tensor: `[1, T, ...]`, laid out like `logits` (logits, log-probs, labels ...).

        Returns:
            n views `[L_i, ...]`, one per suffix in the order given (the batch dimension dropped).
        """
        return list(tensor[0].split(self.segment_lengths))


class GroupRunner:
    """How a group runs its forwards on this process: the seam through which a parallel rule (`distributed/`)
    shards or splits them. The default runs the model (Phase B) or its decoder (Phase A) where its embeddings are."""

    def device(self, group: "PrefixGroup") -> torch.device:
        """The device every input of `group` must be on (prefix and suffix ids, masks, processor tensors).

        Returns:
            The default: the device of the model's input embeddings.
        """
        return group.hf_model.get_input_embeddings().weight.device

    def forward(self, group: "PrefixGroup", module: torch.nn.Module, input_ids: torch.Tensor,
                position_ids: torch.Tensor, **kwargs):
        """Run one forward of `group`: Phase A's or a wave's.

        Args:
            group: the group the forward belongs to.
            module: Phase A: `engines.prefix_module(model)` (the decoder, or the FSDP2 root); a wave: the model as
                the group holds it (wrappers included).
            input_ids: `[B, L]` int64 token ids: Phase A's prefix without its last token `[1, P-1]`, or a wave's
                `Wave.input_ids`.
            position_ids: `[B, L]` int64 absolute positions, aligned with `input_ids`.
            **kwargs: the pass marker (`attention.PASS_KWARG`), MoE routes (`moe.ROUTES_KWARG`) and the model's own
                keyword arguments, passed on to `module`.

        Returns:
            `module`'s output. Phase A reads `[0]`: the last hidden state `[1, P-1, d]` (logits when `module` is the
            FSDP2 root); a wave's caller reads the model's output (`logits [B, L, V]`).
        """
        return module(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


class PrefixGroup:
    """One shared prefix: its training-time KV cache and the suffix waves that read it.

    Built by `prefix_group` or `GroupSession.open`; validated at construction, opened (Phase A) by the session.

    Args:
        model: a model `apply_prefixflow` switched, or a DDP / DeepSpeed / PEFT wrapper of one.
        prefix_ids: the shared prompt, `[P]` or `[1, P]` int64/int32 token ids, `P >= 1`, on `runner.device`
            (the embeddings' device). Its last token is not cached: each wave re-reads it.
        position_offset: position of the prefix's first token (non-zero when the stock path left-pads prompts).
        routes: MoE routing replay, the prefix's recorded experts `[layers, P, k]` (int; -1: not recorded). Given
            here, every wave must pass routes too.
        collect_router_logits: keep the prefix's MoE router logits as cached leaves (`cache.router_logits`, one
            `[P-1, E]` per MoE layer) for a load-balancing loss.
        runner: how the forwards run (`GroupRunner`, the default); parallel rules pass their own.
        prefix_inputs: an image prompt's processor tensors for this one prompt (`pixel_values`, `image_grid_thw`,
            `token_type_ids` ...; per-token ones `[P]` or `[1, P]`), on the same device (see `multimodal`).

    Attributes:
        cache: the group's `TrainingKVCache`, `prefix_length = P - 1`.
        suffix_checkpointing: None follows the model's `PrefixFlowConfig.suffix_checkpointing`; a bool overrides it
            for this group's waves.
        concatenated_attention: the waves attend over a per-wave copy of `[prefix ; suffix]` K/V in one kernel
            (False: the split attention, which reads the cache in place).

    Raises:
        PrefixFlowError: the model was not switched by `apply_prefixflow`; `prefix_ids` is not an integer tensor of
            shape `[P]` / `[1, P]` with `P >= 1`; an input is on the wrong device; `routes` has the wrong shape or
            names unknown experts; an image prompt with a custom runner, with routes, or on a model whose image
            prompts are refused (`multimodal.refusal`).
    """

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
        self.cache.position_offset = self.position_offset  # Phase A's positions (`attention.index_scaled_query`)
        self.state = "new"  # -> "open" -> "closed"
        self.trains = False
        # Per group, overriding the model's `suffix_checkpointing` (None: follow it); a trainer may set it per run.
        self.suffix_checkpointing: bool | None = None
        # Waves attend over the concatenated prefix and suffix K/V instead of the split kernels (see `SuffixPass`).
        self.concatenated_attention = False
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
        """The runner of an image prompt (`models.multimodal.MultimodalRunner`), which takes its processor tensors."""
        runner_class = getattr(self._inner, PROMPT_RUNNER, None)
        if runner_class is None:
            raise PrefixFlowError(
                f"image prompts cannot share their prefix here: {type(self._inner).__name__} takes no images, or "
                "was switched without apply_prefixflow (which checks its image prompts).")
        if runner is not None or self.routes is not None:
            raise PrefixFlowError("image prompts share their prefix on one process, without routing replay; "
                                  "sequence parallelism, pipelines and MoE replay train them on the plain path.")
        return runner_class(self, prefix_inputs)

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
        if self.offload is not None and config_of(self._inner).offload_kv:
            self.cache.host = self.offload  # the K/V and gK/gV wait on the host (`kv_cache.StreamedTensor`)
        with self.offload.hooks() if self.offload else contextlib.nullcontext(), self._recomputing() as recomputed:
            # With offload, recomputed layers keep their attention results on the host too (`recompute`).
            self.attention_replay = AttentionReplay(recomputed, self.offload) if self.offload and recomputed else None
            module, extra = prefix_module(self.model)
            marker = PrefixPass(self.cache, self.collect_router_logits, self.attention_replay)
            out = self.runner.forward(self, module, self.prefix_ids[:, :-1], positions, **{PASS_KWARG: marker},
                                      **replay, **extra)
        hidden = out[0]  # the last hidden state, or the logits when Phase A runs the whole model (FSDP2)
        self._check_state_captures()
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
        pool = host_pool(self._inner)
        if pool is None:
            pool = self._inner._prefixflow_pool = HostPool(pin=device.type == "cuda")
        offload = PrefixOffload(device, pool)
        offload.caches.append(self.cache)
        return offload

    def _recomputing(self) -> contextlib.AbstractContextManager:
        """Checkpoint the configured share of prefix layers; yields the checkpointed layers' indices (empty when
        nothing is switched and nothing is offloaded: only the offload's attention replay reads them)."""
        share = config_of(self._inner).recompute_share
        if not self.trains or not (share or self.offload):  # no layer to switch, and no replay needs the indices
            return contextlib.nullcontext(set())
        return recomputed_layers(decoder_of(self._inner), share)

    def _adopt(self, cache: TrainingKVCache) -> None:
        """Open on prefix K/V computed by another rank's Phase A (`distributed.placement`): the waves read `cache`,
        whose leaves have no prefix graph behind them here, so closing this group runs no Phase C."""
        if self.state != "new":
            raise PrefixFlowError("a prefix group is opened once; open a new one for the next prompt.")
        if has_states(self._inner):
            raise PrefixFlowError(STATES_ON_ONE_PROCESS)
        self.state, self.trains, self.cache = "open", torch.is_grad_enabled(), cache

    # -- Phase B ---------------------------------------------------------------------------------------------

    def _check_wave_inputs(self, tensors: list[torch.Tensor]) -> None:
        if self.state != "open":
            raise PrefixFlowError("this prefix group is closed; waves must run while it is open (inside its block).")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._check_device(tensor, "suffix ids")

    def run_wave(self, wave: Wave, **model_kwargs):
        """Forward one prepared wave through the model under this group's cache.

        Args:
            wave: a wave of this group (`padded_wave`, or `layouts.packed_wave` with this group's geometry).
            **model_kwargs: passed to the model unchanged (e.g. TRL's `shift_labels`, `fused_lm_head`).

        Returns:
            The model's output for `wave.input_ids [B, S]`: `logits [B, S, V]`, where `logits[:, t]` predicts the
            suffix token at wave position `t`.

        Raises:
            PrefixFlowError: `model_kwargs` sets one of `input_ids`, `position_ids`, `attention_mask`,
                `past_key_values`, `cache` or the PrefixFlow kwargs (the group sets them); and, from the attention,
                a wave under another dtype, device or autocast than Phase A, attention dropout, `output_attentions`.
        """
        reserved = {"position_ids", "attention_mask", "past_key_values", "cache", "input_ids", PASS_KWARG, ROUTES_KWARG}
        clash = reserved & model_kwargs.keys()
        if clash:
            raise PrefixFlowError(f"{sorted(clash)} are set by the prefix group; do not pass them to a wave.")
        if wave.routes is not None:
            model_kwargs[ROUTES_KWARG] = wave.routes
        marker = {PASS_KWARG: SuffixPass(self.cache, wave, self.concatenated_attention)}
        checkpointed = self.suffix_checkpointing
        keep = not (config_of(self._inner).suffix_checkpointing if checkpointed is None else checkpointed)
        self.cache.state_reads.clear()
        with checkpointing_suspended(self._inner) if keep else contextlib.nullcontext():
            out = self.runner.forward(self, self.model, wave.input_ids, wave.position_ids, **marker, **model_kwargs)
        self._check_state_reads()
        return out

    def _check_state_captures(self) -> None:
        """Phase A must capture every recurrent layer's state: a model that drops keyword arguments before its
        mixers would leave the waves to start them from zero."""
        missed = sorted(mixer_layers(self._inner) - {key[0] for key in self.cache.states})
        if missed:
            raise PrefixFlowError(
                f"{type(self._inner).__name__}: the recurrent layers {missed} did not receive PrefixFlow's pass "
                "marker in the prompt's forward (the model drops keyword arguments on their way to the layers), so "
                "their prompt state could not be cached. Train this model with the plain trainer.")

    def _check_state_reads(self) -> None:
        """Every recurrent layer whose prefix state Phase A captured must have read it in the wave: a model that
        drops keyword arguments on the way to its mixers would start them from a zero state, silently."""
        missed = sorted({key[0] for key in self.cache.states} - self.cache.state_reads)
        if missed:
            raise PrefixFlowError(
                f"{type(self._inner).__name__}: the recurrent layers {missed} did not receive PrefixFlow's pass "
                "marker in a suffix wave (the model drops keyword arguments on their way to the layers), so the "
                "completions would start them from a zero state instead of the prompt's. Train this model with the "
                "plain trainer.")

    def padded_wave(
        self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, routes: torch.Tensor | None = None
    ) -> Wave:
        """Lay out right-padded suffixes as a wave of this group, without running it (see `layouts.padded_wave`).

        Args:
            suffix_ids: `[B, S]` int64/int32 completion ids, right-padded, `S >= 1`, on the group's device.
            attention_mask: `[B, S]`, 1 (or True) for real tokens, right-padded; None: every token is real.
            routes: MoE routing replay, `[layers, B, S, k]` int (or a list of B `[layers, S, k]`), each suffix
                token's recorded experts; required exactly when the group has prefix routes.

        Returns:
            A `Wave` with `input_ids [B, S]` = the prefix's last token, then `suffix_ids[:, :-1]`.

        Raises:
            PrefixFlowError: the group is not open; an input on the wrong device; non-integer ids, a shape other
                than `[B, S]`, a mask of another shape or not right-padded; routes given to a group without prefix
                routes or missing on one with them, of another count than B, or naming unknown experts.
        """
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
        """Run a padded wave: `padded_wave` then `run_wave`.

        Args:
            suffix_ids: `[B, S]` int64/int32 completion ids, right-padded, on the group's device.
            attention_mask: `[B, S]`, 1 for real tokens (right-padded); None: all real.
            routes: MoE only, `[layers, B, S, k]` recorded experts (see `padded_wave`).
            **model_kwargs: passed to the model (see `run_wave`).

        Returns:
            The model's output; `logits [B, S, V]`, `logits[:, t]` predicts `suffix_ids[:, t]` exactly as position
            `P-1+t` of `[P || S]` does. Positions past a row's length are padding.

        Raises:
            PrefixFlowError: see `padded_wave` and `run_wave`.
        """
        return self.run_wave(self.padded_wave(suffix_ids, attention_mask, routes), **model_kwargs)

    def packed(self, suffixes: list[torch.Tensor], routes: list[torch.Tensor] | None = None, **model_kwargs):
        """Run a packed wave: the suffixes end to end in one row, each attending to the prefix and causally to
        itself only; no padding.

        Args:
            suffixes: n int64/int32 tensors of `L_i >= 1` token ids each (flattened, so `[L_i]` or `[1, L_i]`),
                on the group's device.
            routes: MoE only, one `[layers, L_i, k]` of recorded experts per suffix.
            **model_kwargs: passed to the model (see `run_wave`); per-token ones laid out packed, `[1, T]`.

        Returns:
            A `PackedOutput`: `logits [1, T, V]`, `T = sum(L_i)`; `out.split(out.logits)[i][t]` predicts
            `suffixes[i][t]`.

        Raises:
            PrefixFlowError: the group is not open; no suffixes, an empty one, non-integer ids; an input on the
                wrong device; routes as in `padded_wave`; and see `run_wave`.
        """
        self._check_wave_inputs(suffixes)
        if has_states(self._inner):
            raise PrefixFlowError(
                "packed waves put several completions end to end in one row, and this model's recurrent layers "
                "(convolution or state-space mixers) would carry one completion's state into the next. Run padded "
                "waves (group(suffix_ids, attention_mask=...); the trainer's prefixflow_layout='padded').")
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
    """Prefix groups open on one model: open them one by one, close any subset with one delayed prefix backward.

    At most one session (or `prefix_group`) is open per model; `with GroupSession(model) as session:` calls `start`
    and `finish`.

    Args:
        model: a model `apply_prefixflow` switched, or a wrapper of one (the one the groups are built on).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._inner = unwrap(model)
        self.groups: list[PrefixGroup] = []
        self._entered = False

    def start(self) -> "GroupSession":
        """Open the session: from here until `finish`, groups open and close on the model (a trainer's
        accumulation window).

        Returns:
            The session itself.

        Raises:
            PrefixFlowError: the session was started before, or another session or group is open on this model.
        """
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
        """Build a `PrefixGroup` and run its Phase A (`add`).

        Args:
            prefix_ids, position_offset, routes, collect_router_logits: see `PrefixGroup`.
            **prefix_inputs: an image prompt's processor tensors (see `prefix_group`).

        Returns:
            The open group.

        Raises:
            PrefixFlowError: see `PrefixGroup` and `add`.
        """
        return self.add(PrefixGroup(self.model, prefix_ids, position_offset, routes, collect_router_logits,
                                    prefix_inputs=prefix_inputs))

    def add(self, group: PrefixGroup) -> PrefixGroup:
        """Run Phase A for a group built beforehand: the prefix forward once, its K/V cached. Training (grad
        enabled) captures a graph for Phase C; under `torch.no_grad()` the group only scores.

        Args:
            group: a new `PrefixGroup` on this session's model.

        Returns:
            `group`, now open. If Phase A fails, the group is freed and the error propagates.

        Raises:
            PrefixFlowError: the session is not open; the group was opened before; reentrant activation
                checkpointing (the K/V would carry no graph); routing replay the model cannot make exact.
        """
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
        """Open `group` on prefix K/V computed elsewhere (another rank's Phase A) instead of running Phase A here;
        closing it runs no Phase C on this rank.

        Args:
            group: a new `PrefixGroup` on this session's model.
            cache: a `TrainingKVCache` whose leaves hold the prefix K/V `[1, H_kv, P-1, D]` per layer, on this
                rank's device; its gK/gV are left in `cache` for the caller to send back.

        Returns:
            `group`, now open.

        Raises:
            PrefixFlowError: the session is not open, or the group was opened before.
        """
        if _sessions.get(self._inner) is not self:
            raise PrefixFlowError("this session is not open; use it as `with GroupSession(model) as session:`.")
        group._adopt(cache)
        self.groups.append(group)
        return group

    def close(self, groups: list[PrefixGroup] | None = None, backward=None) -> int:
        """Phase C for `groups`: one backward through all their prefix graphs, fed by their gK/gV; then free them.

        Args:
            groups: open groups of this session; None: every open one.
            backward: `backward(outputs, grads)` to run instead of `torch.autograd.backward` (see
                `kv_cache.delayed_backward`); None: autograd's.

        Returns:
            How many cached tensors fed the backward (0: nothing trained, e.g. scoring groups).

        Raises:
            PrefixFlowError: a training group received no suffix backward (nothing is freed; `finish` frees it).
        """
        closing = list(self.groups) if groups is None else list(groups)
        caches = [g.cache for g in closing if g._needs_prefix_backward()]
        try:
            return delayed_backward(caches, backward) if backward else delayed_backward(caches)
        finally:
            for group in closing:
                group._release()
            self.groups = [g for g in self.groups if g not in closing]

    def finish(self, error: BaseException | None = None) -> None:
        """Close the session: Phase C for the groups still open, then free them and release the model.

        Args:
            error: the exception that ends the session, if any; then no Phase C runs, the groups are only freed.

        Raises:
            PrefixFlowError: see `close`.
        """
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
    """Open one group over a shared prefix as a context manager: Phase A on entry, Phase C on a clean exit.

        with prefix_group(model, prefix_ids) as group:
            out = group(suffix_ids, attention_mask=mask)   # logits [B, S, V]
            loss_fn(out.logits).backward()

    Args:
        model: a model `apply_prefixflow` switched, or a DDP / DeepSpeed / PEFT wrapper of one.
        prefix_ids: `[P]` or `[1, P]` int64/int32 token ids, on the device of the model's embeddings.
        position_offset: position of the prefix's first token (0 unless the stock path left-pads prompts).
        routes: MoE only, the prefix's recorded experts `[layers, P, k]` (int, -1: not recorded), replayed in
            Phases A and C; each wave then passes its own.
        **prefix_inputs: an image prompt's processor tensors for this one prompt (`pixel_values`, `image_grid_thw`,
            `token_type_ids` ...): Phase A runs the vision tower and the image tokens once (see `multimodal`).

    Returns:
        A context manager whose `__enter__` returns the open `PrefixGroup`. Exiting with an exception frees the
        group without Phase C.

    Raises:
        PrefixFlowError: at the call, bad inputs (see `PrefixGroup`); on entry, another group open on the model or
            a refused setting (see `GroupSession.add`); on exit, a training group closed without any suffix
            backward.
    """
    return _SingleGroup(model, prefix_ids, position_offset, routes, prefix_inputs)
