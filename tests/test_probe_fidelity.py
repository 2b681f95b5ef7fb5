"""No false refusals, no false acceptances: what `apply_prefixflow` refuses must be what it cannot train exactly, and
the probe's tiny copy must keep every structural feature of the user's config (RoPE kind, shape relations, layer
kinds, windows and chunks), so that a wave path that mishandles one of them is refused."""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

import hf_prefixflow
from hf_prefixflow import PrefixFlowError
from hf_prefixflow.models import probe, tiny as tiny_copy
import hf_prefixflow.apply as model_module
from equivalence import assert_rel_close, assert_same_gradients, gradients, pad, random_group, token_loss
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
    monkeypatch.setattr(probe, "probe", lambda model: probe.ProbeResult())
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
        tiny = tiny_copy.tiny_config(config)
        assert tiny.qk_head_dim == tiny.qk_nope_head_dim + tiny.qk_rope_head_dim
        assert (tiny.v_head_dim == tiny.qk_head_dim) is (config.v_head_dim == config.qk_head_dim)
        assert tiny.qk_rope_head_dim == tiny.head_dim  # DeepSeek's rotary part is `head_dim` wide
        assert 1 < tiny.num_key_value_heads < tiny.num_attention_heads


def _deepseek(kv_heads: int, v_head_dim: int) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(num_key_value_heads=kv_heads, v_head_dim=v_head_dim)


def _deepseek_on_meta(attn: str) -> torch.nn.Module:
    """DeepSeek-V3 (three layers, its head sizes) with 16 key/value heads for 128 query heads, on the meta device."""
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(num_hidden_layers=3,
                                                                                 num_key_value_heads=16))
    model.set_attn_implementation(attn)
    return model


def test_deepseek_v3_with_fewer_kv_heads_is_accepted_under_flex_attention(monkeypatch):
    """Under flex_attention (K/V heads grouped by the tensors' shapes) DeepSeek-V3 runs with any
    `num_key_value_heads`; the probe's sdpa stand-in groups by shapes as flex does and verifies it. Under sdpa and
    eager, which repeat K/V by `num_key_value_heads`, the model itself fails, and the refusal names the attention.
    The broken variant: an sdpa stand-in that repeats K/V cannot run the copy, and a flex model was refused."""
    monkeypatch.setattr(probe, "_probed", {})
    hf_prefixflow.apply_prefixflow(_deepseek_on_meta("flex_attention"))
    with pytest.raises(PrefixFlowError, match=r"could not be built or run with attention 'sdpa'.*size of tensor"):
        hf_prefixflow.apply_prefixflow(_deepseek_on_meta("sdpa"))
    monkeypatch.setattr(probe, "_probed", {})
    monkeypatch.setattr(probe.compat, "sdpa_grouped_by_shapes", contextlib.nullcontext)
    with pytest.raises(PrefixFlowError, match="could not verify DeepseekV3ForCausalLM"):
        hf_prefixflow.apply_prefixflow(_deepseek_on_meta("flex_attention"))


def test_deepseek_v3_with_fewer_kv_heads_is_probed_like_the_model_runs():
    """DeepSeek-V3's K/V carry one head per query head whatever `num_key_value_heads` says; that number only sets
    the groups sdpa and eager repeat K/V by. With a value head as wide as the query/key head and no mask, sdpa takes
    its grouped-query path and the model runs: so does its tiny copy (the probe used to draw a narrower value head and
    fail to run it). Where the value head is narrower, the model itself fails under sdpa, and so does the copy."""
    runs = _deepseek(16, 192)
    model = tiny_copy.build_tiny(transformers.DeepseekV3ForCausalLM, runs, "sdpa")
    model(input_ids=model.dummy_inputs["input_ids"][:1, :5] % 90 + 3)
    result = probe._run_probe(transformers.DeepseekV3ForCausalLM, runs, "sdpa")
    assert result.skipped is None


# ---- the tiny copy keeps every layer kind; the probe's prompt reaches past windows and chunks --------------------

def _qwen2_late_windows() -> transformers.Qwen2Config:
    """Sliding windows from layer 28 of 32 on (`max_window_layers`): the first eight layers are all full."""
    return transformers.Qwen2Config(num_hidden_layers=32, use_sliding_window=True, max_window_layers=28,
                                    sliding_window=4096)


