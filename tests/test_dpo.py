"""PrefixFlowDPOTrainer against TRL's DPOTrainer: same float64 model, seed, data and config.

TRL's fused LM head computes its log-softmax in float32 whatever the model's dtype, so the two trainers agree to
float32 rounding (about 1e-7 relative), well inside the suite's 1e-5; the broken variants miss by orders more.
"""

from __future__ import annotations

import copy
import os
import pathlib
import random
import sys

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer

import grpo_setup as setup
from equivalence import assert_rel_close
from hf_prefixflow import PrefixFlowDPOConfig, PrefixFlowDPOTrainer, _compat
from hf_prefixflow.core.recompute import decoder_layers
from hf_prefixflow.core.scheduler import PrefixGroup
from hf_prefixflow.trainers import dpo as pf_dpo

# Every loss TRL 1.16's DPOTrainer offers, with the settings each needs.
LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
LOSS_SETTINGS = {"exo_pair": {"label_smoothing": 1e-3}, "robust": {"label_smoothing": 0.1},
                 "aot": {"label_smoothing": 0.1}, "aot_unpaired": {"label_smoothing": 0.1}}
# Variants on top of a loss: f-divergences, LD-DPO's ld_alpha, WPO weighting, weighted combinations.
VARIANTS = {
    "forward_kl": {"loss_types": ["sigmoid"], "f_divergence_type": "forward_kl"},
    "js_divergence": {"loss_types": ["hinge"], "f_divergence_type": "js_divergence"},
    "alpha_divergence": {"loss_types": ["ipo"], "f_divergence_type": "alpha_divergence",
                         "f_alpha_divergence_coef": 0.5},
    "ld_alpha": {"loss_types": ["sigmoid"], "ld_alpha": 0.3},
    "weighting": {"loss_types": ["sigmoid"], "use_weighting": True},
    "combined": {"loss_types": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
}


def make_dataset(pairs: int = 8, seed: int = 0, prompt_words=(14, 30), bos_only: bool = True) -> Dataset:
    """Text pairs of uneven lengths; some open their two responses identically (the common prefix reaches into the
    responses), and the first, if `bos_only`, shares nothing but the BOS token."""
    rng = random.Random(seed)
    words = lambda n: [rng.choice(setup.WORDS) for _ in range(n)]  # noqa: E731
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(pairs):
        opening = words(rng.choice([0, 0, 2, 4]))
        chosen, rejected = opening + words(rng.randint(1, 7)), opening + words(rng.randint(1, 7))
        if chosen == rejected:
            rejected = rejected + ["w0"]
        prompt = "<bos>" if bos_only and i == 0 else " ".join(["<bos>"] + words(rng.randint(*prompt_words)))
        if bos_only and i == 0:
            chosen[0], rejected[0] = "w1", "w2"
        rows["prompt"].append(prompt)
        rows["chosen"].append(" " + " ".join(chosen + ["<eos>"]))
        rows["rejected"].append(" " + " ".join(rejected + ["<eos>"]))
    return Dataset.from_dict(rows)


class GradientRecorder(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})


def options(tmp_path, **overrides) -> dict:
    # SGD and no clipping: the updates are linear in the gradients, so their tolerance carries over to the weights.
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to="none", use_cpu=True,
                save_strategy="no", learning_rate=0.5, optim="sgd", seed=3, bf16=False, max_grad_norm=0.0,
                logging_steps=1, gradient_checkpointing=False, beta=0.5, disable_tqdm=True)
    base.update(overrides)
    return base


def build(trainer_cls, base, tmp_path, peft_config=None, ref=True, dataset=None, prefixflow=None, **overrides):
    if trainer_cls is PrefixFlowDPOTrainer:
        args = PrefixFlowDPOConfig(**options(tmp_path / "pf", **overrides),
                                   **{"prefixflow_min_prefix_tokens": 2, **(prefixflow or {})})
    else:
        args = DPOConfig(**options(tmp_path / "stock", **overrides))
    ref_model = None if peft_config is not None else copy.deepcopy(base if ref is True else ref)
    return trainer_cls(model=copy.deepcopy(base), ref_model=ref_model, args=args,
                       train_dataset=dataset if dataset is not None else make_dataset(),
                       processing_class=setup.make_tokenizer(), peft_config=peft_config)


