"""PrefixFlowRewardTrainer against TRL's RewardTrainer: same float64 model, seed, data and config.

Qwen3's and Llama's RMSNorm compute in float32 whatever the model's dtype, so the trainers agree to float32 rounding
(about 1e-7 relative), well inside the suite's 1e-5; the broken variants miss by orders more.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, TaskType
from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen3ForSequenceClassification
from trl import RewardConfig, RewardTrainer

import grpo_setup as setup
from hf_prefixflow import PrefixFlowRewardConfig, PrefixFlowRewardTrainer
from hf_prefixflow.core.scheduler import PrefixGroup
from hf_prefixflow.trainers import reward as pf_reward
from test_dpo import GradientRecorder, assert_aligned, metric


def make_dataset(pairs: int = 8, seed: int = 0, margins: bool = False) -> Dataset:
    """Prompt and responses as text (TRL merges the prompt into both before tokenizing): uneven lengths, some
    identical response openings, and a first pair that shares only the BOS token."""
    rng = random.Random(seed)
    words = lambda n: [rng.choice(setup.WORDS) for _ in range(n)]  # noqa: E731
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(pairs):
        opening = words(rng.choice([0, 0, 2, 4]))
        chosen, rejected = opening + words(rng.randint(1, 7)), opening + words(rng.randint(1, 7))
        if chosen == rejected:
            rejected = rejected + ["w0"]
        if i == 0:
            chosen[0], rejected[0] = "w1", "w2"
        rows["prompt"].append("<bos>" if i == 0 else " ".join(["<bos>"] + words(rng.randint(14, 30))))
        rows["chosen"].append(" " + " ".join(chosen + ["<eos>"]))
        rows["rejected"].append(" " + " ".join(rejected + ["<eos>"]))
    if margins:
        rows["margin"] = [rng.uniform(-1.0, 1.0) for _ in range(pairs)]
    return Dataset.from_dict(rows)


def make_model(family: str = "qwen3") -> torch.nn.Module:
    if family == "qwen3":
        config = setup.make_model().config
        model_cls = Qwen3ForSequenceClassification
    else:
        config = LlamaConfig(vocab_size=len(setup.SPECIALS) + len(setup.WORDS), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        model_cls = LlamaForSequenceClassification
    config.num_labels = 1
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    return model


def build(trainer_cls, base, tmp_path, dataset=None, peft_config=None, prefixflow=None, **overrides):
    options = dict(output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=4, max_steps=2,
                   report_to="none", use_cpu=True, save_strategy="no", learning_rate=0.5, optim="sgd", seed=3,
                   bf16=False, max_grad_norm=0.0, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True)
    options.update(overrides)
    if trainer_cls is PrefixFlowRewardTrainer:
        args = PrefixFlowRewardConfig(**options, **{"prefixflow_min_prefix_tokens": 2, **(prefixflow or {})})
    else:
        args = RewardConfig(**options)
    return trainer_cls(model=copy.deepcopy(base), args=args, train_dataset=dataset or make_dataset(),
                       processing_class=setup.make_tokenizer(), peft_config=peft_config)


def train(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return recorder.steps, start, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, \
        trainer.state.log_history


def both(base, tmp_path, **kwargs):
    prefixflow = kwargs.pop("prefixflow", None)
    stock = train(build(RewardTrainer, base, tmp_path, **kwargs))
    return stock, train(build(PrefixFlowRewardTrainer, base, tmp_path, prefixflow=prefixflow, **kwargs))


CASES = {
    "qwen3": {},
    "llama": {"family": "llama"},
    "accumulation": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    "margin_and_centering": {"dataset": "margins", "center_rewards_coefficient": 0.1},
    "checkpointing": {"gradient_checkpointing": True},
}


@pytest.mark.parametrize("case", CASES)
def test_training_matches_stock(one_thread, tmp_path, case):
    """Loss, every gradient and the weights after optimizer steps; the BOS-only pair takes the plain path."""
    settings = dict(CASES[case])
    base = make_model(settings.pop("family", "qwen3"))
    if settings.get("dataset") == "margins":
        settings["dataset"] = make_dataset(margins=True)
    stock, pf = both(base, tmp_path, **settings)
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") > 0 and metric(pf[3], "prefixflow/fallback_rows") > 0


def test_torch_compile_compiles_each_decoder_layer_and_shares(one_thread, tmp_path, caplog):
    """`torch_compile=True`: the swap compiles each decoder layer in place (Accelerate's whole-model compile would send
    every pair to the plain path) and trains as RewardTrainer does with the whole model compiled."""
    torch._dynamo.reset()
    # The trainer raises the process-wide recompile limit; the patch puts torch's back as it exits.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8), \
            caplog.at_level("INFO", logger="hf_prefixflow.trainers"):
        stock, pf = both(make_model(), tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    torch._dynamo.reset()
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") > 0 and "compiles each of the 2 decoder layers" in caplog.text


def test_lora(one_thread, tmp_path):
    """LoRA on the decoder, the score head trained as PEFT's modules_to_save copy."""
    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                      lora_dropout=0.0)
    stock, pf = both(make_model(), tmp_path, peft_config=lora, max_steps=3)
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/groups") > 0