def test_the_tiny_copy_keeps_sliding_layers_that_come_late():
    tiny = tiny_copy.tiny_config(_qwen2_late_windows())
    assert tiny.num_hidden_layers <= 8
    assert tiny.layer_types.count("sliding_attention") >= 1 and "full_attention" in tiny.layer_types
    # the first sliding layer, renumbered: layer_types and max_window_layers agree
    assert tiny.layer_types.index("sliding_attention") == tiny.max_window_layers
    model = tiny_copy.build_tiny(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows[-1] == 4 and windows[0] is None


def _drop_windows(monkeypatch) -> None:
    """The broken variant: the waves' masks ignore the layer's sliding window."""
    from hf_prefixflow.core import attention

    original = attention._wave_mask
    monkeypatch.setattr(attention, "_wave_mask",
                        lambda wave, base, window, *args, **kwargs: original(wave, base, None, *args, **kwargs))


def test_the_probe_refuses_waves_that_drop_a_late_sliding_window(monkeypatch):
    """Qwen2 with its sliding layers past the eighth: the probe keeps one, so waves that drop the window are refused
    (a copy of the first eight layers alone, all full attention, accepted them)."""
    probe._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")  # exact as it is
    _drop_windows(monkeypatch)
    with pytest.raises(PrefixFlowError, match="does not match full sequences"):
        probe._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa")
    # the gap this closes: a copy truncated to its first layers has no sliding layer and accepts the broken waves
    monkeypatch.setattr(tiny_copy, "_kept_layers", lambda kinds, keep: list(range(keep)))
    assert probe._run_probe(transformers.Qwen2ForCausalLM, _qwen2_late_windows(), "sdpa").skipped is None


def test_the_probe_prompt_reaches_past_windows_and_chunks():
    """The probe's prompt and completions are longer than the windows and chunks of the tiny copy, in several
    waves."""
    assert probe._PROBE_PREFIX > 2 * 4 and min(probe._PROBE_SUFFIXES[:1]) > 4
    assert len(probe._PROBE_WAVES) >= 2
    rows = sorted(i for wave in probe._PROBE_WAVES for i in wave)
    assert rows == list(range(len(probe._PROBE_SUFFIXES)))


# ---- Llama 4: chunked attention and the attention temperature ----------------------------------------------------

def test_llama4_text_trains_exactly_with_chunks_and_its_temperature():
    """Llama 4's chunked layers (a suffix token sees the prefix keys of its own chunk only) and its NoPE layer's
    query temperature, both at tiny scales (chunks and temperature steps of 4 positions): exact, SGD steps over padded
    and packed waves."""
    config = transformers.Llama4TextConfig()
    tiny = tiny_copy.tiny_config(config)
    assert "chunked_attention" in tiny.layer_types and "full_attention" in tiny.layer_types
    assert tiny.attention_chunk_size == 4 and tiny.floor_scale == 4 and tiny.attn_temperature_tuning
    outcome, detail, _ = families.run_variant(transformers.Llama4ForCausalLM, config)
    assert outcome == families.EXACT, detail


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_probe_refuses_waves_that_ignore_the_chunks(monkeypatch, attn):
    """The broken variant: waves whose masks ignore the chunk (suffix tokens see the whole prefix) are refused."""
    from hf_prefixflow.core import attention

    assert probe._run_probe(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(), attn).skipped \
        is None
    original = attention._wave_mask
    monkeypatch.setattr(attention, "_wave_mask", lambda wave, base, window, query, kv_length, chunk=None:
                        original(wave, base, window, query, kv_length))
    with pytest.raises(PrefixFlowError, match="does not match full sequences"):
        probe._run_probe(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(), attn)


def test_the_probe_refuses_waves_that_keep_the_temperature_at_the_wave_index(monkeypatch):
    """The broken variant: a wave's NoPE queries keep the temperature of their index in the wave (what the module
    computes without an inference cache) instead of their position: refused, chunks handled."""
    from hf_prefixflow.core import attention

    monkeypatch.setattr(attention, "index_scaled_query", lambda module, query, positions: query)
    with pytest.raises(PrefixFlowError, match="does not match full sequences"):
        probe._run_probe(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(), "sdpa")


def test_chunk_masks_match_transformers_chunked_mask():
    """`Wave.visible` with a chunk against transformers' own chunked causal mask function on the full left-padded
    sequence: the same keys, padded and packed waves, with a left-padding offset."""
    from transformers.masking_utils import chunked_causal_mask_function

    from hf_prefixflow.core import attention, layouts

    chunk, offset, cached = 3, 2, 7
    last = torch.tensor([[5]])
    full = chunked_causal_mask_function(chunk, torch.tensor([offset]))
    zero = torch.tensor(0)

    def sees(q_position: int, k_position: int) -> bool:  # positions count the left padding, as a padded row's index
        return bool(full(zero, zero, torch.tensor(q_position), torch.tensor(k_position)))

    suffixes = [torch.arange(3, 3 + n) for n in (5, 2, 4)]
    waves = [layouts.padded_wave(last, torch.stack([torch.arange(3, 8), torch.arange(3, 8)]),
                                 torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), cached, offset),
             layouts.packed_wave(last, suffixes, cached, offset)]
    for wave in waves:
        visible = wave.visible(None, chunk)[:, 0]
        key_segments, key_positions = wave.key_geometry()
        for b in range(visible.shape[0]):
            for q in range(visible.shape[1]):
                if wave.segment_ids[b, q] < 0:
                    continue  # padding queries: their outputs are never read
                for k in range(visible.shape[2]):
                    segment = key_segments[b, k]
                    related = segment == layouts.PREFIX or segment == wave.segment_ids[b, q]
                    expected = bool(related) and sees(int(wave.position_ids[b, q]), int(key_positions[b, k]))
                    assert bool(visible[b, q, k]) is expected, (b, q, k)
        # flex_attention's block mask (its backward does not run on a CPU) decides each pair as the dense mask does
        query = torch.zeros(visible.shape[0], 1, visible.shape[1], 8)
        mask_mod = attention._block_mask(wave, None, query, visible.shape[2], chunk).mask_mod
        for b, q, k in itertools.product(*(range(n) for n in visible.shape)):
            assert bool(mask_mod(*(torch.tensor(i) for i in (b, 0, q, k)))) is bool(visible[b, q, k]), (b, q, k)


