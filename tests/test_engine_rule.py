"""The engine rule the group trainers choose once (`trainers/engine_rule.py`): each launch's rule and its answers.

Each rule's training is checked against the stock trainer on two processes in tests/test_data_parallel.py, where a
ZeRO launch given the DDP rule is caught too."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from hf_prefixflow import PrefixFlowError
from hf_prefixflow.trainers import engine_rule
from hf_prefixflow.trainers.engine_rule import FSDP2, DataParallel, ZeRO

LAUNCHES = [(DistributedType.NO, DataParallel, False), (DistributedType.MULTI_CPU, DataParallel, True),
            (DistributedType.MULTI_GPU, DataParallel, True), (DistributedType.DEEPSPEED, ZeRO, False),
            (DistributedType.FSDP, FSDP2, False)]


def select(kind: DistributedType) -> engine_rule.EngineRule:
    return engine_rule.select(SimpleNamespace(distributed_type=kind), torch.nn.Linear(2, 2), "PrefixFlowGRPOTrainer")


@pytest.mark.parametrize("kind, rule, can_split", LAUNCHES)
def test_each_launch_gets_its_rule(kind, rule, can_split):
    chosen = select(kind)
    assert type(chosen) is rule and chosen.can_split == can_split


def test_a_model_sharded_at_load_time_gets_the_fsdp2_rule(monkeypatch):
    # Accelerate shards only in train(); FSDP2 units already in the model mean FSDP2 whatever the launch.
    monkeypatch.setattr(engine_rule, "fsdp_units", lambda model: [model])
    assert type(select(DistributedType.MULTI_GPU)) is FSDP2
    assert type(select(DistributedType.DEEPSPEED)) is ZeRO


@pytest.mark.parametrize("kind", [DistributedType.XLA, DistributedType.MEGATRON_LM])
def test_other_launches_are_refused(kind):
    with pytest.raises(PrefixFlowError, match="PrefixFlowGRPOTrainer supports one process, DDP, FSDP2 and DeepSpeed "
                                              f"ZeRO for now, not {kind}"):
        select(kind)


def test_what_each_rule_allows():
    """Whole weights and groups closed per microbatch (DDP) allow every feature; the sharding engines share every
    group (ZeRO while training), and only ZeRO keeps groups open to the boundary and sums gK/gV in fp32."""
    ddp, zero, fsdp2 = (select(kind) for kind in (DistributedType.MULTI_GPU, DistributedType.DEEPSPEED,
                                                  DistributedType.FSDP))
    features = ("merges_runs", "streams_kv", "stock_rule", "shares_images", "compiles", "rank_local_recompute")
    assert all(getattr(ddp, name) for name in features)
    assert not any(getattr(rule, name) for rule in (zero, fsdp2) for name in features)
    assert [r.every_group(True) for r in (ddp, zero, fsdp2)] == [False, True, True]
    assert [r.every_group(False) for r in (ddp, zero, fsdp2)] == [False, False, True]
    assert [r.closes_after_microbatch for r in (ddp, zero, fsdp2)] == [True, False, True]
    assert [r.kv_grad_dtype for r in (ddp, zero, fsdp2)] == [None, torch.float32, None]


@pytest.mark.parametrize("kind, effect", [(DistributedType.DEEPSPEED, "the engine would not step"),
                                          (DistributedType.FSDP, "FSDP2 would reduce no gradient")])
def test_a_boundary_without_a_group_is_refused_where_phase_c_reduces(kind, effect):
    select(DistributedType.MULTI_GPU).end_window(torch.nn.Linear(2, 2), None, "GRPOTrainer")  # nothing to close
    with pytest.raises(PrefixFlowError, match=f"no prefix group reached this accumulation boundary, so {effect} .*"
                                              "use GRPOTrainer otherwise"):
        select(kind).end_window(torch.nn.Linear(2, 2), None, "GRPOTrainer")


def test_zero_refuses_a_generation_inside_a_window_and_fp16():
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, mixed_precision="no")
    rule = ZeRO(accelerator)
    rule.check_config(None, SimpleNamespace(steps_per_generation=4, gradient_accumulation_steps=2))
    with pytest.raises(PrefixFlowError, match="multiple of gradient_accumulation_steps"):
        rule.check_config(None, SimpleNamespace(steps_per_generation=3, gradient_accumulation_steps=2))
    accelerator.mixed_precision = "fp16"
    with pytest.raises(PrefixFlowError, match="fp16 loss scaling"):
        rule.check_config(None, SimpleNamespace(steps_per_generation=4, gradient_accumulation_steps=2))
