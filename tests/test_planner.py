"""`hf_prefixflow.plan`: the byte model by hand, against the tensors autograd saves, against committed H200 peaks,
monotone, and knobs that are valid settings."""

import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_prefixflow
from hf_prefixflow import PrefixFlowConfig, PrefixFlowError
from hf_prefixflow.planning import planner
from hf_prefixflow._compat import enable_checkpointing

GIB = 2**30
# d=64, 4 query heads and 2 key/value heads of 32 (q=128, kv=64), MLP width 192, 3 layers, vocabulary 512
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=512, max_position_embeddings=1024)
H200_SHAPES = {  # benchmarks/speed.py's SHAPES
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "qwen3.5-2b": dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       vocab_size=151936, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
}


def tiny_config(model_type: str = "qwen3", **changes):
    return AutoConfig.for_model(model_type, tie_word_embeddings=model_type == "qwen3", **{**TINY, **changes})


def tiny_model(model_type: str = "qwen3", dtype=torch.bfloat16):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=dtype, attn_implementation="sdpa").train()


def h200_config(name: str):
    spec = dict(H200_SHAPES[name])
    return AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=32768, **spec)


def test_the_byte_model_by_hand():
    terms = planner.token_bytes(tiny_config(), torch.bfloat16, scoring="logits")
    norm = 4 * 64 + 4 + 2 * 64  # fp32 input, 1/rms, bf16 normalised input: 388
    assert terms.activations == (2 * (norm + 2 * 64)  # two norms and their bf16 outputs the linears keep: 1032
                                 + 6 * (128 + 64) + 4 * (4 + 2)  # q/k norms: 1176
                                 + 2 * (128 + 64 + 64 + 128) + 4 * 4  # q, k, v, output, log-sum-exp: 784
                                 + 4 * 2 * 192)  # gate, activation, up, product: 1536
    assert terms.activations == 4528
    assert terms.last_layer_kv == norm + 128 + (6 * 64 + 8) + 2 * 2 * 64 == 1164
    assert (terms.layer_input, terms.kv, terms.kv_grad, terms.key) == (128, 256, 256, 128)
    assert terms.selective == 128 + 2 * (128 + 64 + 64 + 64 + 64 + 2 * 192) == 1664
    assert terms.backward == 2 * 2 * 192 + 12 * 64 == 1536
    assert terms.final_norm == 516 and terms.logits == 12 * 512 and terms.host == 128 + 2 * 128 + 16
    assert planner.token_bytes(tiny_config(), torch.bfloat16, kv_grad_dtype=torch.float32).kv_grad == 512
    # TRL's fused head: no logits; its backward's fp32 weight-gradient accumulator and cast, an fp32 hidden-state
    # gradient and cast per position, a tile of 32768 vocabulary entries per position (at most 4096 at a time)
    fused = planner.token_bytes(tiny_config(), torch.bfloat16)
    assert (fused.logits, fused.head, fused.head_token, fused.head_tile) == (0, 512 * 64 * 6, 64 * 6, 2 * 32768)
    assert fused.loss(16) == 512 * 64 * 6 + 16 * (64 * 6 + 2 * 32768) and fused.loss(0) == 0
    assert fused.loss(5000) == 512 * 64 * 6 + 5000 * 64 * 6 + 4096 * 2 * 32768

    static = 1000.0
    # none, no offload: P' = 32 cached tokens keep two whole layers and the last one's K/V path
    a, b, c, parts = planner.prefixflow_peaks(terms, static, 33, 16, 1, "none", False, 0.0, True)
    prefix, kv_grad = 32 * (2 * 4528 + 1164), 32 * 3 * 256
    wave = 16 * (3 * 4528 + 516)
    assert b == static + prefix + kv_grad + wave + max(6144 * 16, 16 * 1536 + 32 * 256)
    assert parts == {"static": 1000, "prefix": prefix, "kv_grad": kv_grad, "wave": wave, "peak_transient": 6144 * 16}
    assert a == static + 32 * (3 * 4528 + 516) and c == static + prefix + kv_grad + 32 * 1536
    # full checkpointing with offload: only K/V stay; one prompt layer's recompute in Phase C, two prefetched
    a, b, c, _ = planner.prefixflow_peaks(terms, static, 33, 16, 2, "full", True, 1.0, True)
    assert b == static + 32 * 3 * 256 * 2 + 32 * (3 * 128 + 516) + max(6144 * 32, 32 * (4528 + 1536) + 32 * 256)
    assert c == static + 32 * 3 * 256 * 2 + 32 * (4528 + 1536) + 32 * 2 * 400
    assert planner.baseline_peak(terms, static, 33, 16, 2, "full") == (
        static + 98 * (3 * 128 + 516) + max(6144 * 32, 98 * (4528 + 1536)))


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_a_layer_keeps_what_autograd_saves(model_type):
    """Every tensor a full-sequence forward saves for its backward (bf16, CPU): L A + F per token, plus the rotary
    tables (2 x head dim, shared by the layers, left out of the model)."""
    model = tiny_model(model_type)
    tokens = 96
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tensor.is_floating_point() and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randint(0, 512, (1, tokens)), use_cache=False)
    terms = planner.token_bytes(model)
    assert sum(saved.values()) == tokens * (3 * terms.activations + terms.final_norm + 2 * 2 * 32)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_prompt_keeps_what_the_byte_model_says(checkpointing):
    """Between Phase A and Phase B the prompt's graph holds `prefix_resident` bytes per cached token: what autograd
    saved and still holds (after the graph's tail is dropped) plus the cached K/V, bf16 on the CPU."""
    model = hf_prefixflow.apply_prefixflow(tiny_model())
    if checkpointing == "full":
        enable_checkpointing(model)
    prompt = torch.randint(0, 512, (97,))
    held: list[weakref.ref] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        # detached, as autograd's own saved outputs are: a node saving its own output would otherwise keep itself
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.untyped_storage().data_ptr() not in params:
            held.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with hf_prefixflow.prefix_group(model, prompt) as group:
            alive = [ref() for ref in held if ref() is not None]
            alive += [t.live for t in group.cache.tensors()]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
            group(torch.randint(0, 512, (1, 4))).logits.sum().backward()
    terms = planner.token_bytes(model)
    rotary = 2 * 2 * 32  # cos and sin, shared by the layers (kept by the plain layers' RoPE)
    expected = 96 * (planner.prefix_resident(terms, checkpointing, False, 0.0) + rotary * (checkpointing == "none"))
    assert sum(storages.values()) == expected


