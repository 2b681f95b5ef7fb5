"""PrefixFlowOnlineDPOTrainer: TRL's OnlineDPOTrainer whose two completions per prompt share the prompt as a group.

Swap `OnlineDPOTrainer` (`trl.experimental.online_dpo`) for `PrefixFlowOnlineDPOTrainer`; the config, generation,
rewards, loss, metrics and checkpoints stay TRL's. `OnlineDPOTrainer.training_step` generates two completions per
prompt (rows `i` and `B + i` of a `[2B, ...]` batch share prompt `i`) and scores them with `_forward`, once with the
policy and once, without gradient, with the reference (a separate model or the PEFT adapter disabled). This trainer
answers `_forward` pair by pair: the prompt runs once (Phase A, at the stock path's positions, left padding
included), the two completions run as one padded wave (Phase B), and the per-token log-probs come back laid out as
the stock `[2B, C]`; TRL's loss and backward follow untouched, and the delayed prefix backward (Phase C) runs once
the microbatch's backward is done. The reference pass runs its prompts as no-grad groups.

Pairs whose prompt is short (`prefixflow_min_prefix_tokens`) or whose FLOP bound is below `prefixflow_min_speedup`,
and whole runs or calls the groups cannot make exact (image prompts, encoder-decoder models, ZeRO, FSDP, prompt-
learning PEFT, models `apply_prefixflow` refuses, ...), take the plain path: logged once per reason
and counted in `prefixflow/fallback_rows`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

from hf_prefixflow import _compat
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.planning.flops import PASS_FLOOR_TOKENS, ModelShape
from hf_prefixflow.core.layouts import right_padded
from hf_prefixflow.apply import apply_prefixflow
from hf_prefixflow.core.access import unwrap
from hf_prefixflow.core.scheduler import PrefixGroup

from .dpo import (SHARING_ENGINES, Pair, PairScorer, PairTrainerMixin, PrefixFlowDPOConfig, PrefixFlowDPOTrainer,
                  _inside_path)

logger = logging.getLogger(__name__)

_OPTIONS = ("prefixflow_min_prefix_tokens", "prefixflow_min_speedup", "prefixflow_scoring")


def _shared_field(name: str):
    """`PrefixFlowDPOConfig`'s definition of option `name` (its default and help), for another config class."""
    definition = PrefixFlowDPOConfig.__dataclass_fields__[name]
    return field(default=definition.default, metadata=dict(definition.metadata))


@dataclass
class PrefixFlowOnlineDPOConfig(OnlineDPOConfig):
    """`OnlineDPOConfig` plus `PrefixFlowDPOConfig`'s knobs; a plain `OnlineDPOConfig` gets the same defaults."""

    prefixflow_min_prefix_tokens: int = _shared_field("prefixflow_min_prefix_tokens")
    prefixflow_min_speedup: float = _shared_field("prefixflow_min_speedup")
    prefixflow_scoring: bool = _shared_field("prefixflow_scoring")


def left_padded_lengths(mask: torch.Tensor) -> list[int] | None:
    """Each row's real length when every row of `mask [R, W]` is left-padded (zeros, then ones); None otherwise."""
    mask = mask.detach().to("cpu", torch.long)
    lengths = mask.sum(1)
    expected = (torch.arange(mask.shape[1])[None] >= mask.shape[1] - lengths[:, None]).long()
    return lengths.tolist() if torch.equal(mask, expected) else None


