"""Bad input gets a PrefixFlowError that names the fix, and leaves no state behind."""

import warnings
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_prefixflow import _compat
import hf_prefixflow
from hf_prefixflow import PrefixFlowError
from hf_prefixflow.core import scheduler
from models import ROPE_VARIANTS, build


@pytest.fixture
def model():
    return hf_prefixflow.apply_prefixflow(build("llama").train())


PREFIX = torch.arange(3, 12)
SUFFIX = torch.tensor([[5, 6, 7], [8, 9, 0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def assert_clean(model):
    """No group is registered on the model and a fresh group trains normally."""
    assert not scheduler._sessions
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        group(SUFFIX, attention_mask=MASK).logits.sum().backward()


def raises(match):
    return pytest.raises(PrefixFlowError, match=match)


def test_empty_prefix(model):
    with raises("non-empty"):
        hf_prefixflow.prefix_group(model, torch.tensor([], dtype=torch.long))
    assert_clean(model)


def test_batched_prefix(model):
    with raises("one prefix_group per distinct prompt"):
        hf_prefixflow.prefix_group(model, torch.stack([PREFIX, PREFIX]))
    assert_clean(model)


def test_float_prefix(model):
    with raises("integer tensor"):
        hf_prefixflow.prefix_group(model, PREFIX.float())


def test_model_without_apply():
    with raises("apply_prefixflow"):
        hf_prefixflow.prefix_group(build("llama"), PREFIX)


def test_nested_groups(model):
    with hf_prefixflow.prefix_group(model, PREFIX) as outer:
        with raises("cannot nest"):
            with hf_prefixflow.prefix_group(model, PREFIX):
                pass
        outer(SUFFIX).logits.sum().backward()
    assert_clean(model)


def test_group_used_after_exit(model):
    scope = hf_prefixflow.prefix_group(model, PREFIX)
    with scope as group:
        group(SUFFIX).logits.sum().backward()
    with raises("closed"):
        group(SUFFIX)
    with raises("entered once"):
        with scope:
            pass
    assert_clean(model)


def test_exception_inside_block_frees_state_and_skips_phase_c(model):
    with pytest.raises(RuntimeError, match="user error"):
        with hf_prefixflow.prefix_group(model, PREFIX) as group:
            group(SUFFIX).logits.sum().backward()
            raise RuntimeError("user error")
    assert not group.cache.layers
    # Phase C never ran: only suffix-side gradients exist, e.g. layer 0's k_proj saw no prefix backward.
    suffix_only = model.model.layers[0].self_attn.k_proj.weight.grad.clone()
    model.zero_grad()
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        group(SUFFIX).logits.sum().backward()
    assert not torch.allclose(model.model.layers[0].self_attn.k_proj.weight.grad, suffix_only)
    assert_clean(model)


def test_exit_without_backward(model):
    with raises("without any suffix backward"):
        with hf_prefixflow.prefix_group(model, PREFIX) as group:
            group(SUFFIX)
    assert_clean(model)


def test_no_grad_group_needs_no_backward(model):
    with torch.no_grad(), hf_prefixflow.prefix_group(model, PREFIX) as group:
        group(SUFFIX)
    assert_clean(model)


def test_device_mismatch(model):
    with raises("move it with"):
        hf_prefixflow.prefix_group(model, PREFIX.to("meta"))
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        with raises("move it with"):
            group(SUFFIX.to("meta"))
        group(SUFFIX).logits.sum().backward()
    assert_clean(model)


def test_dtype_mismatch_between_phase_a_and_a_wave():
    model = hf_prefixflow.apply_prefixflow(build("llama", dtype=torch.float32).train())
    with raises("same autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16), hf_prefixflow.prefix_group(model, PREFIX) as group:
            with torch.autocast("cpu", enabled=False):
                group(SUFFIX)
    assert_clean(model)


def test_reentrant_checkpointing():
    model = build("llama").train()
    _compat.enable_checkpointing(model, use_reentrant=True)
    hf_prefixflow.apply_prefixflow(model)
    with raises("use_reentrant"):
        hf_prefixflow.prefix_group(model, PREFIX).__enter__()
    assert not scheduler._sessions


def test_left_padded_suffixes(model):
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        with raises("right-padded"):
            group(SUFFIX, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))
        group(SUFFIX).logits.sum().backward()


def test_reserved_kwargs(model):
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        with raises("set by the prefix group"):
            group(SUFFIX, position_ids=torch.zeros_like(SUFFIX))
        group(SUFFIX).logits.sum().backward()


def test_attention_dropout_in_training():
    model = hf_prefixflow.apply_prefixflow(build("llama", attention_dropout=0.1).train())
    with raises("attention dropout"):
        hf_prefixflow.prefix_group(model, PREFIX).__enter__()
    assert not scheduler._sessions
    model.eval()  # dropout is off in eval: the same model then runs
    with torch.no_grad(), hf_prefixflow.prefix_group(model, PREFIX) as group:
        group(SUFFIX)


def test_dropout_shared_by_a_group_is_announced_once():
    """LoRA dropout trains (the expected gradient is the full-sequence one), but the user learns that the prompt's
    masks are shared by the group; without dropout, or in eval, nothing is said."""
    quiet = hf_prefixflow.apply_prefixflow(get_peft_model(build("llama"), LoraConfig(r=4, lora_dropout=0.0)).train())
    noisy = hf_prefixflow.apply_prefixflow(get_peft_model(build("llama"), LoraConfig(r=4, lora_dropout=0.1)).train())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dropout")
        for model in (quiet, noisy.eval(), quiet):
            with hf_prefixflow.prefix_group(model, PREFIX) as group:
                group(SUFFIX, attention_mask=MASK).logits.sum().backward()
    with pytest.warns(UserWarning, match=r"lora_dropout.*LoraConfig\(lora_dropout=0.0\)"):
        with hf_prefixflow.prefix_group(noisy.train(), PREFIX) as group:
            group(SUFFIX, attention_mask=MASK).logits.sum().backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dropout")
        with hf_prefixflow.prefix_group(noisy, PREFIX) as group:  # once per model
            group(SUFFIX, attention_mask=MASK).logits.sum().backward()


def test_output_attentions(model):
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        with raises("output_attentions"):
            group(SUFFIX, output_attentions=True)
        group(SUFFIX).logits.sum().backward()
    assert_clean(model)


def test_dynamic_rope_is_refused():
    with raises("static RoPE"):
        hf_prefixflow.apply_prefixflow(build("llama", rope_parameters=ROPE_VARIANTS["dynamic"]))


def test_unsupported_attention_implementation():
    model = build("llama")
    model.config._attn_implementation_internal = "flash_attention_2"
    with raises("not supported"):
        hf_prefixflow.apply_prefixflow(model)


def test_group_memory_is_released(model):
    with hf_prefixflow.prefix_group(model, PREFIX) as group:
        group(SUFFIX).logits.sum().backward()
        live, leaf = weakref.ref(group.cache.layers[0].key.live), weakref.ref(group.cache.layers[0].key.leaf)
    # no gc.collect(): the graph must go by reference counting, the moment the block closes
    assert not group.cache.layers and live() is None and leaf() is None


def test_keeping_suffix_activations_refuses_torch_checkpoint_wrappers(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    layers[0] = checkpoint_wrapper(layers[0])
    hf_prefixflow.apply_prefixflow(model, suffix_checkpointing=False)
    with raises("keep suffix_checkpointing=True"):
        with hf_prefixflow.prefix_group(model, PREFIX) as group:
            group(SUFFIX, attention_mask=MASK)
