"""PrefixFlowGRPOTrainer against TRL's GRPOTrainer: same model, seed, data, config and frozen rollouts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo
from accelerate.utils import DistributedType
from peft import LoraConfig
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

import grpo_setup as setup
from hf_prefixflow.core.attention import RECOMPILE_LIMIT
from hf_prefixflow import PrefixFlowError, PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer, apply_prefixflow
from hf_prefixflow.core import offload, scheduler
from hf_prefixflow.trainers import engine_rule
from hf_prefixflow.trainers import mixin as pf_mixin
from hf_prefixflow.trainers.grouping import check_group_prompts

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
# Two prompts of four completions per optimizer step: whole groups per microbatch, or each group over two microbatches,
# which PrefixFlow trains as one run (one forward and backward of both, each keeping TRL's loss normaliser).
GEOMETRIES = {"whole-groups": {"per_device_train_batch_size": 8},
              "merged-runs": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}}
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(autouse=True)
def same_microbatches(monkeypatch):
    """Both trainers keep rows in sampler order, so microbatches hold the same rows (normalisers depend on it)."""
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    monkeypatch.setattr(pf_mixin, "shuffle_groups", lambda batch, size, generator=None, offset=0:
                        (check_group_prompts(batch, size, offset), batch)[1])


@pytest.fixture(autouse=True)
def earlier_memory_defaults(monkeypatch):
    """These tests pin the defaults from before the memory rule (K/V on the device, runs merged as 'auto' says):
    at this tiny size a merged run's fused-head tile (32,768 vocabulary entries per scored position) outgrows the
    stock microbatch, so the rule would never merge here. The rule: tests/test_default_memory.py."""
    monkeypatch.setattr(pf_mixin.PrefixFlowTrainerMixin, "_stock_rule", property(lambda self: False))


def train(trainer_cls, model, tmp_path, steps=1, config_cls=GRPOConfig, peft_config=None, rollouts=8, **overrides):
    # No gradient clipping: the recorded gradients are the raw sums, so a normaliser off by a factor shows.
    options = dict(output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=8, num_generations=4,
                   max_completion_length=rollouts, max_steps=steps, report_to="none", logging_steps=1, use_cpu=True,
                   save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3, bf16=False, max_grad_norm=0.0,
                   model_init_kwargs={"dtype": torch.float32})
    options.update(overrides)
    set_seed(options["seed"])  # the LoRA init: TRL seeds before building the model only from 1.15 on
    trainer = trainer_cls(model=model, reward_funcs=setup.length_reward, args=config_cls(**options),
                          train_dataset=setup.make_dataset(prompts=6), processing_class=setup.make_tokenizer(),
                          peft_config=peft_config)
    setup.freeze_rollouts(trainer, rollouts)
    recorder = setup.GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, weights, trainer.state.log_history


def assert_aligned(stock, prefixflow, rtol=2e-4, shared=True, metric_rtol=1e-4):
    (stock_grads, stock_weights, stock_logs), (pf_grads, pf_weights, pf_logs) = stock, prefixflow
    assert len(stock_grads) == len(pf_grads) > 0
    for step, (expected, actual) in enumerate(zip(stock_grads, pf_grads)):
        assert expected.keys() == actual.keys()
        for name in expected:
            err = (actual[name] - expected[name]).abs().max().item()
            scale = expected[name].abs().max().item()
            assert err <= rtol * scale + 1e-7, f"step {step} grad {name}: {err:.2e} vs {scale:.2e}"
    for name in stock_weights:
        torch.testing.assert_close(pf_weights[name], stock_weights[name], rtol=0, atol=1e-5, msg=name)
    assert len(stock_logs) == len(pf_logs)
    for expected, actual in zip(stock_logs, pf_logs):
        if "loss" in expected:
            assert actual["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-5)  # a cancelling mean
            assert actual.get("reward") == expected.get("reward")
            assert not shared or actual["prefixflow/groups"] > 0 and "prefixflow/flops_saved" in actual
        for key in expected.keys() - TIMING - {"loss"}:  # every metric TRL logs, with the stock trainer's values
            if not key.startswith("prefixflow/"):
                assert actual[key] == pytest.approx(expected[key], rel=metric_rtol, abs=1e-5), key


def run_lengths(logs) -> set[float]:
    return {log["prefixflow/run_microbatches"] for log in logs if "prefixflow/run_microbatches" in log}


def both(tmp_path, model_factory=setup.make_model, **kwargs):
    base = model_factory()
    stock = train(GRPOTrainer, copy.deepcopy(base) if not isinstance(base, str) else base, tmp_path, **kwargs)
    pf = train(PrefixFlowGRPOTrainer, copy.deepcopy(base) if not isinstance(base, str) else base, tmp_path, **kwargs)
    return stock, pf


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches_stock(tmp_path, loss_type, geometry):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    stock, pf = both(tmp_path, loss_type=loss_type, **extra, **GEOMETRIES[geometry])
    assert_aligned(stock, pf)
    assert run_lengths(pf[2]) == ({2.0} if geometry == "merged-runs" else {1.0})


def test_a_run_with_one_normaliser_for_its_microbatches_is_caught(tmp_path, monkeypatch):
    """Merged microbatches must keep their own loss normalisers: TRL's loss over a run as one batch (grpo: the mean
    over the run's sequences, not the sum of each microbatch's mean) leaves the stock gradients."""

    def one_loss(self, model, run, logps, entropies):
        merged = {key: torch.cat([mb[key] for mb in run]) if isinstance(value, torch.Tensor) and value.ndim else value
                  for key, value in run[0].items()}
        self._served = (logps, entropies)
        whole = GRPOTrainer._compute_loss(self, model, merged)
        return [whole] + [whole.detach() * 0] * (len(run) - 1)

    monkeypatch.setattr(PrefixFlowGRPOTrainer, "_microbatch_losses", one_loss)
    with pytest.raises(AssertionError, match="grad"):
        assert_aligned(*both(tmp_path, loss_type="grpo", **GEOMETRIES["merged-runs"]))


def test_sequence_importance_sampling_and_clipping(tmp_path):
    assert_aligned(*both(tmp_path, importance_sampling_level="sequence", epsilon=0.1, epsilon_high=0.3,
                         num_iterations=2, steps=2))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_kl_with_a_reference_model(tmp_path, geometry):
    path = tmp_path / "policy"
    setup.make_model().save_pretrained(path)
    setup.make_tokenizer().save_pretrained(path)
    assert_aligned(*both(tmp_path, model_factory=lambda: str(path), beta=0.1, steps=2, **GEOMETRIES[geometry]))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_lora_with_kl_through_disabled_adapters(tmp_path, geometry):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)
    stock, pf = both(tmp_path, peft_config=lora, beta=0.05, steps=2, **GEOMETRIES[geometry])
    assert all("lora_" in n for n in stock[0][0])
    assert_aligned(stock, pf)


def test_gradient_accumulation_with_groups_spanning_microbatches(tmp_path, monkeypatch):
    """per_device_train_batch_size=2 with num_generations=4: each prompt's cache serves two microbatches."""
    opened = []
    original_open = pf_mixin.GroupSession.open
    monkeypatch.setattr(pf_mixin.GroupSession, "open",
                        lambda self, *a, **k: opened.append(1) or original_open(self, *a, **k))
    stock, pf = both(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, steps=2,
                     config_cls=PrefixFlowGRPOConfig, prefixflow_merge_microbatches="1")
    assert_aligned(stock, pf)
    assert len(opened) == 2 * 2  # 2 steps x 2 prompts, not one prefix pass per microbatch
    assert run_lengths(pf[2]) == {1.0}