def test_bos_only_pair_stays_exact_when_shared(one_thread, tmp_path):
    stock, pf = both(make_model(), tmp_path, dataset=make_dataset(pairs=4), max_steps=1,
                     prefixflow={"prefixflow_min_prefix_tokens": 1, "prefixflow_min_speedup": 0.0})
    assert_aligned(stock, pf)
    assert metric(pf[3], "prefixflow/fallback_rows") == 0


def test_evaluation_scores_through_groups(one_thread, tmp_path):
    stock_trainer = build(RewardTrainer, make_model(), tmp_path)
    pf_trainer = build(PrefixFlowRewardTrainer, make_model(), tmp_path)
    expected = stock_trainer.evaluate(eval_dataset=make_dataset(pairs=4, seed=1))
    actual = pf_trainer.evaluate(eval_dataset=make_dataset(pairs=4, seed=1))
    for key in ("eval_loss", "eval_margin", "eval_mean_reward"):
        assert actual[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-12), key
    assert actual["eval_prefixflow/scoring_groups"] > 0


def test_read_positions_follow_transformers_pooling():
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 6, 0], [0, 0, 0, 0]])
    assert pf_reward.read_positions(ids, 0) == [2, 2, 0]
    assert pf_reward.read_positions(ids, None) == [3, 3, 3]


# -- broken variants fail the same check ---------------------------------------------------------------------------


def test_swapped_rows_in_the_shared_run_are_caught(one_thread, tmp_path, monkeypatch):
    base = make_model()
    stock = train(build(RewardTrainer, base, tmp_path, max_steps=1))
    hidden = pf_reward.RewardPairScorer._pair_hidden

    def swapped(self, group, runner, pair, *args):
        out = hidden(self, group, runner, pair, *args)
        chosen, rejected = pair.rows
        return {chosen: out[rejected], rejected: out[chosen]}

    monkeypatch.setattr(pf_reward.RewardPairScorer, "_pair_hidden", swapped)
    pf = train(build(PrefixFlowRewardTrainer, base, tmp_path, max_steps=1))
    with pytest.raises(AssertionError, match="loss|grad"):
        assert_aligned(stock, pf)


def test_suffixes_without_the_prefix_are_caught(one_thread, tmp_path, monkeypatch):
    """Waves that read only the prefix's last token (at the right position), not the cached common prefix."""

    def without_prefix(self, session, view, prefix_ids, runner):
        group = PrefixGroup(view, prefix_ids[-1:], position_offset=len(prefix_ids) - 1, runner=runner)
        session.add(group)
        return group

    base = make_model()
    stock = train(build(RewardTrainer, base, tmp_path, max_steps=1))
    monkeypatch.setattr(pf_reward.RewardPairScorer, "_open_on", without_prefix)
    pf = train(build(PrefixFlowRewardTrainer, base, tmp_path, max_steps=1))
    with pytest.raises(AssertionError, match="loss|grad"):
        assert_aligned(stock, pf)


def test_forwards_the_pairs_cannot_reproduce_take_the_plain_path():
    ids = torch.zeros(4, 6, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    assert pf_reward._call_reason({**batch, "margin": torch.zeros(2)}) is None  # a loss input the model ignores
    assert pf_reward._call_reason({**batch, "output_hidden_states": True}) == \
        "forward arguments ['output_hidden_states']"
    assert pf_reward._call_reason({**batch, "input_ids": ids[:3]}) == \
        "not a preference batch of chosen and rejected rows"
