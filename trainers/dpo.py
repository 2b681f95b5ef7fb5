"""PrefixFlowDPOTrainer: TRL's DPOTrainer whose chosen/rejected pairs share their common prefix as a prefix group.

Swap `DPOTrainer` for `PrefixFlowDPOTrainer`; the config, data, every loss type, metrics and checkpoints stay TRL's.
TRL's collator puts a microbatch's chosen rows first and its rejected rows second, and `_compute_loss` (like
`compute_ref_log_probs`) scores them in one forward through TRL's fused LM head. This trainer answers that one call
differently: for each pair it finds the longest common token prefix of the two rows (the prompt and any identical
response opening, found per pair from the token ids), runs it once (Phase A), runs the two suffixes as one wave
(Phase B), and returns TRL's own output fields laid out exactly as the full forward lays them out. TRL's loss code
then runs unchanged on them, and Phase C (the delayed prefix backward) runs when the microbatch's backward is done.
The reference pass (a separate reference model, the PEFT adapter disabled, or `precompute_ref_log_probs`) scores
through no-grad groups the same way.

Pairs whose common prefix is short (`prefixflow_min_prefix_tokens`) or whose FLOP bound is below
`prefixflow_min_speedup`, and whole batches the groups cannot make exact (image pairs, MoE router losses,
padding-free rows, prompt-learning PEFT, ZeRO, FSDP, models `apply_prefixflow` refuses), take the plain
path: logged once per reason and counted in `prefixflow/fallback_rows`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate.utils import parse_flag_from_env
from trl import DPOConfig, DPOTrainer

try:
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError:  # TRL before 1.15 scores DPO without the fused LM head: every batch takes the plain path
    FusedCausalLMOutput = None

from hf_prefixflow import _compat
from hf_prefixflow.distributed import data_parallel
from hf_prefixflow.core.attention import PASS_KWARG, PrefixPass
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.planning.flops import MIN_SPEEDUP, PASS_FLOOR_TOKENS, ModelShape
from hf_prefixflow.apply import apply_prefixflow
from hf_prefixflow.core.access import unwrap
from hf_prefixflow.core.recompute import decoder_layers
from hf_prefixflow.core.scheduler import GroupRunner, GroupSession, PrefixGroup, _sessions

from . import compiling
from .engine_rule import DATA_PARALLEL

logger = logging.getLogger(__name__)

# Per-token fields of TRL's `FusedCausalLMOutput`, each `[rows, L - 1]` and zero where the label is -100.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
# The keyword arguments of TRL's preference forward that the pair path reproduces; any other means the plain path.
PAIR_KWARGS = {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache"}
MIN_PREFIX_TOKENS = 16
# One process, or DDP (`engine_rule.DataParallel`'s launches): a microbatch's backwards (waves, then Phase C)
# accumulate locally and one all-reduce follows. ZeRO and FSDP shard the weights the pairs' forwards would need
# gathered.
SHARING_ENGINES = DATA_PARALLEL

# Set while the pair path runs its own forwards (Phase A, waves, plain sub-batches): those go straight to TRL's head.
_inside = contextvars.ContextVar("prefixflow_pairs_inside", default=False)


@dataclass
class PrefixFlowDPOConfig(DPOConfig):
    """`DPOConfig` plus PrefixFlow's knobs; a plain `DPOConfig` gets these defaults."""

    prefixflow_min_prefix_tokens: int = field(
        default=MIN_PREFIX_TOKENS, metadata={"help": "pairs whose common token prefix is shorter train on the plain "
                                                     "path (logged and counted in prefixflow/fallback_rows)"})
    prefixflow_min_speedup: float = field(
        default=MIN_SPEEDUP, metadata={"help": "pairs whose FLOP bound (hf_prefixflow.planning.flops) is below this train on "
                                               "the plain path"})
    prefixflow_scoring: bool = field(
        default=True, metadata={"help": "reuse the common prefix in the reference pass too (no-grad groups)"})