class PrefixFlowOnlineDPOTrainer(PairTrainerMixin, OnlineDPOTrainer):
    """`OnlineDPOTrainer` whose two completions of a prompt read one prefix group (policy and reference passes);
    TRL's loss code runs unchanged on the per-token log-probs."""

    _plain_path = "plain Online DPO"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in _OPTIONS:
            setattr(self, name, getattr(self.args, name, PrefixFlowOnlineDPOConfig.__dataclass_fields__[name].default))
        self._fallbacks: Counter = Counter()
        # `pair_training_step` and the DPO metric helpers write here; `log` adds their means to TRL's logs.
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._reason = self._whole_run_reason()
        for model in (self.model, self.ref_model):
            if self._reason is None and model is not None:
                try:
                    apply_prefixflow(model)
                except PrefixFlowError as error:
                    self._reason = f"model refused by apply_prefixflow: {error}"
        shape = ModelShape.from_config(unwrap(self.model).config)
        floor = PASS_FLOOR_TOKENS if self.accelerator.device.type == "cuda" else 0
        self._scorer = PairScorer(shape, self.prefixflow_min_prefix_tokens, self.prefixflow_min_speedup, floor,
                                  self._count_fallback, self._log_groups)
        self._compile_layers(self.model, self.ref_model)
        # Reward models never run the pair path: compiled whole, as Accelerate's `prepare_model` does for the stock
        # trainer.
        if self._layerwise and self.reward_funcs is not None:
            self.reward_funcs = [torch.compile(f, backend=self.args.torch_compile_backend,
                                               mode=self.args.torch_compile_mode)
                                 if isinstance(f, PreTrainedModel) else f for f in self.reward_funcs]
        if self._reason is not None:
            logger.warning("PrefixFlow: every batch of this run takes the plain Online DPO path (%s).", self._reason)

    def _whole_run_reason(self) -> str | None:
        """Why no batch of this run can share its prompts exactly, if so."""
        if not _compat.online_dpo_forward_matches(OnlineDPOTrainer):
            return "OnlineDPOTrainer._forward has another signature in this TRL version"
        if self.accelerator.distributed_type not in SHARING_ENGINES:
            return f"{self.accelerator.distributed_type} (prompts are shared on one process or under DDP)"
        if getattr(self.args, "parallelism_config", None) is not None:
            return "parallelism_config (tensor, context or sequence parallelism)"
        if self.is_encoder_decoder:
            return "encoder-decoder model"
        if self.is_vision_model:
            return "image-text model"
        setting = self._setting_reason()
        if setting is not None:
            return setting
        if getattr(unwrap(self.model).config.get_text_config(), "output_router_logits", False):
            return "MoE router auxiliary loss"
        return None

    # -- the stock entry points ------------------------------------------------------------------------------

    def _generate(self, *args, **kwargs):
        # The compiled layers are for training: generation's cache, read by layer index, would make each layer a
        # graph of its own and use up dynamo's recompile limit (as in the group trainers' generation).
        eager = torch.compiler.set_stance("force_eager") if self._layerwise else contextlib.nullcontext()
        with eager:
            return super()._generate(*args, **kwargs)

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        """The completions' per-token log-probs `[2B, C]` as TRL's `_forward` computes them, each pair's prompt run
        once.

        Args:
            model: the policy (gradient enabled) or the reference (under `torch.no_grad()`), possibly wrapped.
            prompt_ids, prompt_mask: `[2B, W]` left-padded; rows `i` and `B + i` hold the same prompt.
            completion_ids, completion_mask: `[2B, C]` right-padded (`truncate_right`).
            vision_inputs: image tensors, or None.

        Returns:
            `[2B, C]` log-probs in the model's dtype; entry `t` scores `completion_ids[:, t]`.
        """
        reason = self._call_reason(prompt_ids, completion_ids, completion_mask, vision_inputs)
        if reason is None and not torch.is_grad_enabled() and not self.prefixflow_scoring:
            reason = "prefixflow_scoring=False"
        if reason is None:
            # TRL's left truncation to `max_length`, repeated here so the groups see the rows the stock forward does
            # (TRL's own call below finds nothing left to cut).
            cut = max(prompt_ids.size(1) + completion_ids.size(1) - self.max_length, 0)
            prompt_ids, prompt_mask = prompt_ids[:, cut:], prompt_mask[:, cut:]
            lengths = left_padded_lengths(prompt_mask)
            if lengths is None:
                reason = "prompt rows not left-padded"
        if reason is not None:
            self._count_fallback(reason, prompt_ids.shape[0])
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        shared, plain = self._choose(prompt_ids, lengths, completion_mask)
        if not shared:  # the stock forward, row for row
            self._count_fallback("prompt below prefixflow_min_prefix_tokens or prefixflow_min_speedup", len(plain))
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        rows: dict[int, torch.Tensor] = {}
        if plain:
            self._count_fallback("prompt below prefixflow_min_prefix_tokens or prefixflow_min_speedup", len(plain))
            index = torch.tensor(plain, device=prompt_ids.device)
            out = super()._forward(model, prompt_ids[index], prompt_mask[index], completion_ids[index],
                                   completion_mask[index], None)
            rows.update({row: out[k] for k, row in enumerate(plain)})
        rows.update(self._shared_pairs(model, shared, prompt_ids, completion_ids, completion_mask))
        return torch.stack([rows[r] for r in range(prompt_ids.shape[0])])

    # -- pairs -----------------------------------------------------------------------------------------------

    def _call_reason(self, prompt_ids, completion_ids, completion_mask, vision_inputs) -> str | None:
        """Why one `_forward` call takes the plain path as a whole, if so."""
        if self._reason is not None:
            return self._reason
        if vision_inputs is not None:
            return "image inputs"
        if prompt_ids.shape[0] % 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
            return "not two completions per prompt"
        if completion_ids.shape[1] == 0:
            return "empty completions"
        if not right_padded(completion_mask):
            return "completion rows not right-padded"
        return None

    def _choose(self, prompt_ids, lengths, completion_mask) -> tuple[list[Pair], list[int]]:
        """The pairs `(i, B + i)` worth sharing (one prompt, long enough, FLOP bound reached) and the plain rows."""
        half = prompt_ids.shape[0] // 2
        ids = prompt_ids.detach().cpu()
        real = completion_mask.detach().to("cpu", torch.long).sum(1).tolist()
        scorer = self._scorer
        shared, plain = [], []
        for i in range(half):
            j = half + i
            p = lengths[i]
            # The group caches the prompt less its last token, which the wave re-reads: at least one cached token.
            same = lengths[j] == p and torch.equal(ids[i], ids[j])
            if same and p >= max(scorer.min_prefix_tokens, 2) and scorer.shape.pays(
                    p, [max(real[i], 1), max(real[j], 1)], scorer.min_speedup, None, scorer.floor_tokens):
                shared.append(Pair((i, j), (p + real[i], p + real[j]), p))
            else:
                plain += [i, j]
        return shared, sorted(plain)

    def _shared_pairs(self, model, pairs: list[Pair], prompt_ids, completion_ids, completion_mask) -> dict:
        """Each shared pair's two rows of log-probs `[C]`: the prompt as a group, the completions as one wave."""
        scorer = self._scorer
        start = time.perf_counter()
        training = torch.is_grad_enabled()
        session, local = scorer._session_for(model, training)
        width = prompt_ids.shape[1]
        opened, out = [], {}
        try:
            for pair in pairs:
                i, j = pair.rows
                # At the stock path's positions: the prompt's first real token sits after the left padding.
                group = PrefixGroup(model, prompt_ids[i, width - pair.shared:], position_offset=width - pair.shared)
                group.concatenated_attention = scorer.concatenated_attention
                with _inside_path():
                    session.add(group)
                opened.append(group)
                index = torch.tensor([i, j], device=completion_ids.device)
                ids, mask = completion_ids[index], completion_mask[index]
                wave = group.padded_wave(ids, attention_mask=mask)
                # TRL's metrics read the log-probs after a completion's EOS too: those padding queries attend as
                # in the stock padded row (its real keys, not themselves).
                wave.padding_sees_row = not bool(mask.bool().all())
                logits = group.run_wave(wave).logits  # [2, C, V]
                logprobs = torch.take_along_dim(logits.log_softmax(dim=-1), ids.unsqueeze(-1), dim=2).squeeze(-1)
                out[i], out[j] = logprobs[0], logprobs[1]
        except BaseException as exc:
            if local:
                session.finish(exc)
            elif not training:
                session.close(opened)
            raise  # a training session's groups are freed by Phase C's error path
        if local:
            session.finish()
        elif not training:
            session.close(opened)  # reference groups inside the training session: nothing to backpropagate
        self._log_groups(pairs, training, time.perf_counter() - start)
        return out

    # -- metrics ---------------------------------------------------------------------------------------------

    _log_groups = PrefixFlowDPOTrainer._log_groups

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL logs its own statistics as means over the logging window; PrefixFlow's join them the same way.
        mode = "train" if "loss" in logs else "eval"
        metrics = self._metrics[mode]
        logs = {**logs, **{key: sum(values) / len(values) for key, values in metrics.items() if values}}
        metrics.clear()
        super().log(logs, start_time)


__all__ = ["PrefixFlowOnlineDPOConfig", "PrefixFlowOnlineDPOTrainer"]
