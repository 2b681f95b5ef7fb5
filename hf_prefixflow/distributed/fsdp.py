"""FSDP2 rule: every backward of a window accumulates unreduced; the boundary's last prefix backward reduces them all.

FSDP2 (`fully_shard`) hooks a unit's forward: all-gather before it, free the gathered weights after it, and register
a pre-backward hook on its outputs that gathers them again. Three things break with the three-phase schedule:

- Phase A runs only the decoder. Its units would lazily initialise as FSDP roots of their own, and a grouped unit
  (Accelerate shards the final norm with the LM head) would be left half-run. So Phase A runs the FSDP root, whose
  LM head scores one token (`logits_to_keep=1`) that nothing reads.
- Phase C enters each layer at its prefix K/V, not at its output, so the unit's pre-backward hook would never fire
  for the last layer (whose freed weights it would then read) and only by autograd's ordering for the others. So
  Phase C also starts at the prefix output with a zero gradient (`TrainingKVCache.anchor`): every unit's output is
  reached first, as in any backward.
- FSDP reduce-scatters a unit in each of its post-backwards while gradient sync is on, and its root callback at the
  end of a backward runs the post-backward of every unit the backward did not reach. So sync is off for every
  backward but the boundary's last prefix backward (the trainer closes the other open groups just before it): that
  one reduces each unit once, everything the window accumulated in it. Reduce-scatter is linear and FSDP adds its
  output into the sharded gradient, so this is exact.

Every rank then runs the same collectives as long as it runs the same forwards and backwards: `check_same_schedule`
turns a mismatch into an error instead of a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from .collectives import all_gather, device_of
from ..errors import PrefixFlowError


def check_config(accelerator, model: torch.nn.Module) -> None:
    """Refuse FSDP1: its rule (flat parameters, reductions inside each backward) is neither written nor tested."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (plugin is not None and plugin.fsdp_version != 2) or any(
        isinstance(module, FullyShardedDataParallel) for module in model.modules()
    ):
        raise PrefixFlowError(
            "PrefixFlow supports FSDP2 (fully_shard), not FSDP1. Set `fsdp_version: 2` in the Accelerate config "
            "(examples/accelerate/fsdp2.yaml) or fsdp_config={'version': 2} in the training arguments."
        )


def local_gradients(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Accumulate every backward inside unreduced (FSDP2's `no_sync`); nothing for a model without FSDP2 units."""
    return _gradient_sync(model, False)


def reducing(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Inside `local_gradients`: the backward run here (the boundary's last prefix backward) reduces every unit."""
    return _gradient_sync(model, True)


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(not enabled)


def check_same_schedule(model: torch.nn.Module, what: str, counts: list[int]) -> None:
    """Every rank must run the same forwards and backwards (each gathers or reduces): compare `counts` across ranks."""
    if not (isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = torch.tensor(counts, dtype=torch.int64, device=device_of(model))
    gathered = all_gather(mine)
    if any(not torch.equal(other, mine) for other in gathered):
        per_rank = ", ".join(f"rank {r}: {t.tolist()}" for r, t in enumerate(gathered))
        raise PrefixFlowError(
            f"under FSDP2 every rank must run the same forwards and backwards, but {what} differ ({per_rank}); "
            "FSDP's all-gathers and reduce-scatters would mismatch. Causes: a prompt repeated within one "
            "process's batch (its rows merge into one group), or one-token prompts (they train on the plain path)."
        )
