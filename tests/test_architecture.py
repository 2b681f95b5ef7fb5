"""What `apply_prefixflow` accepts must train exactly: the marker bridge, refusals by structure, and the probe."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import hf_prefixflow
from equivalence import assert_same_gradients, full_sequence_backward, gradients, prefixflow_backward, random_group
from hf_prefixflow import PrefixFlowError, _compat
from hf_prefixflow.models import probe, tiny as tiny_copy


def tiny(model_type: str, **options) -> torch.nn.Module:
    class_name = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return tiny_copy.build_tiny(getattr(transformers, class_name), AutoConfig.for_model(model_type, **options),
                                   "sdpa")


def side_by_side(model: torch.nn.Module, seed: int, prepare=hf_prefixflow.apply_prefixflow) -> None:
    """Random groups, waves of random sizes: PrefixFlow's loss and gradients against full sequences."""
    gen = torch.Generator().manual_seed(seed)
    candidate = prepare(copy.deepcopy(model))
    for _ in range(3):
        group = random_group(gen, prefix=(4, 14), suffix=(1, 6), n=(2, 4))
        order = torch.randperm(len(group.suffixes), generator=gen).tolist()
        plan = [("padded", order[:1]), ("packed", order[1:])]
        model.zero_grad(set_to_none=True)
        candidate.zero_grad(set_to_none=True)
        full_sequence_backward(model, group)
        prefixflow_backward(candidate, group, plan)
        assert_same_gradients(gradients(candidate), gradients(model))


@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_layers_that_drop_kwargs_train_exactly(model_type, checkpointing):
    """StableLM's and Nemotron's decoder layers call attention with a fixed argument list: the marker takes the
    bridge, also in checkpoint recomputes."""
    model = tiny(model_type)
    if checkpointing:
        _compat.enable_checkpointing(model)
    side_by_side(model, seed=3)


def test_without_the_bridge_stablelm_is_wrong(monkeypatch):
    """The broken variant: no bridge (and no probe to notice) leaves StableLM's suffixes blind to the prefix."""
    monkeypatch.setattr(probe, "bridge", lambda model, result: None)
    monkeypatch.setattr(probe, "probe", lambda model: probe.ProbeResult())
    with pytest.raises((AssertionError, PrefixFlowError)):
        side_by_side(tiny("stablelm"), seed=3)


@pytest.mark.parametrize("model_type, options, names", [
    ("jamba", {}, ["JambaForCausalLM", "Mamba1", "zero state"]),  # hybrids whose state continues: tests/test_states.py
    ("recurrent_gemma", {}, ["RecurrentGemmaForCausalLM", "'linear_attention'", "cache API"]),
    ("falcon", {}, ["FalconForCausalLM", "AttentionInterface"]),
])
def test_token_mixers_and_foreign_attention_are_refused(model_type, options, names):
    with pytest.raises(PrefixFlowError) as error:
        hf_prefixflow.apply_prefixflow(tiny(model_type, **options))
    for name in names:
        assert name in str(error.value)


def test_a_mixer_by_class_name_is_refused_naming_the_module(monkeypatch):
    model = tiny("llama")
    mixer = type("ToyMambaMixer", (torch.nn.Identity,), {})
    model.model.layers[1].mixer = mixer()
    with pytest.raises(PrefixFlowError, match=r"model\.layers\.1\.mixer \(ToyMambaMixer\).*state-space"):
        hf_prefixflow.apply_prefixflow(model)


class _ShiftingMLP(modeling_llama.LlamaMLP):
    """An MLP that also mixes each token with the one before it: a token mixer no structural check can name."""

    def forward(self, x):
        shifted = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        return super().forward(x + 0.5 * shifted)


class _ShiftingLlama(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = _ShiftingMLP(config)


def test_the_probe_refuses_an_unnamed_token_mixer():
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(PrefixFlowError, match=r"_ShiftingLlama: a tiny float64 copy.*does not match full sequences"):
        hf_prefixflow.apply_prefixflow(_ShiftingLlama(config))


def test_the_probe_runs_once_per_architecture(monkeypatch):
    runs = []
    original = probe._run_probe
    monkeypatch.setattr(probe, "_run_probe", lambda *a: runs.append(a) or original(*a))
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=3e-6)
    for _ in range(2):
        hf_prefixflow.apply_prefixflow(LlamaForCausalLM(config))
    assert len(runs) == 1


def test_router_jitter_warns_naming_the_module():
    model = tiny("phimoe")
    model.model.layers[0].mlp.router_jitter_noise = 0.01
    hf_prefixflow.apply_prefixflow(model)
    model.train()
    with pytest.warns(UserWarning, match=r"layers\.0\.mlp \(PhimoeSparseMoeBlock\.router_jitter_noise=0\.01\)"):
        with hf_prefixflow.prefix_group(model, torch.tensor([5, 6, 7, 8])) as group:
            group(torch.tensor([[9, 10]])).logits.sum().backward()


def test_the_probe_leaves_the_random_stream_alone(monkeypatch):
    """Applying PrefixFlow must not change what the caller draws next (TRL samples rollouts from it)."""
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=4e-6)
    model = LlamaForCausalLM(config)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))  # torch.manual_seed's reach
    hf_prefixflow.apply_prefixflow(model)
    assert torch.equal(torch.rand(3), expected)
    assert not seeded, "the probe reseeded the CUDA generators (a GPU run's sampling)"


class _Unbuildable(LlamaForCausalLM):
    """A class whose tiny copy cannot be built (its constructor insists on the full hidden size)."""

    def __init__(self, config):
        if config.hidden_size < 64:
            raise ValueError("hidden_size must be at least 64")
        super().__init__(config)


def test_an_architecture_that_cannot_be_probed_is_refused_unless_allowed():
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(PrefixFlowError, match=r"could not verify _Unbuildable.*allow_unprobed=True"):
        hf_prefixflow.apply_prefixflow(_Unbuildable(config))
    model = hf_prefixflow.apply_prefixflow(_Unbuildable(config), hf_prefixflow.PrefixFlowConfig(allow_unprobed=True))
    assert hf_prefixflow.core.access.config_of(model).allow_unprobed