# Phase-B peaks measured on an H200 (GiB), 10k/2k, N=16, bf16, scored through logits, offload recomputing every
# prompt layer:
# (shape, policy, completions per wave, offload, measured, where)
MEASURED = [
    ("qwen3-1.7b", "none", 1, False, 46.41, "2026-12-01_memory_offload/memory_eager_phases.json"),
    ("qwen3-1.7b", "none", 1, True, 18.22, "2026-12-01_memory_offload/memory_eager_phases.json"),
    ("qwen3-1.7b", "none", 4, False, 75.01, "2026-12-02_offload_phases/offload_phases_gradient_check_qwen3.log"),
    ("qwen3-1.7b", "none", 4, True, 46.82, "2026-12-02_offload_phases/offload_phases_gradient_check_qwen3.log"),
    ("qwen3-1.7b", "full", 4, False, 24.674, "2026-12-01_memory_offload/memory_ckpt_wave4.json"),
    ("qwen3-1.7b", "full", 4, True, 23.597, "2026-12-01_memory_offload/memory_ckpt_wave4.json"),
    ("llama3-8b", "none", 2, False, 121.48, "2026-12-02_offload_phases/offload_phases_n16_wave2_eager_llama3_8b*.log"),
    ("llama3-8b", "none", 2, True, 63.00, "2026-12-02_offload_phases/offload_phases_n16_wave2_eager_llama3_8b*.log"),
]


@pytest.mark.parametrize("shape, policy, wave, offload, measured, where", MEASURED)
def test_committed_h200_phase_b_peaks(shape, policy, wave, offload, measured, where):
    estimate = planner.plan(h200_config(shape), 10240, 2048, 16, 139 * GIB, policy, wave_size=wave, offload=offload,
                            suffix_checkpointing=True, dtype=torch.bfloat16, scoring="logits")
    assert estimate.phase_b_peak_bytes / GIB == pytest.approx(measured, rel=0.02), where


