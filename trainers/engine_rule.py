"""The data-parallel engine's rule in the group trainers: one object per engine, chosen once at construction (`select`).

`PrefixFlowTrainerMixin` asks the engine the same questions at every step: which of its features run under it, how
a window's backwards accumulate, whether all ranks must run the same forwards, and how the accumulation boundary's
Phase C closes. `EngineRule` answers them; `DataParallel` (one process or DDP), `ZeRO` (DeepSpeed) and `FSDP2` say
what differs, each through its rule in `hf_prefixflow/distributed/`.
"""

from __future__ import annotations

import abc
import contextlib

import torch
from accelerate.utils import DistributedType

from hf_prefixflow.core.engines import fsdp_units
from hf_prefixflow.core.scheduler import GroupSession
from hf_prefixflow.distributed import data_parallel, fsdp, zero
from hf_prefixflow.errors import PrefixFlowError

# The launches `DataParallel` serves; DDP's are those with several processes.
DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
DDP = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class EngineRule:
    """What the trainer asks of its data-parallel engine. These defaults hold where every process keeps whole
    weights and closes its own groups (`DataParallel`); `_BoundaryRule` turns them for the sharding engines."""

    can_split = False  # a group's rows may straddle processes (`distributed/placement.py`)
    merges_runs = True  # microbatches sharing a prompt may train as one run (`_run_loss`)
    streams_kv = True  # prefixflow_offload_kv, and prefixflow_offload_auto choosing it
    stock_rule = True  # the default memory rule's plan holds: whole weights, groups closed with their run
    shares_images = True  # image prompts may share their prefix
    compiles = True  # torch_compile per decoder layer
    # suffix checkpointing 'auto' may differ between ranks: their recompute runs no collective
    rank_local_recompute = True
    closes_after_microbatch = True  # groups the next microbatch does not read close before it
    kv_grad_dtype: torch.dtype | None = None  # gK/gV sums when prefixflow_kv_grad_dtype is unset: the weights'

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def every_group(self, training: bool) -> bool:
        """Whether every group with a prompt to share must be shared, whatever the FLOP model says."""
        return False

    def check_config(self, model: torch.nn.Module, args) -> None:
        """Refuse, at construction, a configuration the engine's rule does not cover."""

    def accumulating(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Around a training step and its Phase C: the backwards accumulate without the engine's reduction."""
        return contextlib.nullcontext()

    def microbatch(self) -> contextlib.AbstractContextManager:
        """Around TRL's training step (forward, loss, backward) only."""
        return contextlib.nullcontext()

    def check_same_schedule(self, model: torch.nn.Module, what: str, counts: list[int]) -> None:
        """Before forwards or backwards that every rank must run alike: refuse ranks whose `counts` differ."""

    def end_window(self, model: torch.nn.Module, session: GroupSession | None, stock: str) -> None:
        """Phase C of the groups still open at the accumulation boundary (`stock`: the trainer to use instead)."""
        if session is not None:
            session.finish()

    def reduce(self, model: torch.nn.Module) -> None:
        """After the boundary's Phase C: the reduction the engine left to the trainer."""


class DataParallel(EngineRule):
    """One process, or DDP: every backward of a window accumulates locally, and one all-reduce follows Phase C
    (`distributed/data_parallel.py`); under DDP a group may straddle processes."""

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.can_split = accelerator.distributed_type in DDP

    def accumulating(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return data_parallel.local_gradients(model)

    def reduce(self, model: torch.nn.Module) -> None:
        data_parallel.all_reduce_gradients(model)


class _BoundaryRule(EngineRule, abc.ABC):
    """Engines that shard the weights and reduce in the backward of the accumulation boundary: the boundary's Phase C
    is that backward, so one group at least must reach it. What is built and tested for whole weights and groups
    closed per microbatch stays off (run merging, K/V streaming, the default memory rule, image sharing, compiled
    layers), and so does suffix checkpointing 'auto': a recompute gathers weights (ZeRO-3, FSDP2), so every rank must
    recompute alike, while 'auto' decides from each rank's rows."""

    merges_runs = streams_kv = stock_rule = shares_images = compiles = rank_local_recompute = False
    no_group_effect = ""  # what the engine would fail to do at a boundary no group reached

    def end_window(self, model: torch.nn.Module, session: GroupSession | None, stock: str) -> None:
        self.check_same_schedule(model, "the prefix groups closing at the boundary",
                                 [len(session.groups) if session else 0])
        fed = 0
        if session is not None:
            try:
                fed = self._reducing_phase_c(model, session)
            finally:
                session.finish()
        if not fed:
            raise PrefixFlowError(
                f"no prefix group reached this accumulation boundary, so {self.no_group_effect} (the boundary's "
                "Phase C is its reducing backward). Every microbatch must hold shareable prompts (more than one "
                f"token); use {stock} otherwise."
            )

    @abc.abstractmethod
    def _reducing_phase_c(self, model: torch.nn.Module, session: GroupSession) -> int:
        """The boundary's Phase C as the engine's reducing backward; returns the tensors that backward fed."""


class ZeRO(_BoundaryRule):
    """DeepSpeed ZeRO: each microbatch's backward is a non-boundary micro-step, and Phase C the engine's boundary
    backward (`distributed/zero.py`). Groups stay open until the boundary."""

    closes_after_microbatch = False
    kv_grad_dtype = torch.float32  # DeepSpeed's grad_accum_dtype defaults to fp32
    no_group_effect = "the engine would not step"

    def every_group(self, training: bool) -> bool:
        return training  # a group at every boundary (and under ZeRO-3 the same forwards on every rank)

    def check_config(self, model: torch.nn.Module, args) -> None:
        zero.check_config(self.accelerator)
        if args.steps_per_generation % args.gradient_accumulation_steps:
            raise PrefixFlowError(
                "under DeepSpeed, prompts stay cached until the accumulation boundary, so a new generation must "
                "not start inside a window: make steps_per_generation a multiple of gradient_accumulation_steps."
            )

    def microbatch(self) -> contextlib.AbstractContextManager:
        return zero.inside_window(self.accelerator)

    def _reducing_phase_c(self, model: torch.nn.Module, session: GroupSession) -> int:
        return session.close(backward=zero.boundary_backward(self.accelerator))


class FSDP2(_BoundaryRule):
    """FSDP2 (`fully_shard`): every backward of a window accumulates unreduced, and the boundary's last prefix backward
    reduces each unit once (`distributed/fsdp.py`). Every rank runs the same forwards and backwards."""

    no_group_effect = "FSDP2 would reduce no gradient"

    def every_group(self, training: bool) -> bool:
        return True  # a group at every boundary, and the same forwards on every rank, scoring too

    def check_config(self, model: torch.nn.Module, args) -> None:
        fsdp.check_config(self.accelerator, model)

    def accumulating(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return fsdp.local_gradients(model)

    def check_same_schedule(self, model: torch.nn.Module, what: str, counts: list[int]) -> None:
        fsdp.check_same_schedule(model, what, counts)

    def _reducing_phase_c(self, model: torch.nn.Module, session: GroupSession) -> int:
        if not session.groups:
            return 0
        # FSDP2 reduces a unit in each post-backward: one prefix graph reaches each unit once, so close the others
        # unreduced first and let the last one reduce everything, one reduce-scatter per unit.
        *earlier, last = session.groups
        session.close(earlier)
        with fsdp.reducing(model):
            return session.close([last])


def select(accelerator, model: torch.nn.Module, trainer: str) -> EngineRule:
    """The rule of the engine `accelerator` launched (`trainer`: the trainer's class name, for the refusal)."""
    kind = accelerator.distributed_type
    if kind not in (*DATA_PARALLEL, DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise PrefixFlowError(f"{trainer} supports one process, DDP, FSDP2 and DeepSpeed ZeRO for now, not {kind}.")
    if kind == DistributedType.DEEPSPEED:
        return ZeRO(accelerator)
    # Accelerate shards the model only in train(); a model sharded at load time already holds FSDP2 units.
    if kind == DistributedType.FSDP or fsdp_units(model):
        return FSDP2(accelerator)
    return DataParallel(accelerator)
