"""hf-prefixflow: train long-prefix GRPO groups with one prefix forward and one delayed prefix backward."""

from .errors import PrefixFlowError
from .model import apply_prefixflow
from .scheduler import GroupSession, GroupStats, PackedOutput, PrefixGroup, prefix_group

__version__ = "0.1.0"

__all__ = ["GroupSession", "GroupStats", "PackedOutput", "PrefixFlowError", "PrefixGroup", "apply_prefixflow", "prefix_group"]