# Phase A and C peaks with the prompt's K/V streamed (`offload_kv`) measured on an H200 (GiB), Llama3-8B shape, N=16,
# one row per wave, TRL's fused head; the waves' own copies of the K/V (without checkpointing) are gone by Phase C.
# (P, S, policy, measured A, measured C, where)
MEASURED_STREAMED = [
    (8192, 4096, "none", 30.92, 32.372, "2026-12-02_memory_llama3_8b_exact_pool/splits.json"),
    (8192, 4096, "full", 30.92, 32.372, "2026-12-02_memory_llama3_8b_exact_pool/splits.json"),
    (4096, 8192, "none", 30.449, 31.175, "2026-12-02_memory_llama3_8b_exact_pool/splits.json"),
]


@pytest.mark.parametrize("prompt, completion, policy, phase_a, phase_c, where", MEASURED_STREAMED)
def test_committed_h200_streamed_prompt_phase_a_and_c_peaks(prompt, completion, policy, phase_a, phase_c, where):
    estimate = planner.plan(h200_config("llama3-8b"), prompt, completion, 16, 139 * GIB, policy, wave_size=1,
                            offload=True, offload_kv=True, suffix_checkpointing=True, prefix_recompute=1.0,
                            dtype=torch.bfloat16)
    assert estimate.phase_a_peak_bytes / GIB == pytest.approx(phase_a, rel=0.025), where
    assert estimate.phase_c_peak_bytes / GIB == pytest.approx(phase_c, rel=0.025), where


def test_estimates_grow_with_every_length_and_wave():
    config = h200_config("qwen3-1.7b")
    for policy in planner.POLICIES:
        for offload in (False, True):
            def peaks(p, s, w):
                e = planner.plan(config, p, s, 16, GIB, policy, wave_size=w, rows_per_microbatch=w, offload=offload,
                                 suffix_checkpointing=True)
                return e.phase_a_peak_bytes, e.phase_b_peak_bytes, e.phase_c_peak_bytes, e.baseline_peak_bytes

            for p, s, w in [(1024, 512, 1), (4096, 512, 1), (4096, 2048, 1), (4096, 2048, 3), (16384, 4096, 3)]:
                for bigger in [(2 * p, s, w), (p, 2 * s, w), (p, s, w + 1)]:
                    assert all(x <= y for x, y in zip(peaks(p, s, w), peaks(*bigger))), (policy, offload, bigger)
    base = {policy: planner.plan(config, 10240, 2048, 16, GIB, policy).baseline_peak_bytes
            for policy in planner.POLICIES}
    assert base["full"] < base["selective"] < base["none"]
    for policy in planner.POLICIES:
        on, off = (planner.plan(config, 10240, 2048, 16, GIB, policy, wave_size=1, offload=o) for o in (True, False))
        assert on.phase_b_peak_bytes < off.phase_b_peak_bytes and on.host_bytes > 0 == off.host_bytes


def test_knobs_are_valid_settings_and_follow_the_memory():
    config = h200_config("qwen3-1.7b")
    estimates = []
    roomy = planner.plan(config, 10240, 2048, 16, 139 * GIB, "full")
    assert (roomy.fits, roomy.wave_size, roomy.offload, roomy.suffix_checkpointing) == (True, 4, False, False)
    assert roomy.config() == PrefixFlowConfig(suffix_checkpointing=False)
    tight = planner.plan(config, 10240, 2048, 16, 20 * GIB, "none")
    assert tight.fits and tight.offload and tight.extra_recompute == "prefix layers (share 1)"
    assert tight.config().recompute_share == 1.0
    assert planner.plan(config, 10240, 2048, 16, 20 * GIB, "none", offload=False).peak_bytes > 20 * GIB
    assert not planner.plan(config, 10240, 2048, 16, 20 * GIB, "none", host_memory=GIB).fits
    hopeless = planner.plan(config, 10240, 2048, 16, 4 * GIB, "full")
    assert not hopeless.fits
    assert (hopeless.wave_size, hopeless.offload, hopeless.suffix_checkpointing) == (1, True, True)
    assert planner.plan(config, 10240, 2048, 2, 139 * GIB, "none").wave_size == 2
    for estimate, memory in ((roomy, 139 * GIB), (tight, 20 * GIB), (hopeless, 4 * GIB)):
        assert isinstance(estimate.config(), PrefixFlowConfig) and 1 <= estimate.wave_size <= 16
        assert estimate.fits == (estimate.peak_bytes <= memory)
        estimates.append(estimate)
    assert estimates[0].baseline_fits and not estimates[1].baseline_fits