DEFAULTS = {name: PrefixFlowDPOConfig.__dataclass_fields__[name].default
            for name in ("prefixflow_min_prefix_tokens", "prefixflow_min_speedup", "prefixflow_scoring")}


# -- pairs -----------------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    """The tokens a group shares between two rows: their longest common prefix, less what leaves each row at least
    one suffix token (a wave re-reads the prefix's last token as its first input).

    Args:
        a, b: the two rows' real token ids (no padding), each non-empty.

    Returns:
        `c` with `0 <= c <= min(len(a), len(b)) - 1` and `a[:c] == b[:c]`.
    """
    limit = min(len(a), len(b)) - 1
    c = 0
    while c < limit and a[c] == b[c]:
        c += 1
    return c


@dataclass
class Pair:
    """Two rows of a preference batch that share a prefix group.

    Attributes:
        rows: the batch rows `(chosen, rejected)`.
        lengths: their real lengths `(n_chosen, n_rejected)`.
        shared: `c`, the common prefix tokens (`common_prefix`).
    """

    rows: tuple[int, int]
    lengths: tuple[int, int]
    shared: int


def pair_rows(batch: int) -> list[tuple[int, int]]:
    """TRL's layout: the first half of a preference batch holds the chosen rows, the second the rejected rows."""
    half = batch // 2
    return [(i, half + i) for i in range(half)]


def right_padded_lengths(attention_mask: torch.Tensor) -> list[int] | None:
    """Each row's real length when every row is right-padded (ones, then zeros) and non-empty; None otherwise."""
    mask = attention_mask.detach().to("cpu", torch.long)
    lengths = mask.sum(1)
    expected = (torch.arange(mask.shape[1])[None] < lengths[:, None]).long()
    if not torch.equal(mask, expected) or bool((lengths == 0).any()):
        return None
    return lengths.tolist()


class _PrefixOutput(GroupRunner):
    """The default runner, keeping Phase A's last hidden state `[1, P-1, d]` (a common prefix that reaches into the
    responses has scored tokens whose predictions Phase A computes). Given `fused`, the model's forward as TRL left
    it, the waves run through it rather than through the module's call: Accelerate's mixed-precision wrapper around
    that call may already be running (`_compat.forward_without_mixed_precision`)."""

    def __init__(self, fused: Callable | None = None):
        self.fused = fused
        self.hidden: torch.Tensor | None = None

    def forward(self, group, module, input_ids, position_ids, **kwargs):
        prefix = isinstance(kwargs.get(PASS_KWARG), PrefixPass)
        if self.fused is not None and not prefix:
            return self.fused(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        out = super().forward(group, module, input_ids, position_ids, **kwargs)
        if prefix:
            self.hidden = out[0]
        return out


class PairScorer:
    """Scores a preference batch the way TRL's fused forward does, sharing each pair's common prefix.

    One per trainer. A training call's groups stay open in `session` until `phase_c`; a no-grad call (reference
    pass, evaluation) closes its groups before it returns.

    Args:
        shape: the policy's `ModelShape` (the FLOP bound).
        min_prefix_tokens: pairs sharing fewer tokens take the plain path.
        min_speedup: pairs whose FLOP bound is lower take the plain path.
        floor_tokens: the least work per pass in tokens (`flops.PASS_FLOOR_TOKENS` on a GPU, 0 on a CPU).
        count_fallback: `count_fallback(reason, rows)`, called for rows taking the plain path.
        log_groups: `log_groups(pairs, training, seconds)`, called after a batch's shared pairs ran.
    """

    # A pair's wave is two short rows: one attention kernel over the concatenated K/V rounds its output and dQ to
    # bf16 once, where the split kernels round twice, which LoRA's A matrices showed in the bf16 criterion
    # (docs/dpo.md); the per-wave copy of the prompt's K/V is small beside the pair's Phase A.
    concatenated_attention = True

    def __init__(self, shape: ModelShape, min_prefix_tokens: int, min_speedup: float, floor_tokens: int,
                 count_fallback: Callable[[str, int], None], log_groups: Callable[[list[Pair], bool, float], None]):
        self.shape = shape
        self.min_prefix_tokens = int(min_prefix_tokens)
        self.min_speedup = float(min_speedup)
        self.floor_tokens = floor_tokens
        self.count_fallback = count_fallback
        self.log_groups = log_groups
        self.session: GroupSession | None = None
        # Phase A outputs whose scored tokens were detached into leaves: (live output, leaf), fed to Phase C.
        self.hidden: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- choosing --------------------------------------------------------------------------------------------

    def pairs(self, input_ids: torch.Tensor, lengths: list[int], pair_index: list[tuple[int, int]]) -> tuple[
            list[Pair], list[int]]:
        """The pairs worth sharing and the rows that take the plain path (short prefix, low FLOP bound).

        Args:
            input_ids: `[2B, L]` right-padded rows.
            lengths: each row's real length.
            pair_index: `(chosen, rejected)` row pairs.

        Returns:
            The shared `Pair`s in batch order, and the plain rows.
        """
        ids = input_ids.detach().cpu().tolist()
        shared, plain = [], []
        for chosen, rejected in pair_index:
            a, b = ids[chosen][: lengths[chosen]], ids[rejected][: lengths[rejected]]
            c = common_prefix(a, b)
            suffixes = [len(a) - c, len(b) - c]
            if c >= max(self.min_prefix_tokens, 1) and self.shape.pays(c, suffixes, self.min_speedup, None,
                                                                       self.floor_tokens):
                shared.append(Pair((chosen, rejected), (len(a), len(b)), c))
            else:
                plain += [chosen, rejected]
        return shared, plain

    # -- scoring ---------------------------------------------------------------------------------------------

    def score(self, model: torch.nn.Module, fused: Callable, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              labels: torch.Tensor, lengths: list[int], pair_index: list[tuple[int, int]]) -> FusedCausalLMOutput:
        """TRL's fused forward of a preference batch: shared pairs through prefix groups, the rest in one plain
        sub-batch.

        Args:
            model: the transformers model (`apply_prefixflow` switched) whose fused forward is `fused`.
            fused: TRL's fused-LM-head forward of `model` (bound), for the plain rows and the waves.
            input_ids, attention_mask, labels: `[2B, L]` right-padded, as TRL's collator builds them; labels are
                -100 outside the completions.
            lengths: each row's real length.
            pair_index: `(chosen, rejected)` row pairs.

        Returns:
            A `FusedCausalLMOutput` whose per-token fields are `[2B, L-1]`, entry `k` scoring token `k+1` as the
            full forward does (zero where the label is -100); `loss` as TRL's head computes it.
        """
        shared, plain = self.pairs(input_ids, lengths, pair_index)
        plain.sort()  # batch order: with no pair shared, the plain forward is the stock one, row for row
        rows: dict[int, dict[str, torch.Tensor | None]] = {}
        width = input_ids.shape[1] - 1
        if plain:
            self.count_fallback("common prefix below prefixflow_min_prefix_tokens or prefixflow_min_speedup",
                                len(plain))
            index = torch.tensor(plain, device=input_ids.device)
            if len(plain) == input_ids.shape[0]:
                index = slice(None)  # every row: the batch itself, no copy
            with _inside_path():
                out = fused(input_ids=input_ids[index], attention_mask=attention_mask[index], labels=labels[index],
                            fused_lm_head=True, use_cache=False)
            for position, row in enumerate(plain):
                rows[row] = {name: _row(getattr(out, name, None), position) for name in FIELDS}
        if shared:
            start = time.perf_counter()
            training = torch.is_grad_enabled()
            session, local = self._session_for(model, training)
            opened = []
            try:
                for pair in shared:
                    group, runner = self._open(session, model, fused, input_ids[pair.rows[0], : pair.shared])
                    opened.append(group)
                    rows.update(self._pair_fields(group, runner, pair, fused, input_ids, labels, width, training))
            except BaseException as exc:
                if local:
                    session.finish(exc)
                elif not training:
                    session.close(opened)  # scoring groups: freed, nothing to backpropagate
                raise  # a training session's groups are freed by `phase_c(error)`
            if local:
                session.finish()
            elif not training:
                session.close(opened)  # scoring groups inside a training session: nothing to backpropagate
            self.log_groups(shared, training, time.perf_counter() - start)
        return _assemble(rows, input_ids.shape[0], width)

    def _session_for(self, model: torch.nn.Module, training: bool) -> tuple[GroupSession, bool]:
        """The session to open groups in, and whether it is this call's own (finished before returning)."""
        inner = unwrap(model)
        if training:
            if self.session is None:
                self.session = GroupSession(model).start()
            return self.session, False
        current = _sessions.get(inner)
        if current is not None and current is self.session:
            return current, False  # e.g. the reference pass through the disabled PEFT adapter, mid-microbatch
        return GroupSession(model).start(), True

    def _open(self, session: GroupSession, model: torch.nn.Module, fused: Callable, prefix_ids: torch.Tensor):
        """Phase A of one pair's common prefix `[c]`; returns the open group and the runner holding its output."""
        runner = _PrefixOutput(fused)
        group = PrefixGroup(model, prefix_ids, runner=runner)
        group.concatenated_attention = self.concatenated_attention
        with _inside_path():
            session.add(group)
        return group, runner

    def _pair_fields(self, group, runner: _PrefixOutput, pair: Pair, fused, input_ids, labels, width: int,
                     training: bool) -> dict[int, dict]:
        """The two rows' fields: the prefix's scored tokens from Phase A's output, the suffixes from one wave."""
        c = pair.shared
        suffix_width = max(pair.lengths) - c
        ids = torch.stack([_fit(input_ids[row, c : n], suffix_width, 0) for row, n in zip(pair.rows, pair.lengths)])
        wave_labels = torch.stack([_fit(labels[row, c : n], suffix_width, -100)
                                   for row, n in zip(pair.rows, pair.lengths)])
        real = torch.tensor([n - c for n in pair.lengths], device=ids.device)
        mask = (torch.arange(suffix_width, device=ids.device)[None] < real[:, None]).long()
        with _inside_path():
            wave = group(ids, attention_mask=mask, shift_labels=wave_labels, fused_lm_head=True)
        prefix = [self._prefix_fields(runner, fused, labels[row, 1:c], training) for row in pair.rows]
        out = {}
        for j, (row, n) in enumerate(zip(pair.rows, pair.lengths)):
            out[row] = {}
            for name in FIELDS:
                values = getattr(wave, name, None)
                if values is None:
                    out[row][name] = None
                    continue
                head = prefix[j].get(name)
                if head is None:  # no scored token in the prefix: TRL's head gives zeros there
                    head = values.new_zeros(c - 1)
                out[row][name] = torch.cat([head, values[j, : n - c], values.new_zeros(width - (n - 1))])
        return out

    def _prefix_fields(self, runner: _PrefixOutput, fused, labels: torch.Tensor, training: bool) -> dict:
        """TRL's head on Phase A's hidden states for a common prefix's scored tokens (an identical response
        opening); `labels [c-1]` are tokens `1 .. c-1`. Empty when none is scored."""
        if runner.hidden is None or not bool((labels != -100).any()):
            return {}
        with _inside_path():
            out = _compat.fused_head_on_hidden(fused, self.prefix_hidden(runner, training), labels[None])
        return {name: getattr(out, name)[0] for name in FIELDS if getattr(out, name, None) is not None}

    def prefix_hidden(self, runner: _PrefixOutput, training: bool) -> torch.Tensor:
        """Phase A's last hidden state `[1, P-1, d]` to read outputs from. Training: a leaf detached from it, whose
        gradient joins the delayed backward (Phase C owns the prefix graph; a second backward through it would
        find it freed)."""
        live = runner.hidden
        if not (training and live.requires_grad):
            return live
        leaf = next((held for output, held in self.hidden if output is live), None)
        if leaf is None:
            leaf = live.detach().requires_grad_(True)
            self.hidden.append((live, leaf))
        return leaf

    # -- Phase C ---------------------------------------------------------------------------------------------

    def phase_c(self, error: BaseException | None = None) -> None:
        """The delayed prefix backward of every group the training session holds, fed by the gK/gV the waves left
        and by the gradient Phase A's output received through scored prefix tokens; then free them."""
        session, hidden = self.session, self.hidden
        self.session, self.hidden = None, []
        if session is None:
            return
        if error is not None:
            session.finish(error)
            return
        extra = [(live, leaf.grad) for live, leaf in hidden if leaf.grad is not None]
        ran = []

        def backward(outputs, grads):
            ran.append(True)
            torch.autograd.backward(list(outputs) + [o for o, _ in extra], list(grads) + [g for _, g in extra])

        try:
            session.close(backward=backward)
            if extra and not ran:  # no cached K/V took a gradient, Phase A's output did
                torch.autograd.backward([o for o, _ in extra], [g for _, g in extra])
        except BaseException as exc:
            session.finish(exc)
            raise
        session.finish()


@contextlib.contextmanager
def _inside_path():
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def _fit(values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[0]), value=fill)


def _row(values: torch.Tensor | None, position: int) -> torch.Tensor | None:
    return None if values is None else values[position]


def _assemble(rows: dict[int, dict], count: int, width: int) -> FusedCausalLMOutput:
    """Stack per-row fields `[L-1]` into TRL's `[2B, L-1]` output, in batch order."""
    fields = {}
    for name in FIELDS:
        values = [rows[r][name] for r in range(count)]
        fields[name] = None if any(v is None for v in values) else torch.stack(values)
    mask = fields["label_mask"]
    loss = -fields["log_probs"].sum() / mask.sum().clamp(min=1) if mask is not None else None
    return FusedCausalLMOutput(loss=loss, **fields)


# -- the trainer -----------------------------------------------------------------------------------------------


class PairTrainerMixin:
    """What a pair trainer adds to its TRL trainer: Phase C after each training step (`pair_training_step`), and
    plain-path rows counted in `prefixflow/fallback_rows`, each reason logged once. `_plain_path` names the stock
    path in that log line; the trainer sets `_scorer` and `_fallbacks`."""

    _plain_path = "plain"

    def _build_accelerator_args(self, **kwargs) -> dict:
        # torch_compile: each decoder layer compiled in place (`_compile_layers`) and pairs shared. Under ZeRO, FSDP or
        # a parallelism config, and for a model without decoder layers, every pair takes the plain path and
        # Accelerate compiles as it would for the stock trainer.
        options = super()._build_accelerator_args(**kwargs)
        self._layerwise = bool(self.args.torch_compile and not _shards(options) and decoder_layers(self.model))
        return compiling.layerwise_accelerator_args(options) if self._layerwise else options

    def _compile_layers(self, *models: torch.nn.Module | None) -> None:
        """With `torch_compile` (layer by layer), compile the decoder layers of `models` (None: skipped)."""
        if self._layerwise:
            compiling.compile_decoder_layers([m for m in models if m is not None], self.args.torch_compile_backend,
                                             self.args.torch_compile_mode)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return pair_training_step(self, super().training_step, model, inputs, num_items_in_batch)

    def _end_session(self, error: BaseException | None = None) -> None:
        """Phase C for the groups the last training forward opened (none: nothing to do)."""
        self._scorer.phase_c(error)

    def _setting_reason(self) -> str | None:
        """Why the trainer's settings send every pair to the plain path (the same for every pair trainer), if so."""
        if self.args.torch_compile and not self._layerwise:
            return "torch_compile (the whole model compiled as one module)"
        if getattr(self.args, "activation_offloading", False):
            return "activation_offloading (TRL's saved-tensor hooks)"
        peft_config = getattr(self.model, "peft_config", None)
        if peft_config and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
            return "prompt-learning PEFT (virtual tokens)"
        if self.args.gradient_checkpointing and (self.args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            return "reentrant activation checkpointing"
        return None

    def _count_fallback(self, reason: str, rows: int) -> None:
        mode = "train" if self.model.training else "eval"
        _compat.trl_metrics(self, mode)["prefixflow/fallback_rows"].append(float(rows))
        if not self._fallbacks[reason]:
            logger.warning("PrefixFlow: rows take the %s path (%s); counted in prefixflow/fallback_rows.",
                           self._plain_path, reason)
        self._fallbacks[reason] += max(rows, 1)


class PrefixFlowDPOTrainer(PairTrainerMixin, DPOTrainer):
    """`DPOTrainer` whose chosen and rejected rows run their common prefix once per pair (training and reference
    passes); TRL's loss code runs unchanged on the per-token log-probs."""

    _plain_path = "plain DPO"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prefixflow_setup()

    # -- setup -----------------------------------------------------------------------------------------------

    def _prefixflow_setup(self) -> None:
        """Switch the policy and reference models to PrefixFlow and route their preference forwards through the
        pair path; idempotent (precomputing reference log-probs reaches here from inside `DPOTrainer.__init__`)."""
        if getattr(self, "_scorer", None) is not None:
            self._route(self.model)
            if self.ref_model is not None:
                self._route(self.ref_model)
            return
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(self.args, name, default))
        self._fallbacks: Counter = Counter()
        self._reason = self._whole_run_reason()
        shape = ModelShape.from_config(unwrap(self.model).config)
        floor = PASS_FLOOR_TOKENS if self.accelerator.device.type == "cuda" else 0
        self._scorer = PairScorer(shape, self.prefixflow_min_prefix_tokens, self.prefixflow_min_speedup, floor,
                                  self._count_fallback, self._log_groups)
        self._route(self.model)
        if self.ref_model is not None:
            self._route(self.ref_model)
        self._compile_layers(self.model, self.ref_model)
        if self._reason is not None:
            logger.warning("PrefixFlow: every batch of this run takes the plain DPO path (%s).", self._reason)

    def _whole_run_reason(self) -> str | None:
        """Why no batch of this run can share its pairs exactly, if so."""
        if _compat.trl_fused_lm_head() is None:
            return "TRL before 1.15 scores DPO without the fused LM head"
        if self.accelerator.distributed_type not in SHARING_ENGINES:
            return f"{self.accelerator.distributed_type} (pairs are shared on one process or under DDP)"
        if getattr(self.args, "parallelism_config", None) is not None:
            return "parallelism_config (tensor, context or sequence parallelism)"
        if self._is_vision_dataset or self._is_vlm:
            return "image-text pairs"
        if self.padding_free:
            return "padding_free rows"
        if self.aux_loss_enabled or getattr(unwrap(self.model).config.get_text_config(), "output_router_logits",
                                            False):
            return "MoE router auxiliary loss"
        setting = self._setting_reason()
        if setting is not None:
            return setting
        return None

    def _route(self, model: torch.nn.Module) -> None:
        """Switch `model` (once) and wrap its fused forward: preference forwards while scoring go the pair path."""
        inner = unwrap(model)
        if getattr(inner, "_prefixflow_pairs", False):
            return
        if self._reason is None:
            try:
                apply_prefixflow(model)
            except PrefixFlowError as error:
                self._reason = f"model refused by apply_prefixflow: {error}"
        fused = inner.forward  # as a call would run it: Accelerate's mixed precision included if prepared already
        raw = _compat.forward_without_mixed_precision(inner)
        scorer, trainer = self._scorer, self

        @functools.wraps(fused)
        def forward(*args, **kwargs):
            if _inside.get() or not kwargs.get("fused_lm_head") or args:
                return fused(*args, **kwargs)
            reason = trainer._reason or _call_reason(kwargs)
            lengths = None if reason else right_padded_lengths(kwargs["attention_mask"])
            if reason is None and lengths is None:
                reason = "rows not right-padded"
            if reason is None and not trainer.prefixflow_scoring and not torch.is_grad_enabled():
                reason = "prefixflow_scoring=False"
            if reason is not None:
                trainer._count_fallback(reason, kwargs["input_ids"].shape[0] if "input_ids" in kwargs else 0)
                return fused(*args, **kwargs)
            # A fresh autocast for the pair path's own forwards (Phase A, waves, plain rows), the one the model's
            # prepared call would enter, whether Accelerate prepared the model before this wrapper or around it.
            with trainer.accelerator.autocast():
                return scorer.score(inner, raw, kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"],
                                    lengths, pair_rows(kwargs["input_ids"].shape[0]))

        inner.forward = forward
        inner._prefixflow_pairs = True

    # -- the stock entry points, with Phase C after each microbatch's backward --------------------------------

    def compute_ref_log_probs(self, model, inputs):
        self._prefixflow_setup()  # `precompute_ref_log_probs` runs inside DPOTrainer.__init__
        return super().compute_ref_log_probs(model, inputs)

    # -- metrics ---------------------------------------------------------------------------------------------

    def _log_groups(self, pairs: list[Pair], training: bool, seconds: float) -> None:
        mode = "train" if self.model.training else "eval"
        shape = self._scorer.shape
        full = sum(shape.full_sequence(p.shared, [n - p.shared for n in p.lengths]) for p in pairs)
        shared = sum(shape.prefixflow(p.shared, [n - p.shared for n in p.lengths]) for p in pairs)
        prefix = "prefixflow/" if training else "prefixflow/scoring_"
        metrics = _compat.trl_metrics(self, mode)
        metrics[prefix + "groups"].append(float(len(pairs)))
        metrics[prefix + "tokens_saved"].append(float(sum(p.shared for p in pairs)))
        metrics[prefix + "flops_saved"].append(1.0 - shared / full)
        metrics[prefix + ("phase_ab_s" if training else "s")].append(seconds)


def pair_training_step(trainer, step: Callable, model: torch.nn.Module, inputs: dict, num_items_in_batch):
    """TRL's training step (`step`: forward, loss, backward), then Phase C for the groups its forward opened. Under
    DDP every backward of the step accumulates locally (Phase C touches the prefix's parameters after the
    microbatch's backward, where DDP would already have reduced) and the gradients are averaged once, at the
    accumulation boundary, as DDP would have."""
    sharing = trainer._reason is None
    with data_parallel.local_gradients(model) if sharing else contextlib.nullcontext():
        try:
            loss = step(model, inputs, num_items_in_batch)
        except BaseException as exc:
            trainer._end_session(exc)
            raise
        if trainer._scorer.session is not None:
            start = time.perf_counter()
            trainer._end_session()
            _compat.trl_metrics(trainer, "train")["prefixflow/phase_c_s"].append(time.perf_counter() - start)
    if sharing and trainer.accelerator.sync_gradients:
        data_parallel.all_reduce_gradients(model)
    return loss


def _shards(options: dict) -> bool:
    """Whether the Accelerator built from `options` (`Trainer._build_accelerator_args`) runs ZeRO, FSDP or a
    parallelism config, from its plugins or from `accelerate launch`'s environment, as `Accelerator` reads them."""
    launched = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or parse_flag_from_env("ACCELERATE_USE_FSDP")
    return launched or any(options.get(key) is not None
                           for key in ("deepspeed_plugin", "fsdp_plugin", "parallelism_config"))


def _call_reason(kwargs: dict) -> str | None:
    """Why one preference forward takes the plain path as a whole, if so."""
    # PEFT passes `return_dict=True` (the output is a ModelOutput either way); None means unset.
    extra = sorted(k for k, v in kwargs.items()
                   if k not in PAIR_KWARGS and v is not None and not (k == "return_dict" and v is True))
    if extra:
        return f"forward arguments {extra}"
    ids, mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if ids is None or mask is None or labels is None or ids.dim() != 2 or ids.shape[0] % 2:
        return "not a preference batch of chosen and rejected rows"
    if ids.shape[1] < 2:
        return "one-token rows"
    return None
