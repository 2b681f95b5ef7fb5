"""The FLOP model reproduces the bounds in shared/notes/perf-targets.md and reads shapes from configs."""

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from hf_prefixflow.planning.flops import ModelShape

LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)
QWEN3_1_7B = dict(layers=28, hidden=2048, attention_width=2048,
                  layer_weights=2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144, vocab=151936)


@pytest.mark.parametrize("prefix,suffix,n,bound", [
    (10240, 2048, 16, 3.99), (10240, 2048, 32, 4.43), (10240, 2048, 128, 4.83), (6144, 6144, 16, 1.70),
    (2048, 10240, 16, 1.14)])
def test_llama3_8b_bounds(prefix, suffix, n, bound):
    assert ModelShape.from_config(LLAMA3_8B).bound(prefix, [suffix] * n) == pytest.approx(bound, abs=5e-3)


@pytest.mark.parametrize("prefix,suffix,n,bound", [
    (10240, 2048, 4, 2.36), (10240, 2048, 16, 3.57), (6144, 6144, 16, 1.57), (2048, 10240, 4, 1.09)])
def test_qwen3_1_7b_bounds(prefix, suffix, n, bound):
    assert ModelShape(**QWEN3_1_7B).bound(prefix, [suffix] * n) == pytest.approx(bound, abs=5e-3)


def test_moe_counts_active_experts_and_one_suffix_saves_nothing():
    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2)
    shape = ModelShape.from_config(config)
    assert shape.layer_weights == 2 * 64 * 64 + 2 * 64 * 32 + 2 * 3 * 64 * 32
    assert shape.bound(100, [20]) == pytest.approx(1.0)
    assert shape.full_sequence(100, [20, 30], train=False) * 3 == pytest.approx(shape.full_sequence(100, [20, 30]))


def test_the_pass_floor_sends_short_prompts_to_the_plain_path():
    """The H200 trainer steps (Qwen3-1.7B, S=256, N=16): P=256 in one microbatch of 16 ran 0.52x shared, so the cost
    model with the GPU's pass floor must refuse it, and keep sharing P=256 in microbatches of 4 (1.27x) and P=4864."""
    from hf_prefixflow.planning.flops import PASS_FLOOR_TOKENS

    shape = ModelShape(**QWEN3_1_7B)
    assert shape.step_bound(256, [256] * 16) == pytest.approx(shape.bound(256, [256] * 16))  # no floor: the bound
    assert not shape.pays(256, [256] * 16, rows_per_pass=16, floor_tokens=PASS_FLOOR_TOKENS)
    assert shape.pays(256, [256] * 16, rows_per_pass=4, floor_tokens=PASS_FLOOR_TOKENS)
    assert shape.pays(4864, [256] * 16, rows_per_pass=16, floor_tokens=PASS_FLOOR_TOKENS)
    assert shape.pays(256, [256] * 16, rows_per_pass=16)  # on a CPU (no floor) the FLOP bound decides


def test_the_pass_floor_is_time_per_layer_so_a_wider_layer_reaches_it_with_fewer_tokens():
    """The floor is launch and host time per layer: the same for the Llama3-8B shape's layers, each four times
    Qwen3-1.7B's work per token, so a pass of 2,000 Llama3-8B tokens is above it where 2,000 Qwen3 tokens are not."""
    from hf_prefixflow.planning.flops import FLOOR_LAYER_WEIGHTS, PASS_FLOOR_TOKENS

    qwen, llama = ModelShape(**QWEN3_1_7B), ModelShape.from_config(LLAMA3_8B)
    assert qwen.layer_weights == FLOOR_LAYER_WEIGHTS
    for shape, above in ((qwen, False), (llama, True)):
        floored = shape.step_bound(2000, [2000], None, PASS_FLOOR_TOKENS)
        assert (floored == pytest.approx(shape.step_bound(2000, [2000]))) is above


def test_no_committed_run_beats_its_cost_model_bound():
    """A measured speedup above the cost model's bound means the bound (or the baseline) is wrong: every whole-step
    row of the committed runs that shared its prefix stays within `step_bound`, the floor included."""
    import json
    import pathlib

    from hf_prefixflow.planning.flops import PASS_FLOOR_TOKENS

    results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    shapes = {"qwen3-1.7b": ModelShape(**QWEN3_1_7B), "llama3-8b": ModelShape.from_config(LLAMA3_8B)}
    checked = 0  # eager runs only: compiled layers run other kernels than the stock step (2026-12-05_compiled_step)
    for path in sorted([*(results / "2026-12-05_default_swap").glob("*_call*.json"),
                        *(results / "2026-12-05_dpo_trainer_order").glob("*_call*.json")]):
        for row in json.loads(path.read_text()):
            if row.get("fallback_rows") or row.get("fallback_pairs") or row.get("speedup") is None:
                continue
            shape, rows = shapes[row["model"]], [row["S"]] * row.get("N", 2)
            bound = shape.step_bound(row["P"], rows, row.get("batch"), PASS_FLOOR_TOKENS)
            assert row["speedup"] <= bound, (path.name, row["P"], row["S"], row["speedup"], bound)
            checked += 1
    assert checked == 22


def test_broken_a_floor_in_the_models_own_tokens_is_beaten_by_the_dpo_run(monkeypatch):
    """The broken variant: a floor counted in tokens of the model's own (wider) layers bounds the Llama3-8B DPO pair
    at 16,384/64 below the speedup its run measured, so the check above fails on it."""
    import json
    import pathlib

    from hf_prefixflow.planning import flops

    shape = ModelShape.from_config(LLAMA3_8B)
    monkeypatch.setattr(flops, "FLOOR_LAYER_WEIGHTS", shape.layer_weights)
    runs = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-12-05_default_swap"
    measured = max(json.loads((runs / f"dpo_step_call{c}.json").read_text())[0]["speedup"] for c in (1, 2))
    assert measured > shape.step_bound(16384, [64, 64], None, flops.PASS_FLOOR_TOKENS)
