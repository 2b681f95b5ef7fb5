"""Hybrid models: recurrent layers' prefix states cached like K/V (`hf_prefixflow.core.states`), in float64 throughout.

Every family whose mixers read their state through transformers' cache API trains exactly: loss, every gradient and
the weights after SGD steps equal full-sequence training, over random prompt and completion lengths (one-token
completions included), padded waves of random sizes, with and without activation checkpointing, and with LoRA. The
broken variants (a state not carried, a state's gradient dropped, the cache dropped under checkpointing, a prompt
with pads) fail the same check; what cannot be exact is refused with its reason.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_prefixflow
from equivalence import (assert_same_gradients, full_sequence_backward, gradients, prefixflow_backward, random_group,
                         random_plan, train_side_by_side)
from hf_prefixflow import _compat
from hf_prefixflow.core import states, switch
from hf_prefixflow.models import probe, tiny as tiny_copy
from hf_prefixflow.errors import PrefixFlowError

# model type -> config options (layer kinds a real checkpoint has that the default config lacks)
HYBRIDS = {
    "qwen3_5_text": {},  # gated delta-net + attention (Qwen3.5)
    "qwen3_next": {},  # gated delta-net + attention, MoE
    "nemotron_h": {},  # Mamba2 + attention + MoE layers
    "falcon_h1": {},  # Mamba2 beside attention in every layer
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3},  # gated short conv
    "kimi_linear": {},  # KDA + MLA
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3},
    "zamba2": {},  # Mamba2 with a shared attention block
    "mamba2": {},  # Mamba2 alone; its causal LM calls the backbone without the model's kwargs (the decoder bridge)
    "minimax": {},  # lightning attention: a decayed K^T V state (MiniMaxCache's get_linear_cache), MoE
}
# Accepted families checked once more, for loss and gradients only (the sweep in benchmarks/families.py runs all).
MORE_HYBRIDS = {
    "qwen3_5_moe_text": {},
    "olmo_hybrid": {},
    "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 3},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3},
    "lfm3": {},
    "bailing_hybrid": {},
}


def tiny_hybrid(model_type: str, options: dict, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **options)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"  # Mamba2 has no attention to pick
    return tiny_copy.build_tiny(model_cls, config, attn, seed=seed)


@pytest.fixture(autouse=True)
def float64_inside(request):
    """The torch fallbacks cast to float32 inside (recurrent states are float32): keep float64 so 1e-5 means
    something (`tiny_copy.float64_throughout`), on one thread; tests marked `native_dtypes` keep the casts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    native = request.node.get_closest_marker("native_dtypes") is not None
    with contextlib.nullcontext() if native else tiny_copy.float64_throughout():
        yield
    torch.set_num_threads(threads)


def _checkpointed(model):
    _compat.enable_checkpointing(model, use_reentrant=False)
    tiny_copy.recompute_in_float64(model)
    return model


def _groups(seed: int, count: int):
    gen = torch.Generator().manual_seed(seed)
    # Prompts longer than the tiny scans' chunks (4) and convolution windows; completions of one token included.
    groups = [random_group(gen, prefix=(2, 13), suffix=(1, 6), n=(2, 4)) for _ in range(count)]
    plans = [random_plan(gen, len(g.suffixes), layouts=("padded",)) for g in groups]
    return groups, plans


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_hybrid_families_train_exactly(model_type):
    """Three SGD steps with momentum, waves of random sizes: loss, gradients and updates within 1e-5."""
    model = tiny_hybrid(model_type, HYBRIDS[model_type])
    assert states.has_states(hf_prefixflow.apply_prefixflow(copy.deepcopy(model)))
    groups, plans = _groups(seed=len(model_type), count=3)
    train_side_by_side(model, groups, plans)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "lfm2", "mamba2", "minimax"])
def test_hybrid_families_train_exactly_under_checkpointing(model_type):
    """transformers' layer checkpointing drops a layer's `cache`; the state view rides the pass marker instead,
    also through the recompute in each wave's backward and in Phase C."""
    model = _checkpointed(tiny_hybrid(model_type, HYBRIDS[model_type]))
    groups, plans = _groups(seed=7, count=2)
    train_side_by_side(model, groups, plans, prepare=lambda m: tiny_copy.recompute_in_float64(
        hf_prefixflow.apply_prefixflow(m)) or m)


@pytest.mark.parametrize("model_type", list(MORE_HYBRIDS))
def test_more_hybrid_families_match_gradients(model_type):
    model = tiny_hybrid(model_type, MORE_HYBRIDS[model_type])
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    group, plan = (x[0] for x in _groups(seed=3, count=1))
    full_sequence_backward(model, group)
    prefixflow_backward(candidate, group, plan)
    assert_same_gradients(gradients(candidate), gradients(model))


def test_hybrid_with_lora_trains_exactly():
    peft = pytest.importorskip("peft")
    model = tiny_hybrid("qwen3_5_text", {})
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"])
    model = peft.get_peft_model(model, lora).to(torch.float64)
    groups, plans = _groups(seed=11, count=2)
    train_side_by_side(model, groups, plans)