def _left_padded_llama4(gen: torch.Generator) -> tuple[torch.nn.Module, list, int]:
    # layer 0 without RoPE (temperature-tuned, full attention), layer 1 chunked: the NoPE layer's prompt queries feed
    # the next layer's prompt K/V, so Phase A's temperature shows in the gradients
    config = transformers.Llama4TextConfig(num_hidden_layers=2, no_rope_layers=[0, 1])
    model = tiny_copy.build_tiny(transformers.Llama4ForCausalLM, config, "sdpa").train()
    assert model.config.layer_types == ["full_attention", "chunked_attention"]
    groups = [random_group(gen, prefix=(6, 13), suffix=(2, 7), n=(2, 3)) for _ in range(2)]
    return model, groups, max(len(g.prefix) for g in groups) + 3


def _left_padded_loss(model, groups, width: int, gen: torch.Generator) -> float:
    """What TRL runs: prompts left-padded to a common width (positions, chunks and temperatures count from the row's
    start), completions right-padded, one batch."""
    rows, masks, spans = [], [], []
    for group in groups:
        left = width - len(group.prefix)
        for suffix, weights in zip(group.suffixes, group.weights):
            rows.append(torch.cat([torch.randint(0, 97, (left,), generator=gen), group.prefix, suffix]))
            masks.append(torch.cat([torch.zeros(left, dtype=torch.long), torch.ones(len(rows[-1]) - left,
                                                                                      dtype=torch.long)]))
            spans.append((width - 1, suffix, weights))
    ids, real = pad(rows, gen)
    mask = pad(masks, gen)[0] * real
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = sum(token_loss(logits[r, start:start + len(s)], s, w) for r, (start, s, w) in enumerate(spans))
    loss.backward()
    return loss.item()


def _prefixflow_loss(model, groups, width: int, gen: torch.Generator) -> float:
    total = 0.0
    with hf_prefixflow.GroupSession(model) as session:
        opened = [session.open(g.prefix, position_offset=width - len(g.prefix)) for g in groups]
        for group, handle in zip(groups, opened):
            ids, mask = pad(group.suffixes[:1], gen)
            logits = handle(ids, attention_mask=mask).logits
            loss = token_loss(logits[0, :len(group.suffixes[0])], group.suffixes[0], group.weights[0])
            out = handle.packed(group.suffixes[1:])
            loss = loss + sum(token_loss(lg, s, w) for lg, s, w in zip(out.split(out.logits), group.suffixes[1:],
                                                                          group.weights[1:]))
            loss.backward()
            total += loss.item()
    return total