def train(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, start, weights, trainer.state.log_history


def assert_aligned(stock, prefixflow, rtol=1e-5):
    """Loss at every step, every gradient before every optimizer step, and every weight's total update."""
    (stock_grads, start, stock_weights, stock_logs), (pf_grads, _, pf_weights, pf_logs) = stock, prefixflow
    assert len(stock_grads) == len(pf_grads) > 0
    for step, (expected, actual) in enumerate(zip(stock_grads, pf_grads)):
        assert expected.keys() == actual.keys() and expected
        for name in expected:
            assert_rel_close(actual[name], expected[name], f"step {step} grad {name}", rtol)
    for name in stock_weights:
        assert_rel_close(pf_weights[name] - start[name], stock_weights[name] - start[name], f"update {name}", rtol)
    losses = [(e["loss"], a["loss"]) for e, a in zip(stock_logs, pf_logs) if "loss" in e]
    assert losses
    for step, (expected, actual) in enumerate(losses):
        assert_rel_close(actual, expected, f"step {step} loss", rtol)


def metric(logs, key) -> float:
    return sum(log.get(key, 0.0) for log in logs)


@pytest.fixture(scope="module")
def base():
    return setup.make_model(dtype=torch.float64)


# -- training runs against the stock trainer ----------------------------------------------------------------------


TRAINING = {"sigmoid": {}, "ipo": {"loss_type": ["ipo"]}, "aot": {"loss_type": ["aot"], "label_smoothing": 0.1},
            "accumulation": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
            "checkpointing": {"gradient_checkpointing": True},  # TRL's default
            "pad_to_multiple_of": {"pad_to_multiple_of": 8},  # longer right padding: pairs found from real tokens
            "padding_free": {"padding_free": True}}  # TRL 1.16 falls back to padding (warned): the swap follows


@pytest.mark.parametrize("case", TRAINING)
def test_training_matches_stock(one_thread, base, tmp_path, case):
    """Loss, gradients and weights over optimizer steps; uneven lengths, identical response openings, a pair that
    shares only BOS (plain path under the default threshold); 'accumulation': two microbatches per step."""
    overrides = TRAINING[case]
    stock = train(build(DPOTrainer, base, tmp_path, **overrides))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, **overrides))
    assert_aligned(stock, pf)
    logs = pf[3]
    assert metric(logs, "prefixflow/groups") > 0 and metric(logs, "prefixflow/scoring_groups") > 0
    assert metric(logs, "prefixflow/fallback_rows") > 0  # the BOS-only pair, below prefixflow_min_prefix_tokens=2


def test_lora_reference_through_the_disabled_adapter(one_thread, base, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    stock = train(build(DPOTrainer, base, tmp_path, peft_config=lora, learning_rate=2.0, max_steps=3))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, peft_config=lora, learning_rate=2.0, max_steps=3))
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/scoring_groups") > 0  # the reference pass shared too, adapter disabled


def test_precomputed_reference_log_probs(one_thread, base, tmp_path):
    """`precompute_ref_log_probs`: the reference pass runs inside DPOTrainer.__init__, through no-grad groups."""
    stock_trainer = build(DPOTrainer, base, tmp_path, precompute_ref_log_probs=True)
    pf_trainer = build(PrefixFlowDPOTrainer, base, tmp_path, precompute_ref_log_probs=True)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        assert_rel_close(torch.tensor(pf_trainer.train_dataset[column]),
                         torch.tensor(stock_trainer.train_dataset[column]), column)
    assert pf_trainer._metrics["train"]["prefixflow/scoring_groups"]
    assert_aligned(train(stock_trainer), train(pf_trainer))


