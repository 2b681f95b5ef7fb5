"""Phase A -> B -> C equals full-sequence training: loss, every gradient, weights after optimizer steps (fp64)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hf_prefixflow
from equivalence import (
    assert_rel_close,
    assert_same_gradients,
    full_sequence_backward,
    gradients,
    prefixflow_backward,
    random_group,
    random_plan,
    train_side_by_side,
)
from models import FAMILIES, ROPE_VARIANTS, build


def _setup(family, lora=False, checkpointing=False, **overrides):
    model = build(family, **overrides)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config).double()
    return model


def _steps(model, seed, steps=3, **group_kwargs):
    gen = torch.Generator().manual_seed(seed)
    groups = [random_group(gen, **group_kwargs) for _ in range(steps)]
    plans = [random_plan(gen, len(g.suffixes)) for g in groups]
    train_side_by_side(model, groups, plans)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_families_match_full_sequence(family, checkpointing):
    seed = 2 * sorted(FAMILIES).index(family) + checkpointing
    _steps(_setup(family, checkpointing=checkpointing), seed=seed)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_lora_matches_full_sequence(family, checkpointing):
    model = _setup(family, lora=True, checkpointing=checkpointing)
    _steps(model, seed=7 + checkpointing)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_static_rope_scalings(rope):
    _steps(_setup("llama", rope_parameters=ROPE_VARIANTS[rope]), seed=11, prefix=(20, 40))


@pytest.mark.parametrize("seed", range(4))
def test_any_wave_split_gives_the_same_gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    model = hf_prefixflow.apply_prefixflow(_setup("qwen2"))
    group = random_group(gen, n=(3, 8))
    results = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
        results.append((loss, gradients(model)))
    for loss, grads in results[1:]:
        assert_rel_close(loss, results[0][0], "loss")
        assert_same_gradients(grads, results[0][1])


def test_padded_batch_reference_agrees():
    """The batched, right-padded full-sequence path (what TRL runs) is the same reference."""
    gen = torch.Generator().manual_seed(3)
    model, group = _setup("llama"), random_group(gen, n=(3, 5))
    full_sequence_backward(model, group)
    one_by_one = gradients(model)
    model.zero_grad(set_to_none=True)
    hf_prefixflow.apply_prefixflow(model)
    full_sequence_backward(model, group, batched=True, gen=gen)
    assert_same_gradients(gradients(model), one_by_one)


def test_single_token_prefix():
    """P = 1 leaves nothing to cache: the waves alone carry the whole computation."""
    gen = torch.Generator().manual_seed(5)
    _steps(_setup("llama"), seed=5, prefix=(1, 1))


def test_scoring_under_no_grad_matches_full_sequence_logits():
    gen = torch.Generator().manual_seed(9)
    model = hf_prefixflow.apply_prefixflow(_setup("gemma3").eval())
    group = random_group(gen)
    p = len(group.prefix)
    with torch.no_grad(), hf_prefixflow.prefix_group(model, group.prefix) as g:
        out = g.packed(group.suffixes)
        for logits, suffix in zip(out.split(out.logits), group.suffixes):
            full = model(torch.cat([group.prefix, suffix])[None]).logits[0, p - 1 : p - 1 + len(suffix)]
            assert_rel_close(logits, full, "scoring logits")