def test_streamed_kv_is_chosen_last_and_lifts_the_prompt_s_device_bytes():
    """offload_kv: Phase B no longer holds L layers of K/V and gK/gV per prompt token; the host holds them. Chosen
    only where offload alone does not fit."""
    config = h200_config("qwen3-1.7b")
    tokens = planner.token_bytes(config, dtype=torch.bfloat16)
    offloaded, streamed = (planner.plan(config, 40960, 2048, 16, 139 * GIB, "full", wave_size=1, offload=True,
                                        suffix_checkpointing=True,
                                        offload_kv=kv) for kv in (False, True))
    layers, cached = tokens.layers, 40960 - 1
    saved = cached * (layers - 2) * (tokens.kv + tokens.kv_grad)
    assert offloaded.phase_b_peak_bytes - streamed.phase_b_peak_bytes == pytest.approx(saved, rel=1e-6)
    assert streamed.host_bytes - offloaded.host_bytes == pytest.approx(cached * layers * (tokens.kv + tokens.kv_grad))
    assert streamed.config() == PrefixFlowConfig(offload_kv=True, suffix_checkpointing=True)
    roomy = planner.plan(config, 40960, 2048, 16, 139 * GIB, "full")
    assert not roomy.offload_kv
    cap = streamed.peak_bytes + GIB  # fits streamed, not offloaded
    assert offloaded.peak_bytes > cap
    tight = planner.plan(config, 40960, 2048, 16, cap, "full", wave_size=1)
    assert tight.fits and tight.offload and tight.offload_kv and tight.suffix_checkpointing
    assert not planner.plan(config, 40960, 2048, 16, cap, "full", wave_size=1, offload_kv=False).fits
    assert not planner.plan(config, 40960, 2048, 16, cap, "full", wave_size=1, offload=False).offload_kv


def test_the_trainer_s_automatic_offload_picks_the_cheapest_mode_that_fits():
    tokens = planner.token_bytes(h200_config("qwen3-1.7b"), dtype=torch.bfloat16)
    run = ([40960, 20480], 2048, [8, 8])
    needs = {}
    for offload, kv in planner.OFFLOAD_MODES:
        share = PrefixFlowConfig(offload=offload).recompute_share
        parts = [planner.prefixflow_peaks(tokens, 0.0, p, 2048, 8, "full", offload, share, True, kv) for p in run[0]]
        held = [b["prefix"] + b["kv_grad"] + b["wave"] for *_, b in parts]  # one backward: every wave's inputs held
        needs[offload, kv] = sum(held) + max(max(phases) - h for (*phases, _), h in zip(parts, held))
    assert needs[False, False] > needs[True, False] > needs[True, True]
    for mode, need in needs.items():
        assert planner.offload_for(tokens, *run, budget=need) == mode
    assert planner.offload_for(tokens, *run, budget=needs[True, False] - 1) == (True, True)
    assert planner.offload_for(tokens, *run, budget=needs[True, False] - 1, allow_kv=False) == (True, False)
    assert planner.offload_for(tokens, *run, budget=0) == (True, True)  # none fits: the one needing least
    for (offload, kv), need in needs.items():
        assert planner.run_need(tokens, *run, offload=offload, offload_kv=kv) == pytest.approx(need)
    # Waves keeping their activations: every group's wave coexists with the prompt state.
    parts = [planner.prefixflow_peaks(tokens, 0.0, p, 2048, 8, "full", False, 0.0, False) for p in run[0]]
    held = [b["prefix"] + b["kv_grad"] + b["wave"] for *_, b in parts]
    kept = sum(held) + max(max(phases) - h for (*phases, _), h in zip(parts, held))
    assert planner.run_need(tokens, *run, suffix_checkpointing=False) == pytest.approx(kept)
    assert kept > needs[False, False]