@pytest.mark.parametrize("batch, groups, accumulation", [(4, 6, 3), (6, 4, 2), (4, 6, 1)],
                         ids=["4-rows-of-6", "6-rows-of-4", "across-optimizer-steps"])
@pytest.mark.parametrize("merge", ["auto", "1"])
def test_groups_split_unevenly_across_microbatches(tmp_path, batch, groups, accumulation, merge):
    """Microbatches need not hold whole groups or divide them: a prompt's cache serves each microbatch that reads
    it within an accumulation window; across an optimizer step the prompt runs forward again with the new weights."""
    stock, pf = both(tmp_path, per_device_train_batch_size=batch, num_generations=groups, steps=3,
                     gradient_accumulation_steps=accumulation, steps_per_generation=3 if accumulation == 1 else None,
                     config_cls=PrefixFlowGRPOConfig, prefixflow_merge_microbatches=merge)
    assert_aligned(stock, pf)
    assert not any(log.get("prefixflow/fallback_rows") for log in pf[2])
    assert run_lengths(pf[2]) == ({float(accumulation)} if merge == "auto" else {1.0})


def test_a_generation_inside_an_accumulation_window(tmp_path):
    """steps_per_generation below gradient_accumulation_steps: a run ends with its generation batch; the window's
    next microbatches come from a new one."""
    stock, pf = both(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, steps_per_generation=2,
                     steps=2)
    assert_aligned(stock, pf)
    assert run_lengths(pf[2]) == {2.0}


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_steps_per_generation_and_num_iterations(tmp_path, geometry):
    """Old-policy log-probs are computed here (scoring pass, forward only): they reuse the prefix too."""
    size = GEOMETRIES[geometry]["per_device_train_batch_size"] // 2  # 4: a group per microbatch; 1: four per group
    stock, pf = both(tmp_path, per_device_train_batch_size=size, gradient_accumulation_steps=8 // size,
                     steps_per_generation=16 // size, num_iterations=2, steps=4)
    assert_aligned(stock, pf)
    assert max(run_lengths(pf[2])) > 1 if size == 1 else run_lengths(pf[2]) == {1.0}
    assert any(log.get("prefixflow/scoring_groups") for log in pf[2])


def test_entropy_bonus_two_sided_clipping_off_policy_mask_and_fp32_head(tmp_path):
    assert_aligned(*both(tmp_path, entropy_coef=0.01, delta=1.5, off_policy_mask_threshold=0.5, num_iterations=2,
                         cast_lm_head_to_fp32=True, steps=2))


def test_checkpoints_are_plain_transformers_checkpoints(tmp_path):
    """What PrefixFlowGRPOTrainer saves loads with from_pretrained into an ordinary model, like GRPOTrainer's."""
    from transformers import AutoModelForCausalLM

    train(PrefixFlowGRPOTrainer, setup.make_model(), tmp_path, steps=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "PrefixFlowGRPOTrainer" / "checkpoint-2"
    assert "prefixflow" not in (checkpoint / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config._attn_implementation in ("sdpa", "eager")


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_entropy_masking_and_checkpointing(tmp_path, geometry):
    assert_aligned(*both(tmp_path, top_entropy_quantile=0.5, gradient_checkpointing=True, steps=2,
                         **GEOMETRIES[geometry]))


def test_adaptive_entropy_bonus_updates_at_the_window_end(tmp_path):
    """TRL's adaptive entropy controller reads the window's entropy at its last microbatch; a run computes that
    microbatch's loss early, with the window's end signalled as TRL would."""
    stock, pf = both(tmp_path, use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0, steps=3,
                     **GEOMETRIES["merged-runs"])
    assert_aligned(stock, pf)
    assert [log["entropy_coef"] for log in pf[2] if "loss" in log] == pytest.approx([0.015, 0.02, 0.025])


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_packed_layout_and_trajectory_over_steps(tmp_path, geometry):
    stock, pf = both(tmp_path, steps=4, config_cls=PrefixFlowGRPOConfig, prefixflow_layout="packed",
                     **GEOMETRIES[geometry])
    assert_aligned(stock, pf)


def test_prefix_activation_offload_in_the_trainer(tmp_path):
    stock, pf = both(tmp_path, steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                     config_cls=PrefixFlowGRPOConfig, prefixflow_offload=True)
    assert_aligned(stock, pf)
    logged = [log for log in pf[2] if "loss" in log]
    assert all(log["prefixflow/host_pool_gib"] > 0 and log["prefixflow/pin_fallbacks"] == 0 for log in logged)


def test_streamed_prompt_kv_in_the_trainer(tmp_path, monkeypatch):
    """prefixflow_offload_kv: the prompt's K/V and gK/gV wait on the host; the stock trainer's gradients, weights and
    metrics, with the model's checkpointing and without."""
    parked = []
    park = offload.PrefixOffload.park
    monkeypatch.setattr(offload.PrefixOffload, "park", lambda self, t: parked.append(1) or park(self, t))
    for checkpointing in (True, False):
        assert_aligned(*both(tmp_path / str(checkpointing), steps=2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, gradient_checkpointing=checkpointing,
                             config_cls=PrefixFlowGRPOConfig, prefixflow_offload_kv=True))
    assert parked


def test_the_host_budget_is_shared_by_the_node_s_processes(monkeypatch):
    """Every process of a node reads the same available memory: each pool plans within its share of it, plus its
    own free buffers (which the next run reuses)."""
    model = setup.make_model()
    monkeypatch.setattr(pf_mixin, "available_host_bytes", lambda: 8e9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pf_mixin.free_host_bytes(model) == pytest.approx(pf_mixin.AUTO_OFFLOAD_MARGIN * 2e9)
    pool = model._prefixflow_pool = offload.HostPool(pin=False)
    pool.give(pool.take(1000))
    assert pf_mixin.free_host_bytes(model) == pytest.approx(pf_mixin.AUTO_OFFLOAD_MARGIN * (2e9 + 1000))
    monkeypatch.setattr(pf_mixin, "available_host_bytes", lambda: None)
    assert pf_mixin.free_host_bytes(model) is None


@pytest.mark.parametrize("budget, mode, recomputed", [(float("inf"), 0.0, 0.0), ("no room to keep", 0.0, 1.0),
                                                     (0.0, 1.0, 1.0), ("kv", 2.0, 1.0), ("no host memory", 0.0, 1.0)])
def test_automatic_offload_follows_the_free_memory(tmp_path, monkeypatch, budget, mode, recomputed):
    """prefixflow_offload_auto: each run's new groups get the cheapest offload mode the planner fits in the free
    device memory: none when plenty is free; when nothing fits, the one needing least (for this two-layer model
    offload, which streaming the K/V would not beat), unless the host has no memory for the pool; K/V on the host
    where the planner says so (forced here). The
    'auto' suffix policy keeps the waves' activations only where no offload was needed and keeping them fits the
    same free memory (the room to keep them taken away here). The stock trainer's gradients, weights and metrics in
    every case."""
    budgets = []
    # Within the stock microbatch's memory keeping fits (the 'auto' policy's other bound, planner-tested).
    monkeypatch.setattr(pf_mixin, "keeps_suffix_activations", lambda *args, **kwargs: True)
    if budget == "kv":
        monkeypatch.setattr(pf_mixin, "offload_for", lambda *args, **kwargs: (True, True))
    if budget == "no room to keep":
        need = pf_mixin.run_need
        monkeypatch.setattr(pf_mixin, "run_need", lambda *args, **kwargs: float("inf")
                            if kwargs.get("suffix_checkpointing") is False else need(*args, **kwargs))
    if budget == "no host memory":
        monkeypatch.setattr(pf_mixin, "free_host_bytes", lambda model: 0.0)
    free = 0.0 if budget in ("kv", "no host memory") else 1e30 if budget == "no room to keep" else budget
    monkeypatch.setattr(pf_mixin, "free_device_bytes", lambda model: budgets.append(free) or free)
    stock, pf = both(tmp_path, steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                     gradient_checkpointing=True, config_cls=PrefixFlowGRPOConfig, prefixflow_offload_auto=True)
    assert_aligned(stock, pf)
    assert budgets and {log["prefixflow/offload"] for log in pf[2] if "loss" in log} == {mode}
    # Offloaded as planned with the waves recomputing (kept activations would hold streamed K/V); kept with room.
    assert {log["prefixflow/suffix_checkpointing"] for log in pf[2] if "loss" in log} == {recomputed}
    with pytest.raises(PrefixFlowError, match="prefixflow_offload_auto picks"):
        both(tmp_path / "refused", steps=1, config_cls=PrefixFlowGRPOConfig, prefixflow_offload_auto=True,
             prefixflow_offload=True)


def rule(engine: str = "ddp") -> engine_rule.EngineRule:
    """A stand-in trainer's engine rule: `ddp`, `zero` or `fsdp2` (checks of their configs pass)."""
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, mixed_precision="no",
                                  state=SimpleNamespace(fsdp_plugin=None))
    return {"ddp": engine_rule.DataParallel, "zero": engine_rule.ZeRO, "fsdp2": engine_rule.FSDP2}[engine](accelerator)


@pytest.mark.parametrize("engine", [{"engine": "zero"}, {"engine": "fsdp2"}, {"_sp": object()}, {"_split": True}])
def test_streamed_prompt_kv_is_refused_where_processes_share_kv(engine, monkeypatch):
    settings = {"engine": "ddp", "_sp": None, "_split": False, **engine}
    monkeypatch.setattr(pf_mixin, "check_geometry", lambda *args, can_split: settings["_split"])
    monkeypatch.setattr(pf_mixin.sequence_parallel, "setup", lambda trainer, size: settings["_sp"])
    fake = SimpleNamespace(_engine=rule(settings["engine"]), num_generations=2,
                           args=SimpleNamespace(per_device_train_batch_size=2, steps_per_generation=1,
                                                prefixflow_offload_kv=True))
    with pytest.raises(PrefixFlowError, match="prefixflow_offload_kv streams each process's prompt K/V"):
        PrefixFlowGRPOTrainer._check_supported(fake)


def test_suffix_activations_kept_under_checkpointing(tmp_path):
    assert_aligned(*both(tmp_path, steps=2, gradient_checkpointing=True, config_cls=PrefixFlowGRPOConfig,
                         prefixflow_suffix_checkpointing=False))


@pytest.mark.parametrize("batch, accumulation, recomputed", [(8, 1, 0.0), (1, 8, 1.0)])
def test_auto_suffix_checkpointing_keeps_activations_where_they_fit(tmp_path, monkeypatch, batch, accumulation,
                                                                    recomputed):
    """prefixflow_suffix_checkpointing='auto' (the default) under gradient checkpointing: a run whose suffix
    activations fit in the memory of TRL's microbatch of full sequences keeps them (its waves run with the model's
    checkpointing suspended), otherwise they are recomputed; gradients, weights and metrics are the stock trainer's
    either way."""
    suspended = []
    inner = scheduler.checkpointing_suspended
    monkeypatch.setattr(scheduler, "checkpointing_suspended", lambda model: suspended.append(1) or inner(model))
    stock, pf = both(tmp_path, gradient_checkpointing=True, per_device_train_batch_size=batch,
                     gradient_accumulation_steps=accumulation)
    assert_aligned(stock, pf)
    assert {log["prefixflow/suffix_checkpointing"] for log in pf[2] if "loss" in log} == {recomputed}
    assert bool(suspended) == (recomputed == 0.0)


@pytest.mark.parametrize("engine", [{}, {"engine": "zero"}, {"engine": "fsdp2"}, {"_sp": object()},
                                    {"checkpointing": False}, {"offload_kv": True}])
def test_auto_suffix_checkpointing_stays_off_where_ranks_must_recompute_alike(engine):
    """'auto' decides from each rank's rows; under engines whose recompute runs collectives (ZeRO-3 and FSDP gather
    weights, Ulysses exchanges heads) that could hang, so it keeps the model's checkpointing there; and with
    offload_kv, where kept activations would hold every layer's streamed K/V through a wave."""
    settings = {"engine": "ddp", "_sp": None, "checkpointing": True, "offload_kv": False, **engine}
    fake = SimpleNamespace(prefixflow_suffix_checkpointing="auto", _engine=rule(settings["engine"]),
                           _sp=settings["_sp"], model=torch.nn.Linear(1, 1),
                           prefixflow_offload_kv=settings["offload_kv"],
                           args=SimpleNamespace(gradient_checkpointing=settings["checkpointing"]))
    decided = PrefixFlowGRPOTrainer._check_suffix_checkpointing(fake)
    assert decided == ("auto" if engine == {} else True)
    fake.prefixflow_suffix_checkpointing = "sometimes"
    with pytest.raises(PrefixFlowError, match="True, False or 'auto'"):
        PrefixFlowGRPOTrainer._check_suffix_checkpointing(fake)


def test_default_adamw_trajectory_stays_aligned(tmp_path):
    stock, pf = both(tmp_path, steps=3, optim="adamw_torch", learning_rate=1e-3)
    for name in stock[1]:
        torch.testing.assert_close(pf[1][name], stock[1][name], rtol=0, atol=2e-5, msg=name)


def test_a_bad_merge_setting_is_refused(tmp_path):
    with pytest.raises(PrefixFlowError, match="prefixflow_merge_microbatches"):
        train(PrefixFlowGRPOTrainer, setup.make_model(), tmp_path, config_cls=PrefixFlowGRPOConfig,
              prefixflow_merge_microbatches="0")


def test_reentrant_checkpointing_is_refused(tmp_path):
    with pytest.raises(PrefixFlowError, match="use_reentrant"):
        train(PrefixFlowGRPOTrainer, setup.make_model(), tmp_path, gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"use_reentrant": True})


def test_prompts_that_differ_within_a_group_are_refused():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 4]])
    batch = {"prompt_ids": ids, "prompt_mask": (ids != 0).long()}
    with pytest.raises(PrefixFlowError, match="prompt tokens differ"):
        check_group_prompts(batch, 2)
    check_group_prompts({"prompt_ids": ids[:2], "prompt_mask": (ids[:2] != 0).long()}, 2)


