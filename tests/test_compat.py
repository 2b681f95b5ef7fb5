"""Every private or version-dependent API of another library that PrefixFlow touches (`hf_prefixflow._compat`)
still exists with the signature PrefixFlow relies on: an upgrade that moves one fails here, by name."""

import inspect

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from hf_prefixflow import _compat
from models import build


def _parameters(function) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)[1:]  # after self


@pytest.mark.parametrize("name", ["SDPA_FLASH_CPU", "SDPA_FLASH_CPU_BACKWARD", "SDPA_FLASH", "SDPA_FLASH_BACKWARD",
                                  "SDPA_CUDNN", "SDPA_CUDNN_BACKWARD"])
def test_fused_attention_kernels_exist(name):
    assert isinstance(getattr(_compat, name), torch._ops.OpOverloadPacket)


def test_the_cpu_kernel_returns_its_log_sum_exp():
    q = k = v = torch.randn(1, 2, 5, 8)
    out, lse = _compat.SDPA_FLASH_CPU(q, k, v, 0.0, True, scale=None)
    assert out.shape == q.shape and lse.shape == (1, 2, 5)


def test_torch_internals():
    assert callable(_compat.dynamo_disable)
    assert isinstance(_compat.dynamo_inlines_modules(), bool)
    assert isinstance(_compat.global_forward_hooks(), dict)
    model = build("llama")
    assert not _compat.is_compiled(model.model.layers[0])
    model.model.layers[0].compile()
    assert _compat.is_compiled(model.model.layers[0])
    flat = _compat._flatten_dense_tensors([torch.ones(2), torch.zeros(3)])
    assert [t.tolist() for t in _compat._unflatten_dense_tensors(flat, [torch.ones(2), torch.zeros(3)])] == \
        [[1, 1], [0, 0, 0]]


def test_pipeline_stage_overrides_match_torch():
    present = [name for name in _compat.PIPELINE_STAGE_OVERRIDES if hasattr(PipelineStage, name)]
    assert present, "torch's PipelineStage has none of the warm-up methods distributed.pipeline answers locally"
    for name in present:
        assert _parameters(getattr(PipelineStage, name)) == _compat.PIPELINE_STAGE_OVERRIDES[name], name


def test_transformers_checkpoint_function():
    model = build("llama")
    layer = model.model.layers[0]
    _compat.enable_checkpointing(model)
    assert _compat.checkpoint_function_kwargs(layer)["use_reentrant"] is False
    own = _compat.own_checkpoint_function(layer)
    assert own is not None and _compat.checkpoint_function(layer) is own
    _compat.set_checkpoint_function(layer, None)
    assert _compat.own_checkpoint_function(layer) is None
    _compat.set_checkpoint_function(layer, own)
    assert _compat.checkpoint_function(layer) is own


def test_accelerate_gradient_state():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    _compat.set_sync_gradients(accelerator, False)
    assert accelerator.sync_gradients is False
    _compat.set_sync_gradients(accelerator, True)
    assert accelerator.sync_gradients is True


def test_grpo_trainer_private_methods():
    import trl

    for name, expected in _compat.GRPO_TRAINER_PRIVATE.items():
        method = getattr(trl.GRPOTrainer, name, None)
        assert method is not None, f"trl.GRPOTrainer.{name} is gone"
        if expected is not None:
            assert _parameters(method) == expected, f"trl.GRPOTrainer.{name} changed its parameters"


def test_reading_dynamo_flags_raises_no_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.dynamo_inlines_modules() is True
