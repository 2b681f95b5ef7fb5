"""PrefixFlowRLOOTrainer against TRL's RLOOTrainer: same fp64 model, seed, data, config and frozen rollouts."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import trl.trainer.rloo_trainer as trl_rloo
from transformers import AutoModelForCausalLM, set_seed
from trl import RLOOConfig, RLOOTrainer

import grpo_setup as setup
from equivalence import assert_rel_close
import hf_prefixflow
from hf_prefixflow import PrefixFlowError, PrefixFlowRLOOConfig, PrefixFlowRLOOTrainer
from hf_prefixflow.core import attention, scheduler
from hf_prefixflow.trainers import mixin as pf_mixin
from hf_prefixflow.trainers import routing
from hf_prefixflow.trainers.grouping import check_group_prompts

RTOL = 1e-5
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
# Two prompts of four completions per optimizer step: whole groups per microbatch (under RLOOConfig's default
# activation checkpointing), or each group over two microbatches, which PrefixFlow trains as one run (each
# microbatch keeping RLOO's own loss mean; without checkpointing).
GEOMETRIES = {"whole-groups": {"per_device_train_batch_size": 8},
              "merged-runs": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                              "gradient_checkpointing": False}}


@pytest.fixture(autouse=True)
def same_microbatches(monkeypatch):
    """Both trainers keep rows in sampler order, so microbatches hold the same rows (RLOO's per-microbatch mean
    depends on it)."""
    monkeypatch.setattr(trl_rloo, "shuffle_sequence_dict", lambda batch: batch)
    monkeypatch.setattr(pf_mixin, "shuffle_groups", lambda batch, size, generator=None, offset=0:
                        (check_group_prompts(batch, size, offset), batch)[1])


@pytest.fixture(autouse=True)
def earlier_memory_defaults(monkeypatch):
    """These tests pin the defaults from before the memory rule (K/V on the device, runs merged as 'auto' says):
    at this tiny size a merged run's fused-head tile (32,768 vocabulary entries per scored position) outgrows the
    stock microbatch, so the rule would never merge here. The rule: tests/test_default_memory.py."""
    monkeypatch.setattr(pf_mixin.PrefixFlowTrainerMixin, "_stock_rule", property(lambda self: False))


def freeze_rollouts(trainer, max_length: int) -> None:
    """`grpo_setup.freeze_rollouts` behind RLOOTrainer's `_generate_single_turn(prompt_ids, images,
    multimodal_fields)`, which returns the completion ids alone."""
    setup.freeze_rollouts(trainer, max_length)
    generate = trainer.__dict__.pop("_generate_single_turn")
    trainer._generate_single_turn = lambda prompt_ids, images, multimodal_fields: generate(
        prompt_ids, images, multimodal_fields, trainer.num_generations)[0]


@functools.cache
def policy_path(root: str) -> str:
    """A tiny fp64 Qwen3 saved once: the policy, and the reference model RLOOTrainer loads from its path (beta > 0)."""
    path = f"{root}/policy"
    setup.make_model(dtype=torch.float64).save_pretrained(path)
    setup.make_tokenizer().save_pretrained(path)
    return path


def train(trainer_cls, root, steps=2, config_cls=RLOOConfig, rollouts=8, model=None, **overrides):
    """Train `trainer_cls` from the saved fp64 policy; returns (gradients per step, start weights, end weights, logs).
    No gradient clipping and SGD: the recorded gradients are the raw sums, and updates stay linear in them."""
    options = dict(output_dir=f"{root}/{trainer_cls.__name__}", per_device_train_batch_size=8, num_generations=4,
                   max_completion_length=rollouts, max_steps=steps, report_to="none", logging_steps=1, use_cpu=True,
                   save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3, bf16=False, max_grad_norm=0.0,
                   num_iterations=2, beta=0.05)  # old log-probs off the current policy; KL to the reference
    options.update(overrides)
    set_seed(options["seed"])
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(policy_path(root), dtype=torch.float64)
    trainer = trainer_cls(model=model, reward_funcs=setup.length_reward, args=config_cls(**options),
                          train_dataset=setup.make_dataset(prompts=6), processing_class=setup.make_tokenizer())
    if rollouts:
        freeze_rollouts(trainer, rollouts)
    recorder = setup.GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, start, weights, trainer.state.log_history


def assert_same_training(stock, ours, shared=True) -> None:
    """Loss, every gradient before each optimizer step, every update and weight after the steps, and every metric
    RLOOTrainer logs: max|ours - stock| <= RTOL * max|stock| each."""
    (stock_grads, start, stock_weights, stock_logs), (grads, _, weights, logs) = stock, ours
    assert len(stock_grads) == len(grads) > 0
    for step, (expected, actual) in enumerate(zip(stock_grads, grads)):
        assert expected.keys() == actual.keys() and expected
        for name in expected:
            assert_rel_close(actual[name], expected[name], f"step {step} grad {name}", RTOL)
    for name in stock_weights:
        assert_rel_close(weights[name] - start[name], stock_weights[name] - start[name], f"update {name}", RTOL)
        assert_rel_close(weights[name], stock_weights[name], f"weight {name}", RTOL)
    assert len(stock_logs) == len(logs)
    for expected, actual in zip(stock_logs, logs):
        if "loss" in expected:
            assert_rel_close(actual["loss"], expected["loss"], "loss", RTOL)
            assert not shared or actual["prefixflow/groups"] > 0
        for key in expected.keys() - TIMING - {"loss"}:  # every metric TRL logs
            assert_rel_close(actual[key], expected[key], key, RTOL)


@functools.cache
def stock_run(root: str, geometry: str):
    return train(RLOOTrainer, root, **GEOMETRIES[geometry])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("rloo"))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_swap_matches_rloo_trainer(root, geometry):
    """The old-policy pass (scoring, every step), the reference pass and the actor update share each prompt; the
    training is RLOOTrainer's: loss, gradients, weights and metrics."""
    # The user's own RLOOConfig; merged runs asked for by name (under "auto" the planner may keep them apart).
    merged = {"config_cls": PrefixFlowRLOOConfig, "prefixflow_merge_microbatches": "2"} if geometry == "merged-runs" \
        else {}
    ours = train(PrefixFlowRLOOTrainer, root, **GEOMETRIES[geometry], **merged)
    assert_same_training(stock_run(root, geometry), ours)
    logs = [log for log in ours[3] if "loss" in log]
    # The old-policy and reference passes of each generation (every num_iterations=2 steps) shared the prompts.
    assert [log.get("prefixflow/scoring_groups", 0) > 0 for log in logs] == [True, False]
    assert not any(log.get("prefixflow/fallback_rows") for log in logs)
    runs = {log["prefixflow/run_microbatches"] for log in logs}
    assert runs == ({2.0} if geometry == "merged-runs" else {1.0})


def test_rows_where_sharing_would_not_pay_take_the_plain_path(root, caplog):
    """Below prefixflow_min_speedup every row trains and scores on RLOOTrainer's own path: logged, counted, and
    still RLOOTrainer's training."""
    with caplog.at_level("WARNING", logger=pf_mixin.__name__):
        ours = train(PrefixFlowRLOOTrainer, root, config_cls=PrefixFlowRLOOConfig, prefixflow_min_speedup=1e9,
                     **GEOMETRIES["whole-groups"])
    assert_same_training(stock_run(root, "whole-groups"), ours, shared=False)
    assert "rows take the plain RLOO path (below prefixflow_min_speedup)" in caplog.text
    assert all(log["prefixflow/fallback_rows"] > 0 for log in ours[3] if "loss" in log)


def _suffixes_without_the_prefix_cache(monkeypatch):
    monkeypatch.setattr(attention, "_check_prefix", lambda *args: False)  # waves attend to themselves only
    # The scheduler's own guard (a prefix that got no gradient) would stop training first: lifted here, so the
    # equivalence check is what sees it.
    monkeypatch.setattr(scheduler.PrefixGroup, "_needs_prefix_backward", lambda self: False)


def _gk_gv_dropped(monkeypatch):
    monkeypatch.setattr(scheduler, "delayed_backward", lambda caches, *args: 0)  # Phase C never runs


@pytest.mark.parametrize("broken", [_suffixes_without_the_prefix_cache, _gk_gv_dropped],
                         ids=["suffixes-without-prefix-cache", "gK-gV-dropped"])
def test_a_broken_swap_fails_the_same_check(root, monkeypatch, broken):
    stock = stock_run(root, "whole-groups")
    # The probe runs first on the real code, as an earlier test may have run it: under the broken patch it would
    # refuse the model at construction instead of letting the run reach the check.
    for use_cache in (False, True):  # the policy as the trainer sets it, the reference model as loaded
        model = AutoModelForCausalLM.from_pretrained(policy_path(root), dtype=torch.float64, use_cache=use_cache)
        hf_prefixflow.apply_prefixflow(model)  # (the probe's cache key is the config)
    broken(monkeypatch)
    ours = train(PrefixFlowRLOOTrainer, root, **GEOMETRIES["whole-groups"])
    with pytest.raises(AssertionError, match="grad|loss"):
        assert_same_training(stock, ours)


def test_moe_routes_recorded_in_rloo_generation_are_replayed(root, monkeypatch):
    """Real generation on a tiny fp64 Qwen3-MoE: RLOOTrainer's single turn (completion ids alone, the group size
    from the mode) is recorded and its routes replayed, sharing each prompt; in fp64 generation routes what
    training would, so the run is RLOOTrainer's."""
    groups = []
    assemble = routing.assemble
    monkeypatch.setattr(routing, "assemble", lambda *args: groups.append(args[5]) or assemble(*args))
    model = setup.make_moe_model().double()
    model.config._experts_implementation = "eager"  # the grouped-matmul experts take no fp64
    options = dict(rollouts=0, max_completion_length=6, beta=0.0, router_aux_loss_coef=0.0, steps=1,
                   **GEOMETRIES["merged-runs"])
    stock = train(RLOOTrainer, root, model=copy.deepcopy(model), **options)
    ours = train(PrefixFlowRLOOTrainer, root, model=model, **options)
    assert groups == [4]
    assert_same_training(stock, ours)
    assert not any(log.get("prefixflow/fallback_rows") for log in ours[3])


def test_a_bad_setting_is_refused_with_the_rloo_config(root):
    with pytest.raises(PrefixFlowError, match="prefixflow_merge_microbatches must be 'auto' or a positive integer"):
        train(PrefixFlowRLOOTrainer, root, config_cls=PrefixFlowRLOOConfig, prefixflow_merge_microbatches="0")
