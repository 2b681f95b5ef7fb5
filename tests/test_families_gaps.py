"""The families the sweep once left at "no tiny config", each now exact or refused for its real cause, each claim
tested with the broken variant it rules out: BLT (a tiny copy that keeps its nested widths' relations, then
refused), Cohere Compass and DBRX (defaults transformers itself cannot run; exact with their checkpoints' options),
Gemma 4's assistants (draft models fed another model's K/V, not standalone decoder-only LMs) and Gemma 3n's
image-audio-text model (a vision tower that needs timm)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (BltConfig, BltForCausalLM, CohereCompassForCausalLM, DbrxConfig, DbrxForCausalLM,
                          Gemma3nForCausalLM, Gemma3nTextConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM,
                          Gemma4ForCausalLM, Gemma4TextConfig, Gemma4UnifiedAssistantConfig,
                          Gemma4UnifiedAssistantForCausalLM)

import hf_prefixflow
from hf_prefixflow import PrefixFlowConfig, PrefixFlowError
from hf_prefixflow.models import structure, tiny as tiny_copy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _runs(model_cls: type, config) -> None:
    with tiny_copy.float64_throughout():
        model = tiny_copy.build_tiny(model_cls, config, "sdpa")
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))


# ---- BLT: the tiny copy keeps the widths its nested configs share; then it is refused for a real cause ---------

def test_the_tiny_blt_keeps_its_patch_widths_and_runs():
    """BLT's local encoder hands the global transformer `cross_attn_k` patch embeddings of its own width, read
    unprojected where their total is the global width (the default): the tiny copy keeps that ratio, and the local
    encoder and decoder read the tiny global width."""
    full = BltConfig()
    assert full.encoder_config.hidden_size * full.cross_attn_k == full.global_config.hidden_size
    tiny = tiny_copy.tiny_config(full)
    encoder, global_, decoder = tiny.encoder_config, tiny.global_config, tiny.decoder_config
    assert global_.hidden_size == encoder.hidden_size * tiny.cross_attn_k < full.global_config.hidden_size
    assert global_.encoder_cross_output_size is None  # no projection, as at full size
    assert encoder.hidden_size_global == decoder.hidden_size_global == global_.hidden_size
    assert global_.head_dim == global_.hidden_size // global_.num_attention_heads
    _runs(BltForCausalLM, full)


def test_a_blt_projecting_its_patch_embeddings_keeps_the_projection():
    """Where the encoder's patch embeddings are not the global width at full size, the global transformer projects
    them (`encoder_cross_output_size`): the tiny copy projects the tiny product."""
    full = BltConfig(global_config={"hidden_size": 1024, "num_attention_heads": 16})
    assert full.global_config.encoder_cross_output_size == 2048
    tiny = tiny_copy.tiny_config(full)
    assert tiny.global_config.encoder_cross_output_size == tiny.encoder_config.hidden_size * tiny.cross_attn_k
    _runs(BltForCausalLM, full)


def test_without_the_patch_widths_the_tiny_blt_cannot_run(monkeypatch):
    """The broken variant: towers shrunk to one width each give the global transformer patch embeddings twice its
    width, and the copy fails as the sweep once reported ("no tiny config")."""
    monkeypatch.setattr(tiny_copy, "_fit_patch_widths", lambda config: None)
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        _runs(BltForCausalLM, BltConfig())


def test_blt_is_refused_for_its_stacks_sharing_layer_indices():
    """Its local encoder, global transformer and local decoder (and the entropy patcher) each number their layers
    from 0, so PrefixFlow's one prefix K/V per layer index cannot hold them: refused by the probe, naming it."""
    outcome, detail, _ = families.run_variant(BltForCausalLM, BltConfig())
    assert outcome == families.REFUSED, detail
    assert "BltForCausalLM: the attention of layer index 0" in detail and "share an index" in detail
    with torch.device("meta"):
        model = BltForCausalLM(BltConfig())
    with pytest.raises(PrefixFlowError, match="ran more than once in one forward"):
        hf_prefixflow.apply_prefixflow(model)


