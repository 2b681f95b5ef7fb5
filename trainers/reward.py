"""PrefixFlowRewardTrainer: TRL's RewardTrainer whose chosen/rejected pairs share their longest common token prefix.

Swap `RewardTrainer` for `PrefixFlowRewardTrainer`; the config, data, loss (margins, `center_rewards_coefficient`),
metrics and checkpoints stay TRL's. TRL merges the prompt into both responses before tokenizing, so the shared
prefix is found per pair from the token ids: the longest common prefix of the two rows. Phase A runs it once, the two
suffixes run as one wave, and Phase C runs once the microbatch's backward is done.

A `*ForSequenceClassification` model reads its score head at one token per row, which PrefixFlow's attention path
does not serve directly (`apply_prefixflow` probes a model by its LM logits). The smallest exact way: the groups run
the model's own decoder stack through a causal-LM view that shares it (`causal_view`: the same decoder modules, an
LM head on the meta device that never runs), which `apply_prefixflow` probes and switches like any decoder; the
trainer then applies the model's `score` head to the hidden state of the token transformers' pooling reads (the
rightmost token that is not the pad id), from the wave or, if it lies in the common prefix, from Phase A's output.
Outside the groups the model computes exactly what it did before.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl import RewardConfig, RewardTrainer

from hf_prefixflow import _compat
from hf_prefixflow.core.attention import PASS_KWARG, SuffixPass
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.planning.flops import MIN_SPEEDUP, PASS_FLOOR_TOKENS, ModelShape
from hf_prefixflow.apply import apply_prefixflow
from hf_prefixflow.core.access import decoder_of, unwrap

from .dpo import (MIN_PREFIX_TOKENS, SHARING_ENGINES, Pair, PairScorer, PairTrainerMixin, _inside, _inside_path,
                  _PrefixOutput, pair_rows, right_padded_lengths)

logger = logging.getLogger(__name__)

# The keyword arguments of TRL's reward forward; `margin` is a loss input the model ignores.
REWARD_KWARGS = {"input_ids", "attention_mask", "use_cache", "margin"}


@dataclass
class PrefixFlowRewardConfig(RewardConfig):
    """`RewardConfig` plus PrefixFlow's knobs; a plain `RewardConfig` gets these defaults."""

    prefixflow_min_prefix_tokens: int = field(
        default=MIN_PREFIX_TOKENS, metadata={"help": "pairs whose common token prefix is shorter train on the plain "
                                                     "path (logged and counted in prefixflow/fallback_rows)"})
    prefixflow_min_speedup: float = field(
        default=MIN_SPEEDUP, metadata={"help": "pairs whose FLOP bound (hf_prefixflow.planning.flops) is below this "
                                               "train on the plain path"})


DEFAULTS = {name: PrefixFlowRewardConfig.__dataclass_fields__[name].default
            for name in ("prefixflow_min_prefix_tokens", "prefixflow_min_speedup")}


def causal_view(model: torch.nn.Module) -> torch.nn.Module:
    """A causal-LM model of the same architecture whose decoder stack is `model`'s own (shared modules, shared
    parameters); its LM head lives on the meta device and never runs. Prefix groups open on it.

    Args:
        model: a transformers `*ForSequenceClassification` with transformers' generic score head (or a PEFT wrapper).

    Returns:
        The view, not yet switched by `apply_prefixflow`.

    Raises:
        PrefixFlowError: no causal-LM class for the config, or a decoder attribute the two classes do not share.
    """
    inner = unwrap(model)
    try:
        with torch.device("meta"):
            view = AutoModelForCausalLM.from_config(inner.config)
    except (ValueError, KeyError) as error:
        raise PrefixFlowError(f"no causal-LM class shares {type(inner).__name__}'s decoder: {error}") from error
    prefix = inner.base_model_prefix
    if getattr(view, "base_model_prefix", None) != prefix or not hasattr(view, prefix):
        raise PrefixFlowError(f"{type(view).__name__} holds its decoder elsewhere than {type(inner).__name__}.")
    setattr(view, prefix, getattr(inner, prefix))
    view.config = getattr(inner, prefix).config  # the decoder's config object: one attention switch for both
    for param in view.get_output_embeddings().parameters():
        param.requires_grad_(False)  # not a trainable parameter: gK/gV's default dtype reads the trainable ones
    view.train(inner.training)
    return view


