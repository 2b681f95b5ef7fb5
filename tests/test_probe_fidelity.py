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
