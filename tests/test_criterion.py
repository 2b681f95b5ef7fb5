"""The GPU checks' primary criterion (benchmarks/criterion.py) on the CPU: it passes a correct PrefixFlow run under
bf16 autocast and fails broken ones, judged against the fp64 full-sequence gradient."""

import copy
import math
import pathlib
import sys
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import criterion  # noqa: E402
import gpu_equivalence as equivalence  # noqa: E402

import hf_prefixflow  # noqa: E402


def test_judge_ratios_and_guards():
    gen = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(1000, generator=gen, dtype=torch.float64), "zero": torch.zeros(4, dtype=torch.float64)}
    noise = lambda: 1e-3 * torch.randn(1000, generator=gen, dtype=torch.float64)  # noqa: E731
    baseline = {"a": ref["a"] + noise(), "zero": torch.zeros(4)}
    good = criterion.judge({"a": ref["a"] + noise(), "zero": torch.zeros(4)}, baseline, ref)
    assert good["passed"] and 0.9 < good["ratios"]["a"] < 1.1 and good["ratios"]["zero"] == 0.0
    assert good["zero_reference"] == ["zero"]
    wrong = criterion.judge({"a": 1.01 * ref["a"], "zero": torch.zeros(4)}, baseline, ref)  # 1% off, noise 0.1%
    assert not wrong["passed"] and wrong["worst_param"] == "a" and wrong["worst_ratio"] > 5
    leak = criterion.judge({"a": ref["a"] + noise(), "zero": torch.full((4,), 1e-9)}, baseline, ref)
    assert not leak["passed"] and math.isinf(leak["ratios"]["zero"])
    missing = criterion.judge({"a": None, "zero": None}, baseline, ref)  # no gradient counts as zero
    assert not missing["passed"] and missing["worst_param"] == "a"
    unexpected = criterion.judge({"a": ref["a"], "zero": torch.zeros(4), "b": torch.ones(2)}, baseline, ref)
    assert not unexpected["passed"] and unexpected["unexpected_gradients"] == ["b"]
    assert criterion.verdict(True, broken=True) == "ERROR: broken variant passed"
    assert criterion.verdict(False, broken=True) == "broken variant: failed as required"


@pytest.fixture(scope="module")
def step_one():
    """One group's bf16-autocast baseline gradient and its fp64 full-sequence reference, on a one-layer model as
    wide as the GPU check's (narrow norm weights scatter the ratio between groups)."""
    equivalence.DEVICE = "cpu"
    equivalence.SHAPES["test"] = dict(vocab_size=64, hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=16, num_key_value_heads=4)
    args = types.SimpleNamespace(shape="test", head_dim=64)
    model = equivalence.build_model("sdpa", torch.float32, args)
    group = equivalence.random_groups(1, 32, 8, 3, 64)[0]
    reference = equivalence.reference_grads(equivalence.build_model("sdpa", torch.float64, args), model, group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        equivalence.full_sequence_step(model, group)
    return model, group, reference, equivalence.grads(model)


def prefixflow_grads(model, group, variant=None):
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    candidate.zero_grad(set_to_none=True)
    with criterion.variant(variant, 1) as used, torch.autocast("cpu", dtype=torch.bfloat16):
        equivalence.prefixflow_step(candidate, group, "padded", 2)
    assert variant is None or used["calls"]
    return equivalence.grads(candidate)


def test_correct_prefixflow_passes(step_one):
    model, group, reference, baseline = step_one
    result = criterion.judge(prefixflow_grads(model, group), baseline, reference)
    assert result["passed"], result
    assert 0.8 < result["median_ratio"] < 1.2


@pytest.mark.parametrize("variant", ["phase-c-skipped", "drop-layer-gk", "split-own-stats"])
def test_broken_prefixflow_fails(step_one, variant):
    model, group, reference, baseline = step_one
    result = criterion.judge(prefixflow_grads(model, group, variant), baseline, reference)
    assert not result["passed"] and result["worst_ratio"] > 10, result