# ---- Cohere Compass and DBRX: transformers cannot run their defaults; their checkpoints' options train exactly ----

@pytest.mark.parametrize("model_type, words", [
    ("cohere_compass_text", ["KeyError: 'full_attention'"]),
    ("dbrx", ["AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'"]),
    ("gemma4_assistant", ["hidden_size_per_layer_input must be 0, got 256"]),
])
def test_transformers_cannot_run_these_families_from_their_default_configs(model_type, words):
    """The claim each `CHECKPOINT_OPTIONS` entry makes: transformers itself fails on the default config, at tiny
    sizes, with this error. When a transformers release fixes one, this fails: drop the entry."""
    model_cls = getattr(transformers, transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[
        model_type])
    failure = families.default_config_failure(model_cls, model_cls.config_class)
    assert failure.startswith(f"transformers cannot build or run {model_cls.__name__}"), failure
    for word in words:
        assert word in failure


def test_dbrx_with_rope_theta_alone_still_fails_inside_transformers():
    """DBRX's second fault: `clip_qkv` None (its default) reaches `torch.clamp(min=None, max=None)`."""
    with pytest.raises(RuntimeError, match="torch.clamp: At least one of 'min' or 'max' must not be None"):
        _runs(DbrxForCausalLM, DbrxConfig(attn_config={"rope_theta": 500000.0}))


