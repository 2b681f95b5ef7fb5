"""The PrefixFlow attention function: identical to the wrapped one outside a group; registration and checkpoints."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import hf_prefixflow
from equivalence import full_sequence_backward, gradients, prefixflow_backward, random_group, random_plan
from models import build


@pytest.mark.parametrize("family", ["llama", "llama_eager", "gemma2", "gpt_oss"])
def test_outside_a_group_it_is_the_wrapped_implementation(family):
    plain = build(family, dtype=torch.float32).train()  # fp64 eager masks overflow to NaN on left padding
    wrapped = hf_prefixflow.apply_prefixflow(copy.deepcopy(plain))
    assert wrapped.config._attn_implementation == "prefixflow_" + plain.config._attn_implementation
    ids = torch.randint(0, 97, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as TRL's prompts have
    mask[1, 8:] = 0
    for m in (plain, wrapped):
        m(input_ids=ids, attention_mask=mask).logits.square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_apply_is_idempotent_and_wraps_peft():
    model = build("llama")
    assert hf_prefixflow.apply_prefixflow(model) is model
    assert hf_prefixflow.apply_prefixflow(model).config._attn_implementation == "prefixflow_sdpa"
    peft_model = get_peft_model(build("qwen3"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert hf_prefixflow.apply_prefixflow(peft_model) is peft_model
    assert peft_model.get_base_model().config._attn_implementation == "prefixflow_sdpa"


def test_checkpoints_stay_plain_and_load_with_prefixflow(tmp_path):
    model = hf_prefixflow.apply_prefixflow(build("qwen2", dtype=torch.float32))
    model.save_pretrained(tmp_path)
    assert "prefixflow" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="prefixflow_sdpa")
    assert loaded.config._attn_implementation == "prefixflow_sdpa"
    ids = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def _relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def test_bf16_autocast_is_as_accurate_as_the_baseline():
    """Under bf16 autocast both paths round; PrefixFlow must sit as close to the fp32 gradient as the baseline."""
    gen = torch.Generator().manual_seed(4)
    model = build("llama", dtype=torch.float32).train()
    group = random_group(gen, prefix=(12, 24), n=(3, 5))
    full_sequence_backward(model, group)
    truth = gradients(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full_sequence_backward(model, group)
        baseline = gradients(model)
        model.zero_grad(set_to_none=True)
        prefixflow_backward(hf_prefixflow.apply_prefixflow(model), group, random_plan(gen, len(group.suffixes)))
    for name, grad in gradients(model).items():
        base_err, pf_err = _relative_error(baseline[name], truth[name]), _relative_error(grad, truth[name])
        assert pf_err <= 1.5 * base_err + 1e-4, f"{name}: bf16 PrefixFlow error {pf_err:.2e}, baseline {base_err:.2e}"


def test_eval_mode_trains_the_same():
    gen = torch.Generator().manual_seed(6)
    model = build("gemma2").eval()
    group = random_group(gen)
    full_sequence_backward(model, group)
    reference = gradients(model)
    model.zero_grad(set_to_none=True)
    prefixflow_backward(hf_prefixflow.apply_prefixflow(model), group, random_plan(gen, len(group.suffixes)))
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-5 * reference[name].abs().max().item())