def test_a_trainer_that_skips_phase_c_is_caught(tmp_path, monkeypatch):
    model = setup.make_model()
    model.config.use_cache = False  # as the trainer sets it: the probe's cache key is the config
    apply_prefixflow(model)  # the probe first, on the real code: under the patch it would refuse the model instead
    monkeypatch.setattr("hf_prefixflow.core.scheduler.delayed_backward", lambda caches, *args: 0)
    with pytest.raises(AssertionError, match="grad"):
        assert_aligned(*both(tmp_path))


def _moe_run(trainer_cls, tmp_path, router_aux_loss=False, model_factory=setup.make_moe_model, prepare=None,
             rollout_func=None, **overrides):
    """Real generation (recorded routes) on a tiny Qwen3-MoE; the same seed gives both trainers the same samples.
    `prepare(trainer)` runs before training; `rollout_func` is TRL's custom rollout."""
    options = dict(output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=4, num_generations=4,
                   gradient_accumulation_steps=2, max_completion_length=6, max_steps=2, report_to="none",
                   logging_steps=1, use_cpu=True, save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3,
                   bf16=False, max_grad_norm=0.0, router_aux_loss_coef=None if router_aux_loss else 0.0)
    options.update(overrides)
    trainer = trainer_cls(model=model_factory(), reward_funcs=setup.length_reward, args=PrefixFlowGRPOConfig(**options),
                          train_dataset=setup.make_dataset(prompts=6), processing_class=setup.make_tokenizer(),
                          rollout_func=rollout_func)
    if prepare is not None:
        prepare(trainer)
    recorder = setup.GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, weights, trainer.state.log_history