def test_llama4_left_padded_prompts_train_exactly():
    """Prompts left-padded as TRL batches them: chunks and the NoPE layer's temperature count from the row's start
    (the prompt's first token sits at its `position_offset`), in Phase A and in padded and packed waves."""
    with tiny_copy.float64_throughout():
        gen = torch.Generator().manual_seed(4)
        model, groups, width = _left_padded_llama4(gen)
        candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
        ref_loss = _left_padded_loss(model, groups, width, gen)
        pf_loss = _prefixflow_loss(candidate, groups, width, gen)
    assert_rel_close(pf_loss, ref_loss, "loss")
    assert_same_gradients(gradients(candidate), gradients(model))


def test_llama4_left_padded_prompts_need_phase_a_at_its_offset(monkeypatch):
    """The broken variant: Phase A's NoPE queries keep the temperature of their index in the unpadded prompt."""
    original = hf_prefixflow.core.scheduler.PrefixGroup.__init__

    def unshifted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.cache.position_offset = 0

    monkeypatch.setattr(hf_prefixflow.core.scheduler.PrefixGroup, "__init__", unshifted)
    with tiny_copy.float64_throughout():
        gen = torch.Generator().manual_seed(4)
        model, groups, width = _left_padded_llama4(gen)
        candidate = hf_prefixflow.apply_prefixflow(copy.deepcopy(model))
        ref_loss = _left_padded_loss(model, groups, width, gen)
        pf_loss = _prefixflow_loss(candidate, groups, width, gen)
    with pytest.raises(AssertionError):
        assert_rel_close(pf_loss, ref_loss, "loss")
        assert_same_gradients(gradients(candidate), gradients(model))


def test_a_chunked_layer_whose_attention_hides_its_chunk_is_refused(monkeypatch):
    """A chunked layer whose attention module carries no config PrefixFlow can read the chunk from: refused, naming
    the module (its waves would attend across chunks)."""
    from transformers.models.llama4 import modeling_llama4

    original = modeling_llama4.Llama4TextAttention.__init__

    class Hiding:  # the module's config, without the chunk size
        def __init__(self, config):
            self.__dict__["_config"] = config

        def __getattr__(self, name):
            if name == "_config" or name.startswith("__"):  # copies look for these before `_config` is set
                raise AttributeError(name)
            return None if name == "attention_chunk_size" else getattr(self._config, name)

    def configless(self, config, layer_idx):
        original(self, config, layer_idx)
        self.config = Hiding(config)

    monkeypatch.setattr(modeling_llama4.Llama4TextAttention, "__init__", configless)
    with pytest.raises(PrefixFlowError, match=r"layer 0 is a chunked-attention layer but .*Llama4TextAttention"):
        probe._run_probe(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(), "sdpa")


def test_llama4_temperature_is_refused_under_sequence_parallelism():
    """Under Ulysses each process holds a shard of the sequence and Llama 4's NoPE layers scale queries by their
    index in the shard: refused there."""
    from hf_prefixflow.core import attention

    model = hf_prefixflow.apply_prefixflow(
        tiny_copy.build_tiny(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(), "sdpa"))
    nope = next(layer.self_attn for layer in model.model.layers if not layer.self_attn.use_rope)
    query = key = value = torch.zeros(1, 4, 3, 8, dtype=torch.float64)
    with pytest.raises(PrefixFlowError, match=r"Llama4TextAttention scales its queries by their index in the "
                                              r"process's shard.*prefixflow_sp_size=1"):
        attention.prefixflow_attention(nope, query, key, value, None, **{attention.SP_KWARG: object()})


# ---- a sliding window only the model's masks carry ---------------------------------------------------------------

def test_a_window_only_the_masks_carry_is_read_from_the_config(monkeypatch):
    """Phi-MoE's attention receives no sliding window (its masks carry `config.sliding_window`): the waves read the
    window from the config as transformers' masks do, and it trains exactly. The broken variant: without that
    reading, the probe refuses it (its waves would attend past the window)."""
    from hf_prefixflow.core import attention

    config = transformers.PhimoeConfig(sliding_window=4)
    outcome, detail, _ = families.run_variant(transformers.PhimoeForCausalLM, config)
    assert outcome == families.EXACT, detail
    original = attention.layer_window
    monkeypatch.setattr(attention, "layer_window", lambda module, kwargs: original(module, kwargs)
                        if "sliding_window" in kwargs or hasattr(module, "sliding_window") else None)
    with pytest.raises(PrefixFlowError, match=r"config.sliding_window is 4 but .*PhimoeAttention.* receives no"):
        probe._run_probe(transformers.PhimoeForCausalLM, config, "sdpa")