def test_evaluation_matches_stock(one_thread, base, tmp_path):
    """`evaluate`: the policy and reference passes score through no-grad groups."""
    dataset = make_dataset(pairs=4, seed=1)
    expected = build(DPOTrainer, base, tmp_path).evaluate(eval_dataset=dataset)
    actual = build(PrefixFlowDPOTrainer, base, tmp_path).evaluate(eval_dataset=dataset)
    for key in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_entropy"):
        assert actual[key] == pytest.approx(expected[key], rel=1e-5), key
    assert actual["eval_prefixflow/scoring_groups"] > 0


def test_bos_only_pair_stays_exact_when_shared(one_thread, base, tmp_path):
    """With no threshold the BOS-only pair runs as a group of one prefix token (nothing cached): still exact."""
    dataset = make_dataset(pairs=4)
    stock = train(build(DPOTrainer, base, tmp_path, dataset=dataset, max_steps=1))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, dataset=dataset, max_steps=1,
                     prefixflow={"prefixflow_min_prefix_tokens": 1, "prefixflow_min_speedup": 0.0}))
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/fallback_rows") == 0


# -- every loss: one microbatch's loss and gradients, on trainers built once ------------------------------------


@pytest.fixture(scope="module")
def scoring_pair(base, tmp_path_factory):
    """A stock and a PrefixFlow trainer on the same batch, the reference model perturbed so the log-ratios are not
    zero; WPO weighting asks TRL's head for the extra field it reads."""
    tmp_path = tmp_path_factory.mktemp("dpo_losses")
    reference = copy.deepcopy(base)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(5), dtype=param.dtype))
    trainers = []
    for cls in (DPOTrainer, PrefixFlowDPOTrainer):
        trainers.append(build(cls, base, tmp_path, ref=reference, use_weighting=True))
    batch = next(iter(trainers[0].get_train_dataloader()))
    return trainers, batch


def loss_and_gradients(trainer, batch, settings: dict):
    defaults = {"loss_types": ["sigmoid"], "loss_weights": None, "f_divergence_type": "reverse_kl",
                "f_alpha_divergence_coef": 1.0, "ld_alpha": None, "use_weighting": False, "label_smoothing": 0.0}
    for name, value in {**defaults, **settings}.items():
        setattr(trainer, name, value)
    trainer.loss_weights = trainer.loss_weights or [1.0] * len(trainer.loss_types)
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    if isinstance(trainer, PrefixFlowDPOTrainer):
        trainer._end_session()  # Phase C, as training_step runs it after the backward
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


CASES = {name: {"loss_types": [name], **LOSS_SETTINGS.get(name, {})} for name in LOSS_TYPES} | VARIANTS


@pytest.mark.parametrize("case", CASES)
def test_every_loss_type_matches_stock(one_thread, scoring_pair, case):
    (stock, pf), batch = scoring_pair
    expected_loss, expected = loss_and_gradients(stock, batch, CASES[case])
    pf._metrics["train"].clear()
    loss, actual = loss_and_gradients(pf, batch, CASES[case])
    assert pf._metrics["train"]["prefixflow/groups"] and pf._metrics["train"]["prefixflow/scoring_groups"]
    assert_rel_close(loss, expected_loss, f"{case} loss")
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert_rel_close(actual[name], expected[name], f"{case} grad {name}")


# -- the pairs -----------------------------------------------------------------------------------------------------


def test_common_prefix_is_found_per_pair():
    assert pf_dpo.common_prefix([5, 6, 7, 8], [5, 6, 9]) == 2
    assert pf_dpo.common_prefix([5, 6, 7], [5, 6, 7, 8]) == 2  # each row keeps one suffix token
    assert pf_dpo.common_prefix([5, 6], [7, 6]) == 0
    scorer = pf_dpo.PairScorer(pf_dpo.ModelShape(2, 32, 32, 10_000, 97), 1, 1.0, 0, None, None)
    ids = torch.tensor([[2, 3, 4, 5, 6, 0], [2, 9, 9, 0, 0, 0], [2, 3, 4, 5, 7, 8], [3, 9, 0, 0, 0, 0]])
    shared, plain = scorer.pairs(ids, [5, 3, 6, 2], pf_dpo.pair_rows(4))
    assert [(p.rows, p.shared) for p in shared] == [((0, 2), 4)] and plain == [1, 3]


