"""TRL trainers that run PrefixFlow: swap the class, keep the config, data, metrics and checkpoints."""

# First: without accelerate, importing TRL fails with transformers' RuntimeError instead of an ImportError naming it.
import accelerate  # noqa: F401 - imported for its ImportError

from .dpo import PrefixFlowDPOConfig, PrefixFlowDPOTrainer
from .grpo import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
from .online_dpo import PrefixFlowOnlineDPOConfig, PrefixFlowOnlineDPOTrainer
from .reward import PrefixFlowRewardConfig, PrefixFlowRewardTrainer
from .rloo import PrefixFlowRLOOConfig, PrefixFlowRLOOTrainer

__all__ = ["PrefixFlowDPOConfig", "PrefixFlowDPOTrainer", "PrefixFlowGRPOConfig", "PrefixFlowGRPOTrainer",
           "PrefixFlowOnlineDPOConfig", "PrefixFlowOnlineDPOTrainer", "PrefixFlowRewardConfig",
           "PrefixFlowRewardTrainer", "PrefixFlowRLOOConfig", "PrefixFlowRLOOTrainer"]
