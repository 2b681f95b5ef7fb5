"""hf-prefixflow: train long-prefix GRPO groups with one prefix forward and one delayed prefix backward."""

from .config import PrefixFlowConfig
from .errors import PrefixFlowError
from .model import apply_prefixflow
from .planner import MemoryPlan, plan
from .scheduler import GroupSession, PackedOutput, PrefixGroup, prefix_group
from .waves import AutoWaves

__version__ = "0.1.0"


_PAIR_TRAINERS = {"PrefixFlowDPOConfig": "dpo", "PrefixFlowDPOTrainer": "dpo"}


def __getattr__(name: str):
    # The trainers import TRL (the `trl` extra), which the core does not need: load them on first use.
    if name in ("PrefixFlowGRPOTrainer", "PrefixFlowGRPOConfig"):
        from .trainers import grpo

        return getattr(grpo, name)
    if name in _PAIR_TRAINERS:  # preference pairs sharing their common prefix (`trainers/dpo.py`, `reward.py`)
        import importlib

        return getattr(importlib.import_module(f".trainers.{_PAIR_TRAINERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoWaves",
    "GroupSession",
    "MemoryPlan",
    "PackedOutput",
    "PrefixFlowConfig",
    "PrefixFlowDPOConfig",
    "PrefixFlowDPOTrainer",
    "PrefixFlowError",
    "PrefixFlowGRPOConfig",
    "PrefixFlowGRPOTrainer",
    "PrefixGroup",
    "apply_prefixflow",
    "plan",
    "prefix_group",
]
