"""TRL trainers that run PrefixFlow: swap the class, keep the config, data, metrics and checkpoints."""

from .dpo import PrefixFlowDPOConfig, PrefixFlowDPOTrainer
from .grpo import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer

__all__ = ["PrefixFlowDPOConfig", "PrefixFlowDPOTrainer", "PrefixFlowGRPOConfig", "PrefixFlowGRPOTrainer"]
