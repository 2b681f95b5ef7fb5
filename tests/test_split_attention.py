"""Split Phase-B attention (prefix in place + causal suffix, merged by log-sum-exp) against concatenated attention."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from equivalence import assert_rel_close, train_side_by_side, random_group, random_plan
import hf_prefixflow
from hf_prefixflow.core import split_attention
from models import build


def _reference(query, prefix_key, prefix_value, key, value, scale):
    batch = query.shape[0]
    k = torch.cat([prefix_key.expand(batch, -1, -1, -1), key], dim=2)
    v = torch.cat([prefix_value.expand(batch, -1, -1, -1), value], dim=2)
    mask = causal_lower_right(query.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != query.shape[1])


@pytest.mark.parametrize("seed", range(6))
def test_matches_concatenated_attention_and_its_gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    randint = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    batch, kv_heads, groups, prefix, length, dim = randint(1, 4), randint(1, 3), randint(1, 3), randint(1, 40), \
        randint(1, 17), 8 * randint(1, 3)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    # transformers' layout ([B, H, L, D] views of [B, L, H, D]: the rows fold as a view) or a contiguous one (a copy)
    query = make(batch, length, kv_heads * groups, dim).transpose(1, 2) if seed % 3 else \
        make(batch, kv_heads * groups, length, dim)
    # The cache is stored as transformers computes it: [1, H, P, D] views of a [1, P, H, D] buffer.
    prefix_key, prefix_value = (make(1, prefix, kv_heads, dim).transpose(1, 2) for _ in range(2))
    key, value = make(batch, kv_heads, length, dim), make(batch, kv_heads, length, dim)
    grad = torch.randn(batch, kv_heads * groups, length, dim, generator=gen, dtype=torch.float64)
    scale = [None, 0.3][seed % 2]
    inputs = (query, prefix_key, prefix_value, key, value)
    results = []
    for fn in (_reference, lambda *x: split_attention.split_attention(*x, split_attention.CPU)):
        out = fn(*inputs, scale)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    for what, got, want in zip(("out", "dq", "dk prefix", "dv prefix", "dk", "dv"), results[1], results[0]):
        assert_rel_close(got, want, what, rtol=1e-12)  # fp64 end to end: a merge in fp32 would show at 1e-8


def test_a_backward_with_each_parts_own_statistics_fails():
    """Each part's backward must see the merged out/lse; with its own it drops the cross-part softmax coupling."""
    cpu = split_attention.CPU

    def own_backward(grad, q, k, v, out, lse, causal, scale, state):
        own_out, own_lse, own_state = cpu.forward(q, k, v, causal, scale)
        return cpu.backward(grad, q, k, v, own_out, own_lse, causal, scale, own_state)

    broken = split_attention.Kernel("own statistics", cpu.forward, own_backward)
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    inputs = (make(2, 2, 5, 8), make(1, 2, 7, 8), make(1, 2, 7, 8), make(2, 2, 5, 8), make(2, 2, 5, 8))
    want = torch.autograd.grad(_reference(*inputs, None).sum(), inputs[0])[0]
    got = torch.autograd.grad(split_attention.split_attention(*inputs, None, broken).sum(), inputs[0])[0]
    assert not torch.allclose(got, want, rtol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("path", ["split", "concatenated"])
def test_models_match_full_sequence_on_either_path(family, path, monkeypatch):
    """Padded waves take the split path on the CPU; the concatenated path stays exact for kernels it cannot use."""
    calls = []
    kernel_for = split_attention.kernel_for
    monkeypatch.setattr(split_attention, "kernel_for",
                        lambda q, k, v: calls.append(q) or (kernel_for(q, k, v) if path == "split" else None))
    model = build(family).train()
    gen = torch.Generator().manual_seed(11)
    groups = [random_group(gen, n=(2, 5)) for _ in range(3)]
    train_side_by_side(model, groups, [random_plan(gen, len(g.suffixes), layouts=("padded",)) for g in groups])
    assert calls, "padded waves never reached the split kernel's dispatch"


def test_kernel_choice():
    x, meta = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8, device="meta")
    assert split_attention.kernel_for(x, x, x) is split_attention.CPU
    assert split_attention.kernel_for(meta, meta, meta) is None
    assert split_attention.kernel_for(x, x, torch.zeros(1, 1, 1, 4)) is None  # value heads of another size