@pytest.mark.parametrize("model_cls, options", [
    (CohereCompassForCausalLM, families.CHECKPOINT_OPTIONS["cohere_compass_text"][0]),
    (CohereCompassForCausalLM, {**families.CHECKPOINT_OPTIONS["cohere_compass_text"][0], "num_hidden_layers": 2,
                                "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}),
    (CohereCompassForCausalLM, {"rope_parameters": {"full_attention": None,  # NoPE global layers, RoPE local ones
                                                    "sliding_attention": families.CHECKPOINT_OPTIONS[
                                                        "cohere_compass_text"][0]["rope_parameters"]["full_attention"]},
                                "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"],
                                "sliding_window": 4}),
    (DbrxForCausalLM, families.CHECKPOINT_OPTIONS["dbrx"][0]),
], ids=["cohere_compass", "cohere_compass-sliding", "cohere_compass-nope-full", "dbrx"])
def test_with_their_checkpoints_options_they_train_exactly(model_cls, options):
    """Accepted, then trained next to full sequences: loss, every gradient and each SGD update agree (padded and
    packed waves, float64)."""
    outcome, detail, _ = families.run_variant(model_cls, model_cls.config_class(**options))
    assert outcome == families.EXACT, detail


def test_the_tiny_dbrx_keeps_its_attention_configs_kv_heads():
    """DBRX's attention takes its key/value heads from `attn_config.kv_n_heads`: the tiny copy's follow its
    `num_key_value_heads`, and its experts and their width shrink with the towers."""
    tiny = tiny_copy.tiny_config(DbrxConfig(**families.CHECKPOINT_OPTIONS["dbrx"][0]))
    assert tiny.attn_config.kv_n_heads == tiny.num_key_value_heads < tiny.num_attention_heads
    assert tiny.ffn_config.hidden_size == tiny.hidden_size
    assert (tiny.ffn_config.moe_num_experts, tiny.ffn_config.moe_top_k, tiny.ffn_config.ffn_hidden_size) == (4, 2, 48)


def test_without_the_kv_heads_the_tiny_dbrx_cannot_run(monkeypatch):
    """The broken variant: 8 key/value heads left in `attn_config` beside 4 query heads."""
    monkeypatch.setattr(tiny_copy, "_fit_part_configs", lambda text: None)
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        _runs(DbrxForCausalLM, DbrxConfig(**families.CHECKPOINT_OPTIONS["dbrx"][0]))


# ---- Gemma 4's assistants: draft models fed another model's K/V ----------------------------------------------------

ASSISTANT_TEXT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
ASSISTANTS = [(Gemma4AssistantForCausalLM, Gemma4AssistantConfig, ASSISTANT_TEXT),
              (Gemma4UnifiedAssistantForCausalLM, Gemma4UnifiedAssistantConfig, {})]


@pytest.mark.parametrize("model_cls, config_cls, text", ASSISTANTS, ids=["gemma4", "gemma4_unified"])
def test_gemma4_assistants_are_refused_as_not_standalone(model_cls, config_cls, text):
    """Every layer of an assistant shares K/V (num_kv_shared_layers = num_hidden_layers) that its target model
    computed, and its forward cannot run from token ids: refused by structure, before any probe."""
    config = config_cls(text_config=text)
    with torch.device("meta"):
        model = model_cls(config)
    with pytest.raises(PrefixFlowError, match=rf"{model_cls.__name__} is not a standalone decoder-only causal LM: "
                                              r"every one of its \d+ layers attends to K/V that another model "
                                              r"computed .*shared_kv_states"):
        hf_prefixflow.apply_prefixflow(model)
    with pytest.raises(ValueError, match="inputs_embeds and shared_kv_states cannot be None"):
        _runs(model_cls, config)  # the claim: no forward from token ids


def test_without_the_standalone_check_an_assistant_is_accepted_unverified(monkeypatch):
    """The broken variant: without the check, the probe cannot run the assistant's tiny copy, so apply_prefixflow
    only asks for `allow_unprobed`, and with it accepts a model it cannot train."""
    monkeypatch.setattr(structure, "check_standalone", lambda model: None)
    config = Gemma4AssistantConfig(text_config=ASSISTANT_TEXT)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    with pytest.raises(PrefixFlowError, match="could not verify"):
        hf_prefixflow.apply_prefixflow(model)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    hf_prefixflow.apply_prefixflow(model, PrefixFlowConfig(allow_unprobed=True))  # a false acceptance


@pytest.mark.parametrize("model_cls, config", [(Gemma4ForCausalLM, Gemma4TextConfig(num_kv_shared_layers=20)),
                                               (Gemma3nForCausalLM, Gemma3nTextConfig())], ids=["gemma4", "gemma3n"])
def test_text_models_sharing_their_last_layers_kv_are_standalone(model_cls, config):
    """No false refusal: Gemma 3n's and Gemma 4's text models (the E2B and E4B sizes) share K/V only across their
    last layers, from their own earlier ones."""
    assert 0 < config.num_kv_shared_layers < config.num_hidden_layers
    assert structure.not_standalone(model_cls, config) is None


def test_the_sweep_classifies_the_assistants_as_not_decoder_only():
    for model_type in ("gemma4_assistant", "gemma4_unified_assistant"):
        row = families.run_family(model_type, families.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type],
                                  "causal-lm")
        assert row["outcome"] == families.NOT_DECODER, row
        assert "not a standalone decoder-only causal LM" in row["detail"]
        assert "apply_prefixflow on it: refused" in row["detail"]


# ---- Gemma 3n: its vision tower needs timm; its text decoder is its own row ----------------------------------------

def test_a_missing_library_is_named_not_taken_for_a_tiny_config_gap():
    exc = ImportError("TimmWrapperModel requires the timm library but it was not found in your environment. You can "
                      "install it with pip: `pip install timm`.")
    assert families.missing_library(exc) == "timm"
    assert families.missing_library(ImportError("cannot import name 'x'")) is None
    assert families.missing_library(RuntimeError(str(exc))) is None


@pytest.mark.skipif(transformers.utils.is_timm_available(), reason="timm is installed: the family builds")
def test_gemma3n_without_timm_names_timm_and_its_text_decoders_row():
    row = families.run_family("gemma3n", "Gemma3nForConditionalGeneration", "causal-lm")
    assert row["outcome"] == families.NO_LIBRARY, row
    assert "needs the timm library" in row["detail"]
    assert "Gemma3nForCausalLM, is swept as gemma3n_text" in row["detail"]
    _runs(Gemma3nForCausalLM, Gemma3nTextConfig())  # the text-only causal LM needs no timm (its row: exact)