def test_one_token_waves_stay_off_the_in_place_kernels():
    """A wave of one-token completions runs the mixers on two tokens (one a trailing zero): the single-step
    kernels would write the state in place, and NemotronH's skips the time-step floor of its chunked scan."""
    model = tiny_hybrid("nemotron_h", {})
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    gen = torch.Generator().manual_seed(5)
    group = random_group(gen, prefix=(6, 9), suffix=(1, 1), n=(3, 3))
    full_sequence_backward(model, group)
    prefixflow_backward(candidate, group, [("padded", [0, 1]), ("padded", [2])])
    assert_same_gradients(gradients(candidate), gradients(model))


# ---- broken variants ------------------------------------------------------------------------------------------

def _side_by_side(model, candidate, seed=2):
    group, plan = (x[0] for x in _groups(seed=seed, count=1))
    full_sequence_backward(model, group)
    prefixflow_backward(candidate, group, plan)
    assert_same_gradients(gradients(candidate), gradients(model))


def test_broken_without_the_state_the_suffixes_are_wrong(monkeypatch):
    """Not carrying the state: the waves start every recurrent layer from zero."""
    previous = states.StateView._previous
    monkeypatch.setattr(states.StateView, "_previous", lambda self, *args: (previous(self, *args), None)[1])
    model = tiny_hybrid("qwen3_5_text", {})
    with pytest.raises(AssertionError):
        _side_by_side(model, hf_prefixflow.apply_prefixflow(copy.deepcopy(model)))


@pytest.mark.parametrize("kind", [states.CONV, states.RECURRENT])
def test_broken_a_dropped_state_gradient_is_caught(monkeypatch, kind):
    """One kind of state carried forward but its gradient never reaching Phase C."""
    capture = hf_prefixflow.core.kv_cache.TrainingKVCache.capture_state

    def detached(self, key, live):
        capture(self, key, live.detach() if key[1] == kind else live)

    monkeypatch.setattr(hf_prefixflow.core.kv_cache.TrainingKVCache, "capture_state", detached)
    model = tiny_hybrid("qwen3_5_text", {})
    with pytest.raises(AssertionError):
        _side_by_side(model, hf_prefixflow.apply_prefixflow(copy.deepcopy(model)))


def test_broken_checkpointing_that_drops_the_cache_is_caught(monkeypatch):
    """transformers' own behaviour under checkpointing: the mixer gets `cache=None`, the completions run without
    the prefix (what `StateView` riding the marker avoids). The probe runs first with the real hook, as an earlier
    test may have run it: under the broken hook it would refuse the model at `apply_prefixflow` instead."""
    model = _checkpointed(tiny_hybrid("lfm2", HYBRIDS["lfm2"]))
    hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    monkeypatch.setattr(states, "_before_mixer", lambda module, args, kwargs: (
        args, {k: v for k, v in kwargs.items() if k not in ("prefixflow_pass",)}))
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    tiny_copy.recompute_in_float64(candidate)
    with pytest.raises(PrefixFlowError, match="did not receive PrefixFlow.s pass marker in the prompt.s forward"):
        _side_by_side(model, candidate)


def test_broken_without_the_decoder_bridge_mamba2_is_refused(monkeypatch):
    """The broken variant: Mamba2ForCausalLM calls its backbone with a fixed argument list, so without the decoder
    bridge the waves' marker never reaches the mixers, which would start from a zero state; the wave's check that
    every captured state was read refuses it instead of training it wrong."""
    monkeypatch.setattr(switch, "bridge_decoder", lambda model: None)
    monkeypatch.setattr(probe, "_probed", {})  # a probe cached by an earlier test would skip the probe
    model = transformers.Mamba2ForCausalLM(tiny_copy.tiny_config(AutoConfig.for_model("mamba2")))
    with pytest.raises(PrefixFlowError, match=r"recurrent layers \[0, 1\] did not receive"):
        hf_prefixflow.apply_prefixflow(model)


def test_broken_minimax_without_its_linear_cache_is_caught(monkeypatch):
    """MiniMax's lightning attention handed no prefix state in the waves: it would run its block path from zero.
    The probe runs first with the real view (an earlier test may have run it)."""
    model = tiny_hybrid("minimax", HYBRIDS["minimax"])
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    monkeypatch.setattr(states.StateView, "get_linear_cache", lambda self, layer_idx: None)
    group, plan = (x[0] for x in _groups(seed=5, count=1))
    full_sequence_backward(model, group)
    with pytest.raises(PrefixFlowError, match="did not receive"):
        prefixflow_backward(candidate, group, plan)