def test_identical_response_openings_are_shared(one_thread, base, tmp_path):
    """The common prefix reaches past the prompt into identical response openings; their tokens are scored from
    Phase A's output."""
    trainer = build(PrefixFlowDPOTrainer, base, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    lengths = batch["attention_mask"].sum(1).tolist()
    shared, _ = trainer._scorer.pairs(batch["input_ids"], lengths, pf_dpo.pair_rows(len(lengths)))
    prompt = [int(m.sum()) - int(c.sum()) for m, c in zip(batch["attention_mask"], batch["completion_mask"])]
    assert any(p.shared > prompt[p.rows[0]] for p in shared)


def test_pairs_below_the_flop_bound_take_the_plain_path(one_thread, base, tmp_path):
    stock = train(build(DPOTrainer, base, tmp_path, max_steps=1))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1, prefixflow={"prefixflow_min_speedup": 99.0}))
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") == 0 and metric(pf[3], "prefixflow/fallback_rows") > 0


# -- broken variants fail the same check ---------------------------------------------------------------------------


def test_swapped_rows_in_the_shared_run_are_caught(one_thread, base, tmp_path, monkeypatch):
    fields = pf_dpo.PairScorer._pair_fields

    def swapped(self, group, runner, pair, *args):
        out = fields(self, group, runner, pair, *args)
        chosen, rejected = pair.rows
        return {chosen: out[rejected], rejected: out[chosen]}

    stock = train(build(DPOTrainer, base, tmp_path, max_steps=1))
    monkeypatch.setattr(pf_dpo.PairScorer, "_pair_fields", swapped)
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1))
    with pytest.raises(AssertionError, match="grad"):
        assert_aligned(stock, pf)


def test_reference_pass_without_the_prefix_is_caught(one_thread, base, tmp_path, monkeypatch):
    """A reference pass whose waves do not read the common prefix (only its last token, at the right position)."""

    def without_prefix(self, session, model, fused, prefix_ids):
        if torch.is_grad_enabled():
            return opened(self, session, model, fused, prefix_ids)
        runner = pf_dpo._PrefixOutput(fused)
        group = PrefixGroup(model, prefix_ids[-1:], position_offset=len(prefix_ids) - 1, runner=runner)
        session.add(group)
        return group, runner

    opened = pf_dpo.PairScorer._open
    stock = train(build(DPOTrainer, base, tmp_path, max_steps=1))
    monkeypatch.setattr(pf_dpo.PairScorer, "_open", without_prefix)
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1))
    with pytest.raises(AssertionError, match="grad"):
        assert_aligned(stock, pf)


@pytest.mark.parametrize("lora", [False, True], ids=["reference-model", "lora"])
def test_mixed_precision_leaves_autocast_as_it_found_it(one_thread, tmp_path, monkeypatch, lora):
    """fp32 weights under bf16 mixed precision: Accelerate wraps each prepared model's call in one autocast object,
    which is not reentrant. The pair path runs inside that call, so its waves go through TRL's forward, not the
    call again: training ends with autocast off, with a separate reference model (prepared before the pair path
    wraps it) and with LoRA, and the losses follow the stock trainer's. Waves through the module's call (the broken
    variant) leave autocast on after a full fine-tuning step."""
    model = setup.make_model()
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    overrides = dict(bf16=True, max_steps=2, gradient_checkpointing=True, learning_rate=0.05)
    stock = build(DPOTrainer, model, tmp_path, peft_config=peft, **overrides)
    stock.train()
    assert not torch.is_autocast_enabled("cpu")
    pf = build(PrefixFlowDPOTrainer, model, tmp_path, peft_config=peft, **overrides)
    pf.train()
    assert not torch.is_autocast_enabled("cpu") and metric(pf.state.log_history, "prefixflow/groups") > 0
    losses = [(e["loss"], a["loss"]) for e, a in zip(stock.state.log_history, pf.state.log_history) if "loss" in e]
    assert losses and all(abs(a - e) <= 2e-2 * abs(e) for e, a in losses)  # bf16 rounding apart
    if lora:
        return
    opened = pf_dpo.PairScorer._open

    def through_the_call(self, session, model, fused, prefix_ids):
        return opened(self, session, model, None, prefix_ids)

    monkeypatch.setattr(pf_dpo.PairScorer, "_open", through_the_call)
    try:
        build(PrefixFlowDPOTrainer, model, tmp_path, **overrides).train()
        assert torch.is_autocast_enabled("cpu")
    finally:
        torch.set_autocast_enabled("cpu", False)


