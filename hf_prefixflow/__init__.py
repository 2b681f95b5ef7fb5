"""hf-prefixflow: train long-prefix GRPO groups with one prefix forward and one delayed prefix backward."""

from .config import PrefixFlowConfig
from .errors import PrefixFlowError
from .apply import apply_prefixflow
from .planning.planner import MemoryPlan, plan
from .core.scheduler import GroupSession, PackedOutput, PrefixGroup, prefix_group
from .core.waves import AutoWaves

__version__ = "0.1.0"


# What the trainers import beyond the core: the `trl` extra (setup.py).
_TRL_EXTRA = ("trl", "accelerate", "peft", "datasets")


def _trainer(module: str, name: str):
    """`name` from `hf_prefixflow.trainers.<module>`; without the `trl` extra, an ImportError that names it."""
    import importlib

    try:
        return getattr(importlib.import_module(f".trainers.{module}", __name__), name)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in _TRL_EXTRA:
            raise
        raise ImportError(f"hf_prefixflow.{name} needs TRL and accelerate, the `trl` extra ({missing!r} is not "
                          'installed): pip install "hf-prefixflow[trl]" (from a clone: pip install ".[trl]")'
                          ) from error


_PAIR_TRAINERS = {"PrefixFlowDPOConfig": "dpo", "PrefixFlowDPOTrainer": "dpo", "PrefixFlowRewardConfig": "reward",
                  "PrefixFlowRewardTrainer": "reward", "PrefixFlowOnlineDPOConfig": "online_dpo",
                  "PrefixFlowOnlineDPOTrainer": "online_dpo"}


def __getattr__(name: str):
    # The trainers import TRL (the `trl` extra), which the core does not need: load them on first use.
    if name in ("PrefixFlowGRPOTrainer", "PrefixFlowGRPOConfig"):
        return _trainer("grpo", name)
    if name in ("PrefixFlowRLOOTrainer", "PrefixFlowRLOOConfig"):  # RLOO's groups, the same machinery
        return _trainer("rloo", name)
    if name in _PAIR_TRAINERS:  # pairs sharing a prefix (`trainers/dpo.py`, `reward.py`, `online_dpo.py`)
        return _trainer(_PAIR_TRAINERS[name], name)
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
    "PrefixFlowOnlineDPOConfig",
    "PrefixFlowOnlineDPOTrainer",
    "PrefixFlowRewardConfig",
    "PrefixFlowRewardTrainer",
    "PrefixFlowRLOOConfig",
    "PrefixFlowRLOOTrainer",
    "PrefixGroup",
    "apply_prefixflow",
    "plan",
    "prefix_group",
]