def test_moe_routes_recorded_in_generation_are_replayed(tmp_path):
    """Prefix groups replay the routes generation recorded, exactly as the plain path replaying the same routes;
    in fp32 generation routes what training would, so both also agree with the stock trainer."""
    # Generation's routes are replayed for four steps: clipped updates stay too small to flip a route, which fresh
    # routing (the stock trainer) would then pick otherwise, by design.
    options = {"num_iterations": 2, "steps_per_generation": 4, "max_steps": 4, "max_grad_norm": 1.0}
    shared = _moe_run(PrefixFlowGRPOTrainer, tmp_path, **options)
    plain = _moe_run(PrefixFlowGRPOTrainer, tmp_path, **options,
                     prefixflow_min_speedup=1e9)  # every row on the plain path, still replaying
    assert any(log.get("prefixflow/fallback_rows") for log in plain[2])
    assert_aligned(plain, shared)
    assert not any(log.get("prefixflow/fallback_rows") for log in shared[2])
    stock = _moe_run(GRPOTrainer, tmp_path, **options)
    assert_aligned(stock, shared, metric_rtol=1e-3)  # a near-tie routed otherwise in generation moves the entropy


@pytest.mark.parametrize("spanning", [False, True], ids=["group-per-microbatch", "group-spans-microbatches"])
def test_moe_router_aux_loss_composes_across_prefix_and_suffixes(tmp_path, spanning):
    """The load-balancing loss sees the prefix once per row, exactly as the full-sequence batch does: prefix router
    logits are cached leaves whose gradient reaches the prefix graph in Phase C."""
    geometry = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4} if spanning else {}
    stock = _moe_run(GRPOTrainer, tmp_path, router_aux_loss=True, **geometry)
    pf = _moe_run(PrefixFlowGRPOTrainer, tmp_path, router_aux_loss=True, **geometry)
    assert not any(log.get("prefixflow/fallback_rows") for log in pf[2])
    assert all(log["aux_loss"] > 0 for log in pf[2] if "loss" in log)
    assert_aligned(stock, pf)
    for expected, actual in zip(stock[2], pf[2]):
        if "aux_loss" in expected:
            assert actual["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-5)


def test_moe_replay_off_routes_afresh(tmp_path):
    assert_aligned(_moe_run(GRPOTrainer, tmp_path),
                   _moe_run(PrefixFlowGRPOTrainer, tmp_path, prefixflow_routing_replay=False))


def test_moe_replay_in_merged_runs(tmp_path):
    """A run's microbatches carry their rows' routes; merged, each group's rows replay theirs in one wave."""
    stock = _moe_run(GRPOTrainer, tmp_path, **GEOMETRIES["merged-runs"])
    pf = _moe_run(PrefixFlowGRPOTrainer, tmp_path, **GEOMETRIES["merged-runs"])
    assert_aligned(stock, pf)
    assert run_lengths(pf[2]) == {2.0}


def test_moe_with_tool_calls_replays_each_rows_first_turn(tmp_path, monkeypatch):
    """TRL's tool loop (simulated: the tiny tokenizer has no chat template for tools) generates again after a tool
    result, from prompts the recording does not cover: each row replays its prompt and first turn, and its tool
    result and later turn route afresh (warned, counted in fallback_rows), as GRPOTrainer routes them."""
    from hf_prefixflow.trainers import routing

    calls = []
    first_turn_only = routing.first_turn_only
    monkeypatch.setattr(routing, "first_turn_only", lambda *args: calls.append(args[2]) or first_turn_only(*args))
    turns = {"prepare": setup.simulate_tool_calls, "max_completion_length": 12,
             "generation_kwargs": {"max_new_tokens": 4}}  # first turns of at most 4 tokens leave room for the rest
    stock, pf = _moe_run(GRPOTrainer, tmp_path, **turns), _moe_run(PrefixFlowGRPOTrainer, tmp_path, **turns)
    assert_aligned(stock, pf)
    assert calls and any(log.get("prefixflow/fallback_rows") for log in pf[2])
    assert any(log.get("tools/call_frequency") for log in pf[2])


def test_moe_with_custom_rollouts_routes_afresh(tmp_path):
    """Custom rollouts (TRL's rollout_func) record no routes: their rows route afresh (warned, counted) and still
    share their prompt."""
    stock = _moe_run(GRPOTrainer, tmp_path, rollout_func=setup.frozen_rollout_func)
    pf = _moe_run(PrefixFlowGRPOTrainer, tmp_path, rollout_func=setup.frozen_rollout_func)
    assert_aligned(stock, pf)
    assert all(log.get("prefixflow/fallback_rows") == 8 for log in pf[2] if "loss" in log)


def test_gpt_oss_with_router_aux_loss(tmp_path):
    """gpt-oss (attention sinks, sliding and full layers) with its load-balancing loss trains as GRPOTrainer does."""
    stock = _moe_run(GRPOTrainer, tmp_path, router_aux_loss=True, model_factory=setup.make_gpt_oss_model)
    pf = _moe_run(PrefixFlowGRPOTrainer, tmp_path, router_aux_loss=True, model_factory=setup.make_gpt_oss_model)
    assert all(log["aux_loss"] > 0 for log in pf[2] if "loss" in log)
    assert_aligned(stock, pf, shared=False, metric_rtol=1e-3)  # under replay a near-tie may route otherwise


def test_router_aux_loss_of_a_router_prefixflow_does_not_read(tmp_path, monkeypatch):
    """A router moe.py does not know (no logits captured, no replay): a microbatch with the load-balancing loss
    takes the plain path (warned, counted in fallback_rows), equal to GRPOTrainer."""
    from hf_prefixflow.core import moe

    monkeypatch.setattr(moe, "routers", lambda model: [])
    stock = _moe_run(GRPOTrainer, tmp_path, router_aux_loss=True)
    pf = _moe_run(PrefixFlowGRPOTrainer, tmp_path, router_aux_loss=True)
    assert all(log.get("prefixflow/fallback_rows") == 4 for log in pf[2] if "loss" in log)
    assert_aligned(stock, pf, shared=False)


def test_moe_trainer_really_replays_the_recorded_routes(tmp_path, monkeypatch):
    """Shift every recorded expert by one: a trainer that replays must now leave the stock trajectory."""
    from hf_prefixflow.trainers import routing

    assemble = routing.assemble
    monkeypatch.setattr(routing, "assemble", lambda *args: (assemble(*args) + 1) % 4)
    stock, shifted = _moe_run(GRPOTrainer, tmp_path), _moe_run(PrefixFlowGRPOTrainer, tmp_path)
    with pytest.raises(AssertionError):
        assert_aligned(stock, shifted)


def test_suffix_waves_of_a_fixed_size(tmp_path):
    stock, pf = both(tmp_path, steps=2, config_cls=PrefixFlowGRPOConfig, prefixflow_wave_size="3")
    assert_aligned(stock, pf)
    assert [log["prefixflow/wave_size"] for log in pf[2] if "loss" in log] == [2.0, 2.0]  # groups of 4: waves 3 + 1


def test_automatic_wave_size_needs_cuda(tmp_path):
    with pytest.raises(PrefixFlowError, match="reads free CUDA memory"):
        train(PrefixFlowGRPOTrainer, setup.make_model(), tmp_path, config_cls=PrefixFlowGRPOConfig,
              prefixflow_wave_size="auto")


def test_kv_grad_dtype_setting():
    """gK/gV sums: the weights' own precision by default, fp32 under DeepSpeed (its grad_accum_dtype default), a named
    dtype when set; anything else is refused."""
    pick = PrefixFlowGRPOTrainer._kv_grad_dtype
    assert pick(SimpleNamespace(prefixflow_kv_grad_dtype=None, _engine=rule("ddp"))) is None
    assert pick(SimpleNamespace(prefixflow_kv_grad_dtype=None, _engine=rule("fsdp2"))) is None
    assert pick(SimpleNamespace(prefixflow_kv_grad_dtype=None, _engine=rule("zero"))) == torch.float32
    assert pick(SimpleNamespace(prefixflow_kv_grad_dtype="bfloat16", _engine=rule("zero"))) == torch.bfloat16
    with pytest.raises(PrefixFlowError, match="prefixflow_kv_grad_dtype"):
        pick(SimpleNamespace(prefixflow_kv_grad_dtype="int8", _engine=rule("ddp")))


def test_torch_compile_compiles_each_decoder_layer_and_generates_eagerly(tmp_path, monkeypatch, caplog, recwarn):
    """`torch_compile=True`: Accelerate would compile the whole model, which PrefixFlow's phases cannot run through;
    each decoder layer is compiled in place instead (10 layers: past the recompile limit, were any layer its own
    graph), generation runs eagerly, and training with offload matches the stock trainer's (whole model compiled)."""
    stances = []
    frozen = setup.freeze_rollouts

    def freeze(trainer, max_length, **kwargs):  # sampling frozen one level down, so the trainer's own override runs
        frozen(trainer, max_length, **kwargs)
        generate = trainer.__dict__.pop("_generate_single_turn")
        monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", lambda self, *args: (
            stances.append((type(self), torch._dynamo.eval_frame._stance.stance)), generate(*args))[1])

    monkeypatch.setattr(setup, "freeze_rollouts", freeze)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
            caplog.at_level("INFO", logger="hf_prefixflow.trainers"):
        stock, pf = both(tmp_path, model_factory=lambda: setup.make_model(num_hidden_layers=10), steps=2,
                         torch_compile=True, torch_compile_backend="aot_eager", config_cls=PrefixFlowGRPOConfig,
                         prefixflow_offload=True)  # the prefix layers then recomputed by PrefixFlow, compiled
        assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT  # undone as the patch exits
    torch._dynamo.reset()
    assert_aligned(stock, pf)
    assert "compiles each of the 10 decoder layers" in caplog.text and "raises torch._dynamo" in caplog.text
    assert not [w for w in recwarn if "run uncompiled" in str(w.message)]  # no layer fell back to the checkpoint
    assert {stance for cls, stance in stances if cls is PrefixFlowGRPOTrainer} == {"force_eager"}
    assert {stance for cls, stance in stances if cls is GRPOTrainer} == {"default"}


@pytest.mark.parametrize("engine", ["zero", "fsdp2"])
def test_torch_compile_under_deepspeed_or_fsdp_is_refused(engine):
    trainer = SimpleNamespace(_engine=rule(engine), model=setup.make_model(), ref_model=None)
    with pytest.raises(PrefixFlowError, match="torch_compile with DeepSpeed or FSDP"):
        PrefixFlowGRPOTrainer._compile_layers(trainer)
