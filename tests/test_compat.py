"""Every private or version-dependent API of another library that PrefixFlow touches (`hf_prefixflow._compat`)
still exists with the signature PrefixFlow relies on: an upgrade that moves one fails here, by name."""

import copy
import inspect
from types import SimpleNamespace

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

    for name, expected in _compat.grpo_trainer_private().items():
        method = getattr(trl.GRPOTrainer, name, None)
        assert method is not None, f"trl.GRPOTrainer.{name} is gone"
        if expected is not None:
            assert _parameters(method) == expected, f"trl.GRPOTrainer.{name} changed its parameters"
    assert _compat.trl_supported(), f"trl {trl.__version__} is outside the supported {_compat.TRL_SUPPORTED}"


def test_rloo_trainer_private_methods():
    import trl

    for name, expected in _compat.RLOO_TRAINER_PRIVATE.items():
        method = getattr(trl.RLOOTrainer, name, None)
        assert method is not None, f"trl.RLOOTrainer.{name} is gone"
        if expected is not None:
            assert _parameters(method) == expected, f"trl.RLOOTrainer.{name} changed its parameters"


@pytest.mark.parametrize("trainer, state", [("GRPOTrainer", _compat.GROUP_TRAINER_STATE),
                                            ("RLOOTrainer", _compat.GROUP_TRAINER_STATE),
                                            ("DPOTrainer", _compat.PAIR_TRAINER_STATE),
                                            ("RewardTrainer", _compat.PAIR_TRAINER_STATE)])
def test_trl_trainer_state_the_accessors_read(trainer, state):
    """`trl_step`, `buffered_inputs`, `set_buffered_inputs` and `trl_metrics` read attributes TRL's trainers set in
    their `__init__`: each is still assigned there, and the accessors read and write that attribute."""
    import trl

    source = inspect.getsource(getattr(trl, trainer).__init__)
    for name in state:
        assert f"self.{name} = " in source, f"trl.{trainer} no longer sets {name} in __init__"
    fake = SimpleNamespace(_step=5, _buffered_inputs=None, _metrics={"train": {"loss": [1.0]}, "eval": {}})
    assert _compat.trl_step(fake) == 5 and _compat.buffered_inputs(fake) is None
    _compat.set_buffered_inputs(fake, [{"prompt_ids": None}])
    assert fake._buffered_inputs == [{"prompt_ids": None}]
    assert _compat.trl_metrics(fake, "train") is fake._metrics["train"]


def test_raising_the_recompile_limit():
    with torch._dynamo.config.patch(recompile_limit=8):
        assert _compat.raise_recompile_limit(64) == 8
        assert torch._dynamo.config.recompile_limit == 64
        assert _compat.raise_recompile_limit(32) is None
        assert torch._dynamo.config.recompile_limit == 64


def test_trl_scoring_the_waves_rely_on():
    """TRL 1.15 on adds the fused LM head to the trainer's models; before, `logits_lm_head` scores with TRL 1.14's
    own functions."""
    import trl.trainer.utils
    from packaging.version import Version

    fused = _compat.trl_fused_lm_head()
    assert (fused is not None) == (_compat.trl_version() >= Version("1.15")), "trl's add_fused_lm_head moved"
    if fused is None:
        for name, expected in _compat.TRL_1_14_SCORING.items():
            function = getattr(trl.trainer.utils, name, None)
            assert function is not None, f"trl.trainer.utils.{name} is gone"
            assert tuple(inspect.signature(function).parameters) == expected, f"trl.trainer.utils.{name} changed"


@pytest.mark.parametrize("shifted", [False, True], ids=["labels", "shift_labels"])
def test_logits_lm_head_keeps_trls_fused_head_contract(shifted):
    from packaging.version import Version

    model = build("llama", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    labels = ids.clone()
    labels[:, :4], labels[0, -2:] = -100, -100  # prompt and padding
    if shifted:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    expected_labels = labels if shifted else labels[:, 1:]
    logits = (plain if shifted else plain[:, :-1]) / 0.7
    mask = expected_labels != -100
    logps = logits.log_softmax(-1)
    expected = logps.gather(-1, expected_labels.clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(logps.exp() * logps).sum(-1) * mask

    fused = copy.deepcopy(model)
    _compat.logits_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    label_kwarg = {"shift_labels" if shifted else "labels": labels}
    out = model(input_ids=ids, fused_lm_head=True, **label_kwarg)
    torch.testing.assert_close(out.log_probs, expected)
    torch.testing.assert_close(out.entropy, entropy)
    assert torch.equal(out.label_mask, mask)
    torch.testing.assert_close(model(input_ids=ids).logits, plain)  # without fused_lm_head: the model's own forward
    if _compat.trl_version() >= Version("1.16"):  # 1.15's fused head is a Triton kernel only (no CPU path)
        _compat.trl_fused_lm_head()(fused, temperature=0.7, outputs=("log_probs", "entropy"))
        reference = fused(input_ids=ids, fused_lm_head=True, **label_kwarg)
        torch.testing.assert_close(out.log_probs, reference.log_probs)
        torch.testing.assert_close(out.entropy, reference.entropy)


def test_reading_dynamo_flags_raises_no_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.dynamo_inlines_modules() is True
