"""PrefixFlowGRPOTrainer: TRL's GRPOTrainer whose actor update and scoring passes run each prompt as a prefix group.

Swap `GRPOTrainer` for `PrefixFlowGRPOTrainer`; the config, data, loss, metrics and checkpoints stay TRL's. What
changes: batches are shuffled and split by whole groups instead of rows, and the per-token log-probs come from
prefix groups: a prompt runs forward once (Phase A), its completions run as a suffix wave through TRL's own fused
LM head (Phase B); TRL's loss and backward follow untouched, and the delayed prefix backward (Phase C) runs once
the last microbatch that reads the prompt has been backpropagated, before the optimizer step. The machinery is
`PrefixFlowTrainerMixin` (`trainers/mixin.py`), shared with `PrefixFlowRLOOTrainer`; this module adds what is
GRPO's own: the config class and the shape of `GRPOTrainer._generate_single_turn`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig, GRPOTrainer

from .config import PrefixFlowArguments
from .mixin import PrefixFlowTrainerMixin


@dataclass
class PrefixFlowGRPOConfig(PrefixFlowArguments, GRPOConfig):
    """`GRPOConfig` plus PrefixFlow's knobs (`PrefixFlowArguments`); a plain `GRPOConfig` gets these defaults."""


class PrefixFlowGRPOTrainer(PrefixFlowTrainerMixin, GRPOTrainer):
    """`GRPOTrainer` with training-time KV caching of each group's shared prompt."""

    def _turn_completions(self, out) -> list[list[int]]:
        completion_ids, _ = out  # and generation's log-probs
        return completion_ids

    def _turn_generations(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False) -> int:
        return num_generations