def read_positions(input_ids: torch.Tensor, pad_token_id: int | None) -> list[int]:
    """The token transformers' sequence-classification pooling reads per row: the rightmost one that is not the pad
    id (0 when every token is), or the last one when the config has no pad id."""
    if pad_token_id is None:
        return [input_ids.shape[1] - 1] * input_ids.shape[0]
    ids = input_ids.detach().cpu()
    indices = torch.arange(ids.shape[1])
    return ((ids != pad_token_id).long() * indices).argmax(-1).tolist()


class _DecoderWaves(_PrefixOutput):
    """Phase A keeps its output (`_PrefixOutput`); a wave runs the decoder stack alone: its hidden states are what
    the score head reads."""

    def forward(self, group, module, input_ids, position_ids, **kwargs):
        if isinstance(kwargs.get(PASS_KWARG), SuffixPass):
            module = decoder_of(group.model)
        return super().forward(group, module, input_ids, position_ids, **kwargs)


class RewardPairScorer(PairScorer):
    """Scores a reward batch the way the model's forward does (pooled score logits `[2B, num_labels]`), sharing
    each pair's common prefix. See `PairScorer` for the sessions and Phase C."""

    def score_pairs(self, view: torch.nn.Module, model: torch.nn.Module, forward: Callable, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, lengths: list[int], pair_index: list[tuple[int, int]],
                    pad_token_id: int | None) -> SequenceClassifierOutputWithPast:
        """The pooled logits of a reward batch: shared pairs through prefix groups, the rest in one plain sub-batch.

        Args:
            view: `causal_view(model)`, switched by `apply_prefixflow`: the groups open on it.
            model: the transformers `*ForSequenceClassification` (its `score` head).
            forward: the model's own forward (bound), for the plain rows.
            input_ids, attention_mask: `[2B, L]` right-padded, chosen rows first.
            lengths: each row's real length.
            pair_index: `(chosen, rejected)` row pairs.
            pad_token_id: the pad id transformers' pooling skips.

        Returns:
            `SequenceClassifierOutputWithPast` with `logits [2B, num_labels]`, in batch order.
        """
        shared, plain = self.pairs(input_ids, lengths, pair_index)
        plain.sort()  # batch order: with no pair shared, the plain forward is the stock one, row for row
        reads = read_positions(input_ids, pad_token_id)
        rows: dict[int, torch.Tensor] = {}
        if plain:
            self.count_fallback("common prefix below prefixflow_min_prefix_tokens or prefixflow_min_speedup",
                                len(plain))
            index = torch.tensor(plain, device=input_ids.device)
            if len(plain) == input_ids.shape[0]:
                index = slice(None)  # every row: the batch itself, no copy
            with _inside_path():
                out = forward(input_ids=input_ids[index], attention_mask=attention_mask[index], use_cache=False)
            rows.update({row: out.logits[i] for i, row in enumerate(plain)})
        if shared:
            start = time.perf_counter()
            training = torch.is_grad_enabled()
            session, local = self._session_for(view, training)
            opened, hidden = [], {}
            try:
                for pair in shared:
                    runner = _DecoderWaves()
                    group = self._open_on(session, view, input_ids[pair.rows[0], : pair.shared], runner)
                    opened.append(group)
                    hidden.update(self._pair_hidden(group, runner, pair, input_ids, reads, pad_token_id, training))
            except BaseException as exc:
                if local:
                    session.finish(exc)
                elif not training:
                    session.close(opened)
                raise
            order = list(hidden)
            logits = model.score(torch.stack([hidden[r] for r in order]))  # the head, once for every shared row
            rows.update({row: logits[i] for i, row in enumerate(order)})
            if local:
                session.finish()
            elif not training:
                session.close(opened)
            self.log_groups(shared, training, time.perf_counter() - start)
        return SequenceClassifierOutputWithPast(logits=torch.stack([rows[r] for r in range(input_ids.shape[0])]))

    def _open_on(self, session, view, prefix_ids: torch.Tensor, runner: _DecoderWaves):
        from hf_prefixflow.core.scheduler import PrefixGroup

        group = PrefixGroup(view, prefix_ids, runner=runner)
        group.concatenated_attention = self.concatenated_attention
        with _inside_path():
            session.add(group)
        return group

    def _pair_hidden(self, group, runner: _DecoderWaves, pair: Pair, input_ids: torch.Tensor, reads: list[int],
                     pad_token_id: int | None, training: bool) -> dict[int, torch.Tensor]:
        """The hidden state `[d]` each row's pooling reads. A wave's input `t` is token `c-1+t`, so a suffix of
        `n-c` tokens plus one that is never an input makes the row's last token `n-1` an input."""
        c = pair.shared
        fill = 0 if pad_token_id is None else pad_token_id
        width = max(pair.lengths) - c + 1
        ids = torch.stack([torch.nn.functional.pad(input_ids[row, c:n], (0, width - (n - c)), value=fill)
                           for row, n in zip(pair.rows, pair.lengths)])
        real = torch.tensor([n - c + 1 for n in pair.lengths], device=ids.device)
        mask = (torch.arange(width, device=ids.device)[None] < real[:, None]).long()
        with _inside_path():
            wave = group(ids, attention_mask=mask).last_hidden_state  # [2, width, d]
        out = {}
        for j, row in enumerate(pair.rows):
            k = reads[row]
            out[row] = wave[j, k - (c - 1)] if k >= c - 1 else self.prefix_hidden(runner, training)[0, k]
        return out


