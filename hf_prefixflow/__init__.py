"""hf-prefixflow: train long-prefix GRPO groups with one prefix forward and one delayed prefix backward."""

from .config import PrefixFlowConfig
from .errors import PrefixFlowError
from .model import apply_prefixflow
from .planner import MemoryPlan, plan
from .scheduler import GroupSession, PackedOutput, PrefixGroup, prefix_group
from .waves import AutoWaves

__version__ = "0.1.0"


def __getattr__(name: str):
    # The trainers import TRL (the `trl` extra), which the core does not need: load them on first use.
    if name in ("PrefixFlowGRPOTrainer", "PrefixFlowGRPOConfig"):
        from .trainers import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoWaves",
    "GroupSession",
    "MemoryPlan",
    "PackedOutput",
    "PrefixFlowConfig",
    "PrefixFlowError",
    "PrefixFlowGRPOConfig",
    "PrefixFlowGRPOTrainer",
    "PrefixGroup",
    "apply_prefixflow",
    "plan",
    "prefix_group",
]
