"""The default memory rule (hf_prefixflow/defaults.py): with prefixflow_offload and prefixflow_offload_kv unset, a run
plans no more device memory than the stock trainer's microbatch, decided from the planner's byte model (no device)."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch
from trl import GRPOConfig

import grpo_setup as setup
from hf_prefixflow import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
from hf_prefixflow.planning import defaults, planner
from hf_prefixflow.planning.flops import MIN_SPEEDUP, PASS_FLOOR_TOKENS, ModelShape
from hf_prefixflow.trainers import mixin as pf_mixin
from test_planner import h200_config
from test_trainer import assert_aligned, both, run_lengths, same_microbatches  # noqa: F401 - an autouse fixture

GIB = 2**30
N = 16
SPLITS = [(4864, 256), (10240, 2048)]
GRID = [(shape, prompt, completion, batch, policy) for shape in ("qwen3-1.7b", "llama3-8b")
        for prompt, completion in SPLITS for batch in (1, 4, 16) for policy in ("full", "none")]


def decide(tokens, prompt: int, completion: int, batch: int, policy: str, shape_config):
    """What the trainer decides on a GPU for a generation batch of one prompt width: its merge cap (no shorter than
    a run whose group shares its prompt, `_stock_merge_cap`), a run's rows and the setting
    (benchmarks/trainer_step.py's grid: prompts of exactly `prompt` tokens)."""
    default = (prompt + completion) // completion
    shape = ModelShape.from_config(shape_config)
    sharing = min(m for m in range(1, default + 1) if shape.pays(prompt, [completion] * min(m * batch, N), MIN_SPEEDUP,
                                                                 batch, PASS_FLOOR_TOKENS))
    static = planner.static_bytes(shape_config, torch.bfloat16)  # weights and gradients: the margin's base
    cap = defaults.merge_cap(tokens, prompt, completion, batch, N, default, policy, min_microbatches=sharing,
                             static=static)
    assert cap >= sharing and not 0 < -(-N // batch) % cap < sharing  # the last run shares too
    rows = defaults.run_groups(cap, batch, N)
    budget = defaults.stock_need(tokens, prompt, completion, batch, policy)
    return cap, rows, defaults.choose(tokens, [prompt] * len(rows), completion, rows, budget, policy, static=static)


@pytest.mark.parametrize("shape, prompt, completion, batch, policy", GRID)
def test_the_default_never_plans_above_the_stock_trainer(shape, prompt, completion, batch, policy):
    """At every grid point the chosen setting's planned peak (`planner.plan`, every phase, static state included) is
    at most the stock microbatch's planned peak less the margin (1% of it), and every cheaper setting plans above
    that at that run length."""
    config = h200_config(shape)
    tokens = planner.token_bytes(config, dtype=torch.bfloat16)
    cap, rows, choice = decide(tokens, prompt, completion, batch, policy, config)
    assert choice.fits and len(rows) == 1 and 1 <= cap <= (prompt + completion) // completion
    s = choice.setting
    estimate = planner.plan(config, prompt, completion, N, float("inf"), policy, rows_per_microbatch=batch,
                            wave_size=rows[0], offload=s.offload, offload_kv=s.offload_kv, suffix_checkpointing=True,
                            prefix_recompute=s.prefix_recompute, dtype=torch.bfloat16)
    assert estimate.peak_bytes <= (1 - defaults.MARGIN) * estimate.baseline_peak_bytes
    assert estimate.peak_bytes - estimate.baseline_peak_bytes == pytest.approx(choice.need - choice.budget, abs=4)
    for cheaper in defaults.settings(policy)[:defaults.settings(policy).index(s)]:
        need = defaults.setting_need(tokens, cheaper, [prompt], completion, rows, policy)
        assert need + choice.margin > choice.budget
    if batch > 1:  # a microbatch of several full sequences holds more than a group's prompt state: nothing changes
        assert s.name == "device" and cap == (prompt + completion) // completion


def test_one_row_per_microbatch_needed_the_prompt_off_the_device():
    """The broken default (K/V on the device, runs merged as far as the completions fit one microbatch's tokens)
    fails the same check where it was measured (Qwen3-1.7B shape, 10k/2k, batch 1, checkpointing: PrefixFlow 16.8
    GiB against GRPOTrainer's 13.5): the prompt's K/V, gK/gV and checkpointed inputs are the planner's 3.5 GiB extra.
    The rule streams the K/V and merges four microbatches instead of six."""
    config = h200_config("qwen3-1.7b")
    tokens = planner.token_bytes(config, dtype=torch.bfloat16)
    earlier = planner.plan(config, 10240, 2048, N, float("inf"), "full", rows_per_microbatch=1, wave_size=6,
                           offload=False, offload_kv=False, suffix_checkpointing=True, dtype=torch.bfloat16)
    assert (earlier.peak_bytes - earlier.baseline_peak_bytes) / GIB == pytest.approx(3.5, abs=0.1)
    cap, rows, choice = decide(tokens, 10240, 2048, 1, "full", config)
    assert (cap, rows, choice.setting.name) == (4, [4], "offload_kv")
    no_kv = defaults.choose(tokens, [10240], 2048, rows, choice.budget, "full", allow_kv=False)
    assert not no_kv.fits and no_kv.setting.name == "offload"  # the least needing where none fits


def test_explicit_settings_narrow_the_choice():
    tokens = planner.token_bytes(h200_config("qwen3-1.7b"), dtype=torch.bfloat16)
    assert [s.name for s in defaults.settings("none")] == list(defaults.SETTING_NAMES)
    assert [s.name for s in defaults.settings("full")] == ["device", "offload", "offload_kv"]  # recomputed anyway
    kept = defaults.settings("none", prefix_recompute=0.5, allow_kv=False)
    assert [(s.name, s.prefix_recompute) for s in kept] == [("device", 0.5), ("offload", 0.5)]
    budget = defaults.stock_need(tokens, 10240, 2048, 1, "full")
    no_host = defaults.choose(tokens, [10240], 2048, [4], budget, "full", host_budget=0.0)
    assert no_host.setting.name == "device" and not no_host.fits  # no pool without host memory


def pf_trainer(tmp_path, **options) -> PrefixFlowGRPOTrainer:
    config = PrefixFlowGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=4,
                                  gradient_accumulation_steps=4, max_completion_length=8, report_to="none",
                                  use_cpu=True, bf16=False, **options)
    return PrefixFlowGRPOTrainer(model=setup.make_model(), reward_funcs=setup.length_reward, args=config,
                                 train_dataset=setup.make_dataset(prompts=4), processing_class=setup.make_tokenizer())


def test_a_user_s_settings_are_kept(tmp_path):
    """Any of prefixflow_offload, prefixflow_offload_kv or prefixflow_offload_auto set turns the rule off and keeps
    the setting; a number for prefixflow_merge_microbatches keeps that cap under the rule."""
    assert pf_trainer(tmp_path / "default")._stock_rule
    for options, offload in (({"prefixflow_offload": False}, False), ({"prefixflow_offload": True}, True),
                             ({"prefixflow_offload_kv": True}, True), ({"prefixflow_offload_auto": True}, False)):
        trainer = pf_trainer(tmp_path / str(options), **options)
        assert not trainer._stock_rule and pf_mixin.config_of(pf_mixin.unwrap(trainer.model)).offload == offload
    merged = pf_trainer(tmp_path / "merge", prefixflow_merge_microbatches="3")
    # Short rows: a merged run's fused-head tile (32,768 vocabulary entries per scored position) outgrows the stock's.
    merged._stock_widths = (30, 8)
    assert merged._stock_merge_cap(3) == 3
    merged._merge_limit = None
    assert merged._stock_merge_cap(3) == 1


@pytest.mark.parametrize("only", [None, "offload_kv"])
def test_the_default_equals_the_stock_trainer_and_logs_its_choice(tmp_path, caplog, monkeypatch, only):
    """A float64 tiny model, TRL's defaults (checkpointing on), two rows per microbatch, a group over two microbatches:
    the rule's choice trains the stock trainer's gradients, weights and metrics. For this model a merged run's fused-
    head tile alone outgrows the stock microbatch, so runs stop merging (logged), and the prompt's activations go to
    the host (prefixflow/offload_mode 2, logged once): its activations are small against the margin, 1% of its
    weights and gradients. With the K/V's stream the only setting (`only`), it is applied."""
    if only is not None:
        monkeypatch.setattr(defaults, "SETTINGS", tuple(s for s in defaults.SETTINGS if s.name == only))
    with caplog.at_level(logging.INFO, logger=pf_mixin.logger.name):
        stock, pf = both(tmp_path, model_factory=lambda: setup.make_model(dtype=torch.float64), steps=2,
                         config_cls=GRPOConfig, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         gradient_checkpointing=True)
    assert_aligned(stock, pf, rtol=1e-5)
    modes = {log["prefixflow/offload_mode"] for log in pf[2] if "prefixflow/offload_mode" in log}
    assert modes == {float(defaults.SETTING_NAMES.index(only or "offload"))}
    messages = [r.getMessage() for r in caplog.records]
    held = [m for m in messages if m.startswith("PrefixFlow: prompts held as")]
    assert len(held) == 1 and f"'{only or 'offload'}'" in held[0]
    assert sum(m.startswith("PrefixFlow: runs merge at most 1 microbatches (of ") for m in messages) == 1
    assert run_lengths(pf[2]) == {1.0}
    assert pf_mixin.UNCALIBRATED_STATES not in messages  # a dense model: the byte model is calibrated


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_planner_s_stock_peak_against_the_measured():
    """The rule's budget is the planner's estimate of the stock peak. Against the H200 peaks measured for it: full
    sequences one row per microbatch (memory_like_for_like.json: weights and gradients, no optimizer) within 2.5%;
    GRPOTrainer's whole steps (trainer_step.json, AdamW's two bf16 states added) within 4% where gradients
    accumulate over microbatches (batch 1 at 4,864/256 and 10,240/2,048 within 1.3%, where the default rule streams
    the prompt's K/V; 10,240/2,048 at batch 4 3.9% high); with one microbatch per step (batch 16 = N) the estimate is
    12-16% high: the backward's peak comes before most gradients exist, which the static state counts in full."""
    rows = json.loads((RESULTS / "memory_like_for_like.json").read_text())["rows"]
    pairs = {(r["model"], r["P"], r["S"], r["policy"]): r["baseline_peak_gib"] for r in rows
             if r["baseline_peak_gib"] is not None}
    assert len(pairs) >= 20
    for (shape, prompt, completion, policy), measured in pairs.items():
        estimate = planner.plan(h200_config(shape), prompt, completion, N, float("inf"), policy,
                                dtype=torch.bfloat16).baseline_peak_bytes / GIB
        assert measured / estimate - 1 == pytest.approx(0, abs=0.025), (shape, prompt, completion, policy)
    steps = [r for r in json.loads((RESULTS / "trainer_step.json").read_text()) if r["generation"] == "fixed"]
    assert len(steps) >= 10
    for r in steps:
        estimate = planner.plan(h200_config(r["model"]), r["P"], r["S"], r["N"], float("inf"),
                                "full" if r["checkpointing"] else "none", rows_per_microbatch=r["batch"],
                                dtype=torch.bfloat16, optimizer_state_bytes=4).baseline_peak_bytes / GIB
        error = r["peak_gib_stock"] / estimate - 1
        if r["batch"] < r["N"]:
            assert abs(error) <= 0.04, r
        else:
            assert -0.16 <= error <= -0.12, r


def test_the_planner_s_stock_peak_on_a_hybrid_is_low():
    """On the Qwen3.5 shape (H100, `2026-12-05_qwen3_5_fla`) the byte model, which counts gated delta-net layers as
    attention layers, puts the stock peak 2-5% below the measured one, where on dense shapes it is within 4% or above
    (the test before): the rule's budget is then too large, one reason the default peaked above GRPOTrainer's there
    (the trainer warns, `mixin.UNCALIBRATED_STATES`)."""
    steps = json.loads((RESULTS / "2026-12-05_qwen3_5_fla" / "trainer_step_call1.json").read_text())
    assert {r["batch"] for r in steps} == {4, 16}
    for r in steps:
        estimate = planner.plan(h200_config(r["model"]), r["P"], r["S"], r["N"], float("inf"), "full",
                                rows_per_microbatch=r["batch"], dtype=torch.bfloat16,
                                optimizer_state_bytes=4).baseline_peak_bytes / GIB
        assert 0.02 <= r["peak_gib_stock"] / estimate - 1 <= 0.06, (r["batch"], estimate)