class PrefixFlowRewardTrainer(PairTrainerMixin, RewardTrainer):
    """`RewardTrainer` whose chosen and rejected rows run their common prefix once per pair."""

    _plain_path = "plain reward"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(self.args, name, default))
        self._fallbacks: Counter = Counter()
        inner = unwrap(self.model)
        shape = ModelShape.from_config(inner.config)
        floor = PASS_FLOOR_TOKENS if self.accelerator.device.type == "cuda" else 0
        self._scorer = RewardPairScorer(shape, self.prefixflow_min_prefix_tokens, self.prefixflow_min_speedup, floor,
                                        self._count_fallback, self._log_groups)
        self._reason = self._whole_run_reason()
        self._view = None
        if self._reason is None:
            try:
                self._view = apply_prefixflow(causal_view(self.model))
            except PrefixFlowError as error:
                self._reason = f"model refused by apply_prefixflow: {error}"
        if self._reason is not None:
            logger.warning("PrefixFlow: every batch of this run takes the plain reward path (%s).", self._reason)
        self._route(inner)
        self._compile_layers(self.model)

    def _whole_run_reason(self) -> str | None:
        """Why no batch of this run can share its pairs exactly, if so."""
        inner = unwrap(self.model)
        if self.accelerator.distributed_type not in SHARING_ENGINES:
            return f"{self.accelerator.distributed_type} (pairs are shared on one process or under DDP)"
        if getattr(self.args, "parallelism_config", None) is not None:
            return "parallelism_config (tensor, context or sequence parallelism)"
        if not _compat.generic_sequence_classifier(inner):
            return (f"{type(inner).__name__} is not transformers' generic sequence classifier (a `score` head read at "
                    "the rightmost non-pad token)")
        if getattr(inner.config.get_text_config(), "output_router_logits", False):
            return "MoE router auxiliary loss"
        setting = self._setting_reason()
        if setting is not None:
            return setting
        return None

    def _route(self, inner: torch.nn.Module) -> None:
        """Wrap the model's forward: reward batches go the pair path."""
        original = inner.forward
        trainer = self

        @functools.wraps(original)
        def forward(*args, **kwargs):
            if _inside.get() or args:
                return original(*args, **kwargs)
            reason = trainer._reason or _call_reason(kwargs)
            lengths = None if reason else right_padded_lengths(kwargs["attention_mask"])
            if reason is None and lengths is None:
                reason = "rows not right-padded"
            if reason is not None:
                trainer._count_fallback(reason, kwargs["input_ids"].shape[0] if "input_ids" in kwargs else 0)
                return original(*args, **kwargs)
            trainer._view.train(inner.training)
            pad = inner.config.get_text_config().pad_token_id
            return trainer._scorer.score_pairs(trainer._view, inner, original, kwargs["input_ids"],
                                               kwargs["attention_mask"], lengths,
                                               pair_rows(kwargs["input_ids"].shape[0]), pad)

        inner.forward = forward

    def _log_groups(self, pairs: list[Pair], training: bool, seconds: float) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = _compat.trl_metrics(self, mode)
        prefix = "prefixflow/" if training else "prefixflow/scoring_"
        metrics[prefix + "groups"].append(float(len(pairs)))
        metrics[prefix + "tokens_saved"].append(float(sum(p.shared for p in pairs)))
        metrics[prefix + ("phase_ab_s" if training else "s")].append(seconds)


def _call_reason(kwargs: dict) -> str | None:
    """Why one reward forward takes the plain path as a whole, if so."""
    # PEFT passes `return_dict=True` (the output is a ModelOutput either way); None means unset.
    extra = sorted(k for k, v in kwargs.items()
                   if k not in REWARD_KWARGS and v is not None and not (k == "return_dict" and v is True))
    if extra:
        return f"forward arguments {extra}"
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if ids is None or mask is None or ids.dim() != 2 or ids.shape[0] % 2:
        return "not a preference batch of chosen and rejected rows"
    return None
