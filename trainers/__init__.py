"""TRL trainers that run PrefixFlow: swap the class, keep the config, data, metrics and checkpoints."""

from .grpo import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer

__all__ = ["PrefixFlowGRPOConfig", "PrefixFlowGRPOTrainer"]