def test_torch_compile_compiles_each_decoder_layer_and_shares(one_thread, tmp_path, caplog):
    """`torch_compile=True`: DPOTrainer compiles the whole model (Accelerate); the swap compiles each decoder layer of
    the policy and the reference in place instead (10 layers: past dynamo's recompile limit, were any layer its own
    graph), still shares its pairs, and trains as the stock trainer does. Were Accelerate's whole-model compile left
    on, every pair would take the plain path (`prefixflow/groups` 0)."""
    base = setup.make_model(dtype=torch.float64, num_hidden_layers=10)
    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager", max_steps=1)
    torch._dynamo.reset()
    # The trainer raises the process-wide recompile limit; the patch puts torch's back as it exits.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8), \
            caplog.at_level("INFO", logger="hf_prefixflow.trainers"):
        stock = train(build(DPOTrainer, base, tmp_path, **compiled))
        trainer = build(PrefixFlowDPOTrainer, base, tmp_path, **compiled)
        assert all(_compat.is_compiled(layer) for model in (trainer.model, trainer.ref_model)
                   for layer in decoder_layers(model))
        pf = train(trainer)
    torch._dynamo.reset()
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") > 0 and metric(pf[3], "prefixflow/scoring_groups") > 0
    assert caplog.text.count("compiles each of the 10 decoder layers") == 2


def test_zero_and_fsdp_keep_accelerate_s_compile(monkeypatch):
    """Under ZeRO, FSDP or a parallelism config (a plugin, or `accelerate launch`'s environment) every pair takes the
    plain path, so
    `torch_compile` stays Accelerate's whole-model compile, as for the stock trainer."""
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not pf_dpo._shards({"deepspeed_plugin": None, "fsdp_plugin": None})
    assert pf_dpo._shards({"deepspeed_plugin": object()}) and pf_dpo._shards({"fsdp_plugin": object()})
    assert pf_dpo._shards({"parallelism_config": object()})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "yes")  # any value Accelerate reads as on
    assert pf_dpo._shards({})


def test_pair_waves_attend_over_the_concatenated_cache(one_thread, base, tmp_path, monkeypatch):
    """A pair's two-row wave attends in one kernel over the concatenated K/V (one bf16 rounding of the output and of
    dQ, where the split kernels round twice: `benchmarks/dpo_criterion.py`); the split attention runs for no wave."""
    from hf_prefixflow.core import split_attention

    calls = []
    split = split_attention.split_attention
    monkeypatch.setattr(split_attention, "split_attention", lambda *args: calls.append(1) or split(*args))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1))
    assert metric(pf[3], "prefixflow/groups") > 0 and not calls
    monkeypatch.setattr(pf_dpo.PairScorer, "concatenated_attention", False)  # the count works: split waves
    train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1))
    assert calls


# -- the plain path ------------------------------------------------------------------------------------------------


def test_keep_end_truncation_pairs_found_from_their_tokens(one_thread, base, tmp_path):
    """`keep_end` cuts each row's start on its own, so the two rows of a pair no longer begin alike (or share only a
    tail-aligned part): the common prefix is found from the tokens, pairs sharing too little take the plain path."""
    overrides = dict(max_length=24, truncation_mode="keep_end", max_steps=1)
    stock = train(build(DPOTrainer, base, tmp_path, **overrides))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, **overrides))
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/fallback_rows") > 0


