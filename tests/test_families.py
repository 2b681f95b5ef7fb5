"""A representative subset of the family sweep (`benchmarks/families.py`): what apply_prefixflow accepts trains
exactly (the real equivalence check: random groups, padded and packed waves, SGD steps, float64 throughout), what
it cannot train exactly it refuses, naming the cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_prefixflow.core import states
from hf_prefixflow.models import probe, structure, tiny as tiny_copy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


LFM2_CONV = {"layer_types": ["full_attention", "conv"], "num_hidden_layers": 2}

# (model type, config options, outcome, words the detail must hold)
CASES = [
    ("llama", {}, families.EXACT, []),
    ("qwen3", {}, families.EXACT, []),
    ("stablelm", {}, families.EXACT, []),  # its layers drop the model's kwargs: the bridge carries the marker
    ("nemotron", {}, families.EXACT, []),
    ("gemma3_text", {}, families.EXACT, []),  # sliding and full layers, softcapping off
    ("olmo3", {}, families.EXACT, []),  # sliding windows on three layers of four
    ("gpt_oss", {}, families.EXACT, []),  # attention sinks, sliding windows, MoE
    ("deepseek_v3", {}, families.EXACT, []),  # MLA, a dense layer then an MoE one
    ("phimoe", {}, families.EXACT, []),
    ("phimoe", {"sliding_window": 4}, families.EXACT, []),  # the window only its masks carry, read from the config
    ("lfm2", LFM2_CONV, families.EXACT, []),  # recurrent states cached like K/V (`states`)
    ("falcon_h1", {}, families.EXACT, []),
    ("qwen3_next", {}, families.EXACT, []),
    ("jamba", {}, families.REFUSED, ["JambaMambaMixer", "zero state"]),  # Mamba1: its scan never continues
    ("minimax", {}, families.EXACT, []),  # lightning attention: its K^T V state through get_linear_cache
    ("falcon", {}, families.REFUSED, ["FalconForCausalLM", "AttentionInterface"]),
    ("xglm", {}, families.REFUSED, ["XGLMForCausalLM", "AttentionInterface"]),  # its float64 mask fill builds
    ("dory", {}, families.REFUSED, ["ran more than once in one forward"]),  # looped layers
]


def run(model_type: str, options: dict) -> tuple[str, str, str]:
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return families.run_variant(model_cls, CONFIG_MAPPING[model_type](**options))


@pytest.mark.parametrize("model_type, options, outcome, words", CASES,
                         ids=[f"{c[0]}{'-' + '-'.join(c[1]) if c[1] else ''}" for c in CASES])
def test_accepted_families_train_exactly_and_the_rest_are_refused(model_type, options, outcome, words):
    found, detail, _ = run(model_type, options)
    assert found == outcome, f"{model_type} {options}: {found}: {detail}"
    for word in words:
        assert word in detail


def test_without_the_checks_the_sweep_flags_lfm2_with_conv_layers(monkeypatch):
    """The broken variant: with the convolution's state not cached (nor the checks and the probe to notice),
    apply_prefixflow accepts LFM2's convolution layers and the sweep's exactness check catches the wrong
    gradients."""
    monkeypatch.setattr(states, "enable_states", lambda model: 0)
    monkeypatch.setattr(structure, "check_structure", lambda model: None)
    monkeypatch.setattr(probe, "probe", lambda model: probe.ProbeResult())
    found, detail, _ = run("lfm2", LFM2_CONV)
    assert found == families.WRONG, detail
    assert "grad" in detail or "loss" in detail


def test_the_committed_sweep_has_no_accepted_and_wrong_family():
    rows = json.loads((ROOT / "benchmarks" / "results" / "families" / "families.json").read_text())["families"]
    assert len(rows) >= len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert [r["model_type"] for r in rows if r["outcome"] in families.BUGS] == []


def test_broken_without_the_float64_fill_xglm_has_no_tiny_copy(monkeypatch):
    """The broken variant: where `float64_throughout` leaves `torch.full`'s default dtype alone, XGLM's mask fill of
    float64's minimum overflows float32 and the family reads as having no tiny copy instead of its real refusal."""
    monkeypatch.setattr(tiny_copy, "_beyond_float32", lambda value: False)
    found, detail, _ = run("xglm", {})
    assert found == families.NO_TINY and "overflow" in detail


def test_the_committed_sweep_built_every_family():
    """Issue #41: no family is left at "no tiny config"; a family transformers cannot run from its defaults is built
    with its checkpoints' options (`families.CHECKPOINT_OPTIONS`), and one needing a library the dev extra lacks
    says which."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "families" / "families.json").read_text())["families"]
    assert [r["model_type"] for r in rows if r["outcome"] == families.NO_TINY] == []
    assert {r["model_type"] for r in rows if r["outcome"] == families.NO_LIBRARY} <= {"gemma3n"}
