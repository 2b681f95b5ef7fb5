"""What the phases need to know about the engine wrapping a model (FSDP2, DeepSpeed ZeRO-3), detected without
importing any parallel rule: the rules in `distributed/` build on this module, never the other way round."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from ..errors import PrefixFlowError
from .access import decoder_of


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 (`fully_shard`) units inside `model`."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def partitions_weights(model: torch.nn.Module) -> bool:
    """Whether `model` is a DeepSpeed ZeRO-3 engine, which gathers a module's weights in hooks on its outputs."""
    stage3 = getattr(model, "zero_optimization_partition_weights", None)
    return bool(stage3 and stage3())


def gathers_weights_in_hooks(model: torch.nn.Module) -> bool:
    """FSDP2 and ZeRO-3 gather weights in hooks on module outputs: Phase C must also start at the prefix output."""
    return bool(fsdp_units(model)) or partitions_weights(model)


def prefix_module(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The module Phase A runs over the prefix and its extra keyword arguments: the decoder, or the FSDP2 root
    (whose units would otherwise initialise as roots of their own; its LM head scores one token nothing reads)."""
    if isinstance(model, FSDPModule):
        return model, {"logits_to_keep": 1}
    if fsdp_units(model):
        raise PrefixFlowError(
            f"{type(model).__name__} holds FSDP2 units but is not the FSDP root: open prefix groups on the module "
            "fully_shard was applied to last (the one the trainer forwards)."
        )
    return decoder_of(model), {}