def test_scoring_off_leaves_the_reference_pass_to_trl(one_thread, base, tmp_path):
    stock = train(build(DPOTrainer, base, tmp_path, max_steps=1))
    pf = train(build(PrefixFlowDPOTrainer, base, tmp_path, max_steps=1, prefixflow={"prefixflow_scoring": False}))
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") > 0 and metric(pf[3], "prefixflow/scoring_groups") == 0


def test_forwards_the_pairs_cannot_reproduce_take_the_plain_path():
    ids = torch.zeros(4, 6, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "fused_lm_head": True,
             "use_cache": False}
    assert pf_dpo._call_reason(batch) is None
    assert pf_dpo._call_reason({**batch, "return_dict": True}) is None  # PEFT's
    assert pf_dpo._call_reason({**batch, "pixel_values": torch.zeros(1)}) == "forward arguments ['pixel_values']"
    assert pf_dpo._call_reason({**batch, "input_ids": ids[:3]}) == "not a preference batch of chosen and rejected rows"
    assert pf_dpo.right_padded_lengths(torch.tensor([[1, 1, 0], [1, 0, 0]])) == [2, 1]
    assert pf_dpo.right_padded_lengths(torch.tensor([[0, 1, 1], [1, 0, 0]])) is None  # left padding


# -- DDP: two gloo processes -----------------------------------------------------------------------------------------


def test_ddp_matches_stock(tmp_path):
    """Plain DDP: each process shares its pairs, accumulates its backwards and Phase C locally; one all-reduce per
    step gives the stock trainer's weights on every process. (PrefixFlowRewardTrainer runs the same step,
    `pair_training_step`; `python tests/test_dpo.py reward ...` under torchrun runs it.)"""
    from launcher import torchrun

    for name in ("stock", "prefixflow"):
        result = torchrun("test_dpo.py", "dpo", name, str(tmp_path))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stock, pf = (torch.load(tmp_path / f"{name}_rank0.pt") for name in ("stock", "prefixflow"))
    start = torch.load(tmp_path / "start.pt")
    for name in stock:
        assert_rel_close(pf[name] - start[name], stock[name] - start[name], f"update {name}")
    assert torch.load(tmp_path / "prefixflow_shared.pt") > 0
    ranks = [torch.load(tmp_path / f"prefixflow_rank{rank}.pt") for rank in (0, 1)]
    for name, weight in ranks[0].items():
        assert torch.equal(weight, ranks[1][name]), name


def ddp_worker(kind: str, name: str, out: str) -> None:
    """One process of `test_ddp_matches_stock`: two steps of two microbatches of two pairs per process."""
    from launcher import finish_worker

    rank = int(os.environ.get("RANK", 0))
    overrides = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, ddp_backend="gloo")
    if kind == "dpo":
        base = setup.make_model(dtype=torch.float64)
        trainer = build(PrefixFlowDPOTrainer if name == "prefixflow" else DPOTrainer, base, pathlib.Path(out) / name,
                        dataset=make_dataset(pairs=16), **overrides)
    else:
        import test_reward

        base = test_reward.make_model()
        trainer = test_reward.build(test_reward.PrefixFlowRewardTrainer if name == "prefixflow" else
                                    test_reward.RewardTrainer, base, pathlib.Path(out) / name,
                                    dataset=test_reward.make_dataset(pairs=16), **overrides)
    assert trainer.accelerator.num_processes == 2
    if rank == 0 and name == "stock":
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, os.path.join(out, "start.pt"))
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(weights, os.path.join(out, f"{name}_rank{rank}.pt"))
    if name == "prefixflow" and rank == 0:
        shared = metric(trainer.state.log_history, "prefixflow/groups")
        torch.save(shared, os.path.join(out, "prefixflow_shared.pt"))
    finish_worker()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    ddp_worker(*sys.argv[1:4])


def test_long_prompt_example_runs_both_trainers(one_thread, capsys):
    import dpo_long_prompt

    results = dpo_long_prompt.main(["--steps", "2", "--passages", "4", "--hidden", "32", "--layers", "2",
                                    "--batch-size", "2"])
    printed = capsys.readouterr().out
    assert "losses agree" in printed and "step speedup" in printed
    assert metric(results["prefixflow"], "prefixflow/groups") > 0