def test_value_heads_of_another_size_take_the_general_path():
    """DeepSeek-V3 attends with value heads narrower than its query/key heads: fused kernels cannot run it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=4, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).double().train()
    gen = torch.Generator().manual_seed(3)
    groups = [random_group(gen, n=(2, 4)) for _ in range(2)]
    train_side_by_side(model, groups, [random_plan(gen, len(g.suffixes), layouts=("padded",)) for g in groups])


def test_autocast_casts_the_cache_once_per_group(monkeypatch):
    """Under bf16 autocast with fp32 weights RoPE leaves K in fp32: the bf16 copy is made once per group, not per
    wave, and its gradient still reaches the cache (the bf16 accuracy itself: test_attention.py)."""
    seen = []
    split = split_attention.split_attention
    monkeypatch.setattr(split_attention, "split_attention",
                        lambda q, pk, pv, *rest: seen.append((id(pk), id(pv), pk.dtype)) or split(q, pk, pv, *rest))
    model = build("llama", dtype=torch.float32).train()
    hf_prefixflow.apply_prefixflow(model)
    gen = torch.Generator().manual_seed(2)
    group = random_group(gen, prefix=(10, 16), n=(3, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16), hf_prefixflow.prefix_group(model, group.prefix) as g:
        for suffix in group.suffixes:
            g(suffix[None]).logits.float().sum().backward()
        received = [t.grad is not None for t in g.cache.tensors()]
        assert g.cache.layers[0].key.leaf.dtype == torch.float32  # else there would be no cast to test
    layers = model.config.num_hidden_layers
    assert len(seen) == 3 * layers and {dtype for _, _, dtype in seen} == {torch.bfloat16}
    assert len({pk for pk, _, _ in seen}) == layers and all(received)


def test_rows_fold_into_one_query_sequence_without_a_copy():
    """The prefix call sees the wave's rows as one sequence: a view of transformers' `[B, L, H, D]` layout, row
    after row, and unfolding gives the same tensor back."""
    x = torch.randn(3, 5, 4, 8).transpose(1, 2)  # [B, H, L, D] as transformers lays out q
    folded = split_attention._rows_folded(x)
    assert folded.shape == (1, 4, 15, 8) and folded.data_ptr() == x.data_ptr() and folded._base is not None
    assert torch.equal(folded[0, :, 5:10], x[1]) and torch.equal(split_attention._rows_unfolded(folded, 3), x)
    lse = torch.randn(3, 4, 5)  # 3-D, contiguous: folded by a copy, same values
    assert torch.equal(split_attention._rows_unfolded(split_attention._rows_folded(lse), 3), lse)
    row = x[:1]  # one row stays the tensor it is (its strides untouched)
    assert split_attention._rows_folded(row) is row and split_attention._rows_unfolded(row, 1) is row


def test_merge_and_sums_run_in_the_kernels_memory_order():
    """Kernel outputs lie as `[B, L, H, D]`; the compiled merge and sums see them that way (contiguous) and hand
    back `[B, H, L, D]` views with the same values as the plain functions."""
    gen = torch.Generator().manual_seed(3)
    out_p, out_s = (torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    lse_p, lse_s = (torch.randn(2, 4, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    seen = []

    def spy(fn):
        return lambda *args: seen.append([x.is_contiguous() for x in args if x.dim() == 4]) or fn(*args)

    merged = split_attention.in_memory_order(spy(split_attention._merge.__wrapped__), out_p, lse_p, out_s, lse_s)
    expected = split_attention._merge.__wrapped__(out_p, lse_p, out_s, lse_s)
    assert seen == [[True, True]]
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(merged, expected))
    plain = split_attention.in_memory_order(spy(split_attention._sum.__wrapped__), out_p.contiguous(), out_s)
    assert seen[-1] == [True, False] and torch.equal(plain, out_p + out_s)  # mixed layouts: called as they are


def _recorded_split_attention(record, seed: int, hooks=None) -> torch.Tensor:
    """`split_attention` over three rows through the CPU kernel, whose backward first calls `record(out, lse)`; the
    forward runs under `hooks` (saved-tensor hooks) if given."""
    cpu = split_attention.CPU

    def recording_backward(grad, q, k, v, out, lse, causal, scale, state):
        record(out, lse)
        return cpu.backward(grad, q, k, v, out, lse, causal, scale, state)

    kernel = split_attention.Kernel("recording", cpu.forward, recording_backward)
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    query, key, value = (make(3, 6, h, 8).transpose(1, 2) for h in (4, 2, 2))
    prefix_key, prefix_value = (make(1, 9, 2, 8).transpose(1, 2) for _ in range(2))
    with hooks or contextlib.nullcontext():
        return split_attention.split_attention(query, prefix_key, prefix_value, key, value, None, kernel)


def test_backward_kernels_read_a_contiguous_log_sum_exp():
    """The GPU kernels take the log-sum-exp's pointer without its strides: whatever layout the merge leaves it in,
    each backward call gets it contiguous (a strided one gave dq, dk and dv 20% off on an H200)."""
    seen = []
    out = _recorded_split_attention(lambda out, lse: seen.append(lse.is_contiguous()), seed=5)
    assert not out.grad_fn.saved_tensors[-1].is_contiguous()  # the eager merge leaves it strided: the case to test
    out.sum().backward()
    assert seen == [True, True]


def test_backward_kernels_get_the_output_as_the_forward_laid_it_out():
    """A saved-tensor hook may hand saved tensors back contiguous (torch's `save_on_cpu(pin_memory=True)` does); each
    backward call still gets the merged output in the forward's layout (cuDNN's backward, handed its output
    contiguous, returned dq and dk 2-3 times their largest value off on an H200:
    benchmarks/results/2026-12-02_attention_layout/attention_layout_probe_fixed.log)."""
    seen = []
    contiguous = torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t)
    out = _recorded_split_attention(lambda out, lse: seen.append(out.stride()), seed=6, hooks=contiguous)
    assert not out.is_contiguous() and out.grad_fn.saved_tensors[-2].is_contiguous()  # the hook changed its layout
    out.sum().backward()
    assert seen == [split_attention._rows_folded(out.detach()).stride(), out.stride()]