def test_automatic_offload_keeps_the_host_pool_within_the_host_s_memory():
    """A mode whose pool (every prompt of the run, K/V and sums too under offload_kv) exceeds the host budget is never
    picked: the pool would exhaust the host's memory, which no device budget sees."""
    tokens = planner.token_bytes(h200_config("qwen3-1.7b"), dtype=torch.bfloat16)
    run = ([40960, 20480], 2048, [8, 8])
    pools = {kv: sum(planner.host_bytes(tokens, "full", PrefixFlowConfig(offload=True).recompute_share, p, kv)
                     for p in run[0]) for kv in (False, True)}
    assert pools[True] > pools[False] > 0
    for kv in (False, True):
        assert planner.run_host_need(tokens, run[0], offload_kv=kv) == pytest.approx(pools[kv])
    assert planner.offload_for(tokens, *run, budget=0, host_budget=pools[True]) == (True, True)
    assert planner.offload_for(tokens, *run, budget=0, host_budget=pools[True] - 1) == (True, False)
    assert planner.offload_for(tokens, *run, budget=0, host_budget=pools[False] - 1) == (False, False)


def test_suffix_activations_are_kept_where_the_full_sequence_microbatch_needs_more():
    """`keeps_suffix_activations` (the trainer's prefixflow_suffix_checkpointing='auto'). H200, 4,864/256, N=16 in
    one run, both sides checkpointed (2026-12-02_trainer_step): GRPOTrainer's microbatch of 16 rows peaked at 29.8 GiB
    and PrefixFlow keeping the suffix activations at 24.9 (kept); a microbatch of 4 rows at 18.4 (recomputed)."""
    tokens = planner.token_bytes(h200_config("qwen3-1.7b"), dtype=torch.bfloat16)
    assert planner.keeps_suffix_activations(tokens, [4864], 256, [16], baseline_rows=16)
    assert not planner.keeps_suffix_activations(tokens, [4864], 256, [16], baseline_rows=4)
    assert not planner.keeps_suffix_activations(tokens, [4864, 4864], 256, [16, 16], baseline_rows=16)
    assert planner.keeps_suffix_activations(tokens, [4864], 256, [16], baseline_rows=4, checkpointing="none")


def test_longest_is_the_frontier_of_plan():
    config = h200_config("qwen3-1.7b")
    cap = 24 * GIB
    kwargs = dict(wave_size=1, suffix_checkpointing=True)
    base = planner.longest(config, 10240, 2048, 2, cap, "none", side="baseline", resolution=256, **kwargs)
    flow = planner.longest(config, 10240, 2048, 2, cap, "none", resolution=256, offload=True, **kwargs)
    assert base > 0 and flow > 1.66 * base
    prompt = round(flow * 10240 / 12288)
    assert planner.plan(config, prompt, flow - prompt, 2, cap, "none", offload=True, **kwargs).fits
    prompt = round((flow + 256) * 10240 / 12288)
    assert not planner.plan(config, prompt, flow + 256 - prompt, 2, cap, "none", offload=True, **kwargs).fits
    longest_prompt = planner.longest(config, 10240, 2048, 2, cap, "full", vary="prompt", resolution=512, **kwargs)
    assert planner.plan(config, longest_prompt, 2048, 2, cap, "full", **kwargs).fits
    assert planner.longest(config, 10240, 2048, 2, 2 * cap, "full", vary="prompt", resolution=512,
                           **kwargs) > longest_prompt
    with pytest.raises(PrefixFlowError, match="unknown"):
        planner.longest(config, 10240, 2048, 2, cap, "full", waves=2)


def test_a_model_and_its_config_give_one_estimate():
    model = tiny_model()
    from_model = planner.plan(model, 200, 50, 4, GIB, "full")
    from_config = planner.plan(model.config, 200, 50, 4, GIB, "full", dtype=torch.bfloat16)
    assert from_model == from_config
    assert planner.static_bytes(model) == 2 * sum(p.numel() * 2 for p in model.parameters())
    assert hf_prefixflow.plan is planner.plan and hf_prefixflow.MemoryPlan is planner.MemoryPlan


@pytest.mark.parametrize("arguments, match", [
    (dict(checkpointing="some"), "checkpointing"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(num_generations=1.5), "num_generations"),
    (dict(device_memory=0), "device_memory"),
    (dict(wave_size=0), "wave_size"),
])
def test_bad_arguments_are_refused(arguments, match):
    call = {**dict(model_or_config=tiny_config(), prompt_tokens=100, completion_tokens=10, num_generations=4,
                   device_memory=GIB), **arguments}
    with pytest.raises(PrefixFlowError, match=match):
        planner.plan(**call)
