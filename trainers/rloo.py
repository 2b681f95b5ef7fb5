"""PrefixFlowRLOOTrainer: TRL's RLOOTrainer whose actor update and scoring passes run each prompt as a prefix group.

RLOO samples groups exactly as GRPO does (`num_generations` completions per prompt, a leave-one-out baseline within
the group), so swapping `RLOOTrainer` for `PrefixFlowRLOOTrainer` gets the same machinery as
`PrefixFlowGRPOTrainer` (`PrefixFlowTrainerMixin`, `trainers/mixin.py`): the config, rewards, advantages, loss,
metrics and checkpoints stay TRL's; batches are shuffled and split by whole groups; a prompt runs forward once, its
completions as suffix waves, and its delayed backward once before the optimizer step. RLOOTrainer scores every
generation batch with the current policy before training it (the old log-probs of its importance ratio) and, with
`beta > 0`, with the reference model: both passes read each prompt's cache (`prefixflow_scoring`). Rows where
sharing would not pay (`prefixflow_min_speedup`) or cannot be exact train on the plain path, logged and counted in
`prefixflow/fallback_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig, RLOOTrainer

from .config import PrefixFlowArguments
from .mixin import PrefixFlowTrainerMixin


@dataclass
class PrefixFlowRLOOConfig(PrefixFlowArguments, RLOOConfig):
    """`RLOOConfig` plus PrefixFlow's knobs (`PrefixFlowArguments`); a plain `RLOOConfig` gets these defaults."""


class PrefixFlowRLOOTrainer(PrefixFlowTrainerMixin, RLOOTrainer):
    """`RLOOTrainer` with training-time KV caching of each group's shared prompt."""

    def _turn_completions(self, out) -> list[list[int]]:
        return out  # RLOOTrainer's single turn returns the completion ids alone

    def _turn_generations(self, prompt_ids, images, multimodal_fields) -> int:
        # RLOOTrainer's prompts arrive repeated per completion; its generation reads the count from the mode.
        return self.num_generations if self.model.training else self.num_generations_eval
