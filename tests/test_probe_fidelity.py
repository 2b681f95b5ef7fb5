"""No false refusals, no false acceptances: what `apply_prefixflow` refuses must be what it cannot train exactly, and
the probe's tiny copy must keep every structural feature of the user's config (RoPE kind, shape relations, layer
kinds, windows and chunks), so that a wave path that mishandles one of them is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

import hf_prefixflow
from hf_prefixflow import PrefixFlowError, architecture
from hf_prefixflow import model as model_module
from models import build

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- RoPE: only the kinds whose frequencies follow the sequence length are refused -----------------------------

def test_proportional_rope_is_accepted_and_gemma4_text_trains_exactly():
    """Gemma 4's full-attention layers use rope 'proportional', whose frequencies transformers computes without the
    sequence length: accepted, and a tiny Gemma 4 text model trains exactly (SGD steps, padded and packed waves)."""
    config = Gemma4TextConfig()
    assert "proportional" in str(config.rope_parameters)
    outcome, detail, _ = families.run_variant(Gemma4ForCausalLM, config)
    assert outcome == families.EXACT, detail


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "long_factor": [1.0, 1.5, 2.0, 2.5], "short_factor": [1.0, 1.0, 1.0, 1.0]}


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, LONGROPE],
                         ids=["dynamic", "longrope"])
def test_length_dependent_ropes_are_refused(rope):
    with pytest.raises(PrefixFlowError, match=rf"rope_type='{rope['rope_type']}', whose frequencies depend on the "
                                              r"longest position.*static RoPE"):
        hf_prefixflow.apply_prefixflow(build("llama", rope_parameters=rope))


@pytest.mark.parametrize("kind, refused", [("default", False), ("linear", False), ("llama3", False), ("yarn", False),
                                           ("proportional", False), ("ntk_alpha", False), ("dynamic", True),
                                           ("longrope", True)])
def test_the_rope_rule_follows_transformers_dynamic_update(kind, refused):
    """`dynamic_rope_update` recomputes the frequencies for a type naming "dynamic" and for "longrope"; no other."""
    assert bool(model_module.LENGTH_DEPENDENT_ROPE.search(kind)) is refused


def test_without_the_rope_check_dynamic_rope_trains_wrongly(monkeypatch):
    """The broken variant: with the refusal (and the probe) off, dynamic RoPE past its original length rotates the
    prefix alone (Phase A) differently from the prefix inside [P || S]: the side-by-side run catches it."""
    monkeypatch.setattr(model_module, "_check_rope", lambda model: None)
    monkeypatch.setattr(architecture, "probe", lambda model: architecture.ProbeResult())
    config = transformers.LlamaConfig(max_position_embeddings=8,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    outcome, detail, _ = families.run_variant(transformers.LlamaForCausalLM, config)
    assert outcome == families.WRONG, detail


# ---- the tiny copy keeps the config's shape relations ------------------------------------------------------------

def test_the_tiny_copy_keeps_head_size_relations():
    """MLA's head sizes shrink by one factor: a value head as wide as the query/key head (which decides sdpa's
    grouped-query path) stays so, and the query/key head stays the sum of its parts."""
    for v_head_dim in (128, 192):
        config = transformers.DeepseekV3Config(num_key_value_heads=16, v_head_dim=v_head_dim)
        tiny = architecture.tiny_config(config)
        assert tiny.qk_head_dim == tiny.qk_nope_head_dim + tiny.qk_rope_head_dim
        assert (tiny.v_head_dim == tiny.qk_head_dim) is (config.v_head_dim == config.qk_head_dim)
        assert tiny.qk_rope_head_dim == tiny.head_dim  # DeepSeek's rotary part is `head_dim` wide
        assert 1 < tiny.num_key_value_heads < tiny.num_attention_heads


def _deepseek(kv_heads: int, v_head_dim: int) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(num_key_value_heads=kv_heads, v_head_dim=v_head_dim)


def test_deepseek_v3_with_fewer_kv_heads_is_probed_like_the_model_runs():
    """DeepSeek-V3's K/V carry one head per query head whatever `num_key_value_heads` says; that number only sets
    the groups sdpa and eager repeat K/V by. With a value head as wide as the query/key head and no mask, sdpa takes
    its grouped-query path and the model runs: so does its tiny copy (the probe used to draw a narrower value head and
    fail to run it). Where the value head is narrower, the model itself fails under sdpa, and so does the copy."""
    runs = _deepseek(16, 192)
    model = architecture.build_tiny(transformers.DeepseekV3ForCausalLM, runs, "sdpa")
    model(input_ids=model.dummy_inputs["input_ids"][:1, :5] % 90 + 3)
    result = architecture._run_probe(transformers.DeepseekV3ForCausalLM, runs, "sdpa")
    assert result.skipped is None


# ---- the tiny copy keeps every layer kind; the probe's prompt reaches past windows and chunks --------------------

def _qwen2_late_windows() -> transformers.Qwen2Config:
    """Sliding windows from layer 28 of 32 on (`max_window_layers`): the first eight layers are all full."""
    return transformers.Qwen2Config(num_hidden_layers=32, use_sliding_window=True, max_window_layers=28,
                                    sliding_window=4096)


def test_the_tiny_copy_keeps_sliding_layers_that_come_late():
    tiny = architecture.tiny_config(_qwen2_late_windows())
    assert tiny.num_hidden_layers <= 8
    assert tiny.layer_types.count("sliding_attention") >= 1 and "full_attention" in tiny.layer_types
    # the first sliding layer, renumbered: layer_types and max_window_layers agree
    assert tiny.layer_types.index("sliding_attention") == tiny.max_window_layers
    model = architecture.build_tiny(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows[-1] == 4 and windows[0] is None


def _drop_windows(monkeypatch) -> None:
    """The broken variant: the waves' masks ignore the layer's sliding window."""
    from hf_prefixflow import attention

    original = attention._wave_mask
    monkeypatch.setattr(attention, "_wave_mask",
                        lambda wave, base, window, *args, **kwargs: original(wave, base, None, *args, **kwargs))


def test_the_probe_refuses_waves_that_drop_a_late_sliding_window(monkeypatch):
    """Qwen2 with its sliding layers past the eighth: the probe keeps one, so waves that drop the window are refused
    (a copy of the first eight layers alone, all full attention, accepted them)."""
    architecture._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")  # exact as it is
    _drop_windows(monkeypatch)
    with pytest.raises(PrefixFlowError, match="does not match full sequences"):
        architecture._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")
    # the gap this closes: a copy truncated to its first layers has no sliding layer and accepts the broken waves
    monkeypatch.setattr(architecture, "_kept_layers", lambda kinds, keep: list(range(keep)))
    assert architecture._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa").skipped is None


def test_the_probe_prompt_reaches_past_windows_and_chunks():
    """The probe's prompt and completions are longer than the windows and chunks of the tiny copy, in several
    waves."""
    assert architecture._PROBE_PREFIX > 2 * 4 and min(architecture._PROBE_SUFFIXES[:1]) > 4
    assert len(architecture._PROBE_WAVES) >= 2
    assert sorted(i for wave in architecture._PROBE_WAVES for i in wave) == list(range(len(architecture._PROBE_SUFFIXES)))