def test_broken_a_padded_prompt_is_not_the_prompt():
    """A right-padded prompt: the pads decay the recurrent state and fill the convolution window, so the
    completions would train against another prompt. Groups take the real tokens only (TRL left-pads prompts and
    the trainer strips the pads); a prompt handed over with its pads gives wrong gradients."""
    model = tiny_hybrid("qwen3_5_text", {})
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    group, plan = (x[0] for x in _groups(seed=4, count=1))
    full_sequence_backward(model, group)
    padded = copy.copy(group)
    padded.prefix = torch.cat([group.prefix, torch.zeros(3, dtype=torch.long)])
    prefixflow_backward(candidate, padded, plan)
    with pytest.raises(AssertionError):
        assert_same_gradients(gradients(candidate), gradients(model))


# ---- what is refused --------------------------------------------------------------------------------------------

def test_packed_waves_are_refused_on_recurrent_models():
    model = hf_prefixflow.apply_prefixflow(tiny_hybrid("lfm2", HYBRIDS["lfm2"]))
    with hf_prefixflow.prefix_group(model, torch.arange(3, 9)) as group:
        with pytest.raises(PrefixFlowError, match="one completion's state into the next"):
            group.packed([torch.arange(3, 6)])
        group(torch.arange(3, 6)[None]).logits.sum().backward()


@pytest.mark.parametrize("model_type, words", [
    ("jamba", ["JambaMambaMixer", "Mamba1", "starts from a zero state"]),
    ("falcon_mamba", ["FalconMambaMixer", "starts from a zero state"]),
])
def test_mixers_without_a_continuable_state_are_refused(model_type, words):
    config = AutoConfig.for_model(model_type)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    attn = "eager" if model_type == "falcon_mamba" else "sdpa"
    model = model_cls(tiny_copy.tiny_config(config)).to(torch.float64)
    if attn == "eager":
        model.config._attn_implementation = "eager"
    with pytest.raises(PrefixFlowError) as error:
        hf_prefixflow.apply_prefixflow(model)
    for word in words:
        assert word in str(error.value)


def test_one_token_prompt_starts_from_zero_state():
    """P = 1: nothing is cached, every recurrent layer starts from zero, as the full sequence does."""
    model = tiny_hybrid("qwen3_5_text", {})
    candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
    gen = torch.Generator().manual_seed(9)
    group = random_group(gen, prefix=(1, 1), suffix=(2, 5), n=(2, 2))
    full_sequence_backward(model, group)
    prefixflow_backward(candidate, group, [("padded", [0, 1])])
    assert_same_gradients(gradients(candidate), gradients(model))


def test_the_probe_runs_the_pytorch_path_where_fused_kernels_are_installed(monkeypatch):
    """With flash-linear-attention installed, transformers binds its Triton kernels at import; the probe's float64
    CPU copy must run the PyTorch reference instead, or a GPU user's Qwen3.5 would be refused as unverifiable."""
    import sys
    import types

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    def triton_only(*args, **kwargs):
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    fake = types.ModuleType("fake_fused_package")
    fake.chunk_gated_delta_rule = triton_only
    monkeypatch.setitem(sys.modules, "fake_fused_package", fake)
    monkeypatch.setattr(probe, "_probed", {})  # a probe cached by an earlier test would skip the probe
    modeling = sys.modules[transformers.Qwen3_5ForCausalLM.__module__]
    reference = modeling.torch_chunk_gated_delta_rule
    fused = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fake_fused_package")(
        getattr(reference, "__wrapped__", reference))
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", fused)
    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=4)
    model = transformers.Qwen3_5ForCausalLM(tiny_copy.tiny_config(config))
    hf_prefixflow.apply_prefixflow(model)  # accepted: the probe ran the PyTorch path
    assert modeling.torch_chunk_gated_delta_rule is fused  # and the model keeps its fused kernel
    monkeypatch.setattr(probe, "_probed", {})  # probe again; the suite's cache is restored afterwards
    monkeypatch.setattr(_compat, "reference_kernels", lambda cls: contextlib.nullcontext())
    with pytest.raises(PrefixFlowError, match="could not be built or run"):
        hf_prefixflow.apply_prefixflow(transformers.Qwen3_5ForCausalLM(tiny_copy.tiny_config(config)))


@pytest.mark.native_dtypes
def test_float32_states_of_a_bf16_model_sum_their_gradients_in_float32():
    """A bf16 model's recurrent state is float32 (the scan's own dtype): its gradient sums across waves in float32
    and seeds Phase C in float32; the bf16 convolution window's sums in the weights' dtype."""
    model = hf_prefixflow.apply_prefixflow(tiny_hybrid("qwen3_5_text", {}).to(torch.bfloat16))
    with hf_prefixflow.prefix_group(model, torch.arange(3, 15)) as group:
        for rows in (torch.arange(3, 9).view(2, 3), torch.arange(9, 12).view(1, 3)):
            group(rows).logits.float().sum().backward()
        kinds = {key[1]: entry for key, entry in group.cache.states.items()}
        assert kinds[states.RECURRENT].live.dtype == kinds[states.RECURRENT].grad.dtype == torch.float32
        assert kinds[states.CONV].live.dtype == kinds[states.CONV].grad.dtype == torch.bfloat16
