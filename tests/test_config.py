"""`PrefixFlowConfig`: validated once, stored once, read through `config_of`; applying leaves shared configs alone."""

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_prefixflow
from hf_prefixflow import PrefixFlowConfig, PrefixFlowError
from hf_prefixflow.core.access import config_of, kv_grad_dtype
from hf_prefixflow.config import RECOMPUTE_SHARE
from models import build


@pytest.mark.parametrize("settings, match", [
    ({"prefix_recompute": 1.5}, r"prefix_recompute.*\[0, 1\]"),
    ({"prefix_recompute": "all"}, r"prefix_recompute"),
    ({"kv_grad_dtype": torch.int32}, r"floating-point"),
    ({"kv_grad_dtype": "int8"}, r"floating-point"),
])
def test_bad_settings_are_refused_at_construction(settings, match):
    with pytest.raises(PrefixFlowError, match=match):
        PrefixFlowConfig(**settings)


def test_defaults_resolve_in_one_place():
    assert PrefixFlowConfig().recompute_share == 0.0
    assert PrefixFlowConfig(offload=True).recompute_share == RECOMPUTE_SHARE
    assert PrefixFlowConfig(offload=True, prefix_recompute=0).recompute_share == 0.0
    assert PrefixFlowConfig(kv_grad_dtype="float32").kv_grad_dtype == torch.float32


def test_apply_stores_the_config_and_single_settings_override_it():
    model = build("llama")
    hf_prefixflow.apply_prefixflow(model, PrefixFlowConfig(offload=True, prefix_recompute=0.5))
    assert config_of(model) == PrefixFlowConfig(offload=True, prefix_recompute=0.5)
    hf_prefixflow.apply_prefixflow(model, kv_grad_dtype=torch.float64)  # None keeps the rest
    assert config_of(model) == PrefixFlowConfig(offload=True, prefix_recompute=0.5, kv_grad_dtype=torch.float64)
    assert kv_grad_dtype(model) == torch.float64
    hf_prefixflow.apply_prefixflow(model, PrefixFlowConfig())  # a config replaces the stored one
    assert config_of(model) == PrefixFlowConfig()


def test_a_model_built_from_the_same_config_object_stays_plain():
    first = build("llama")
    second = LlamaForCausalLM(first.config).to(torch.float64)
    hf_prefixflow.apply_prefixflow(first)
    assert first.config._attn_implementation == "prefixflow_sdpa"
    assert second.config._attn_implementation == "sdpa"
    assert all(getattr(m, "config", second.config) is second.config for m in second.modules())
    assert all(getattr(m, "config", first.config) is first.config for m in first.modules())
    with pytest.raises(PrefixFlowError, match="apply_prefixflow"):
        hf_prefixflow.prefix_group(second, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("settings, match", [
    ({"prefixflow_layout": "rows"}, r"prefixflow_layout must be 'padded' or 'packed'"),
    ({"prefixflow_offload_auto": True, "prefixflow_offload": True}, r"prefixflow_offload_auto picks"),
    ({"prefixflow_suffix_checkpointing": "sometimes"}, r"True, False or 'auto'"),
    ({"prefixflow_wave_size": "0"}, r"prefixflow_wave_size must be None, 'auto' or a positive integer"),
    ({"prefixflow_merge_microbatches": "0"}, r"prefixflow_merge_microbatches must be 'auto' or a positive integer"),
    ({"prefixflow_kv_grad_dtype": "int8"}, r"prefixflow_kv_grad_dtype must name a floating-point torch dtype"),
    ({"prefixflow_sp_size": 2, "prefixflow_layout": "packed"}, r"sequence parallelism runs padded waves"),
    ({"prefixflow_sp_size": 2, "prefixflow_wave_size": "2"}, r"one sharded wave"),
])
def test_bad_trainer_settings_are_refused_when_the_config_is_built(settings, match, tmp_path):
    """`PrefixFlowArguments.__post_init__` checks each prefixflow_* setting before any model is loaded, as TRL's
    configs check theirs; the kv_grad_dtype names are `PrefixFlowConfig`'s table."""
    from hf_prefixflow.trainers import PrefixFlowGRPOConfig
    from hf_prefixflow.trainers.config import kv_grad_dtype

    with pytest.raises(PrefixFlowError, match=match):
        PrefixFlowGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)
    assert kv_grad_dtype("bfloat16") is PrefixFlowConfig(kv_grad_dtype="bfloat16").kv_grad_dtype is torch.bfloat16
