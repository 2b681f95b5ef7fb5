"""PrefixFlowOnlineDPOTrainer against TRL's OnlineDPOTrainer: same float64 model, seed, data, config and frozen
completions (generation replaced by a deterministic stand-in), a reward function; loss, every gradient, the weights
after optimizer steps and TRL's metrics within 1e-5 relative. The broken variants (the two completions' log-probs
swapped in the shared run, Phase C dropped) fail the same check.
"""

from __future__ import annotations

import copy
import os
import pathlib
import random
import sys
import zlib

import pytest
import torch
from peft import LoraConfig
from transformers import Qwen3ForSequenceClassification, TrainerCallback
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.experimental.utils import truncate_right

import grpo_setup as setup
import hf_prefixflow
from equivalence import assert_rel_close
from hf_prefixflow import _compat
from hf_prefixflow.core import layouts
from hf_prefixflow import PrefixFlowOnlineDPOConfig, PrefixFlowOnlineDPOTrainer
from hf_prefixflow.trainers import dpo as pf_dpo
from hf_prefixflow.trainers import online_dpo as pf_online

MAX_NEW = 8
pytestmark = pytest.mark.usefixtures("one_thread")


def freeze_generation(trainer, pad: bool = True) -> None:
    """Replace sampling by two completions per prompt that depend only on the prompt, the copy and the call count,
    returned as `OnlineDPOTrainer._generate` returns them: left-padded prompts repeated twice, completions cut after
    their first EOS. `pad=False`: every completion runs the full `MAX_NEW` tokens, no EOS (no padding)."""
    calls = {"n": 0}
    tokenizer = trainer.processing_class

    def generate(model, prompts, images=None):
        calls["n"] += 1
        batch = tokenizer(text=list(prompts), return_tensors="pt", padding=True, padding_side="left",
                          add_special_tokens=False)
        prompt_ids, prompt_mask = batch["input_ids"].repeat(2, 1), batch["attention_mask"].repeat(2, 1)
        rows = []
        for index, prompt in enumerate(2 * list(prompts)):
            rng = random.Random(zlib.crc32(repr((prompt, index, calls["n"])).encode()))  # stable across processes
            tokens = [rng.randrange(3, len(setup.SPECIALS) + len(setup.WORDS)) for _ in range(MAX_NEW)]
            if pad and rng.random() < 0.8:
                tokens[rng.randrange(0, MAX_NEW - 1)] = tokenizer.eos_token_id
            rows.append(tokens)
        completion_ids, completion_mask = truncate_right(torch.tensor(rows), tokenizer.eos_token_id,
                                                         tokenizer.pad_token_id)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, None

    trainer._generate = generate


class GradientRecorder(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})


def options(tmp_path, **overrides) -> dict:
    # SGD and no clipping: the updates are linear in the gradients, so their tolerance carries over to the weights.
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to="none", use_cpu=True,
                save_strategy="no", learning_rate=0.5, optim="sgd", seed=3, bf16=False, max_grad_norm=0.0,
                logging_steps=1, beta=0.5, max_new_tokens=MAX_NEW, max_length=128, disable_tqdm=True)
    base.update(overrides)
    return base


def build(trainer_cls, base, tmp_path, peft_config=None, prefixflow=None, plain_config=False, pad=True, freeze=True,
          reward=setup.length_reward, **overrides):
    if trainer_cls is not OnlineDPOTrainer and not plain_config:
        args = PrefixFlowOnlineDPOConfig(**options(tmp_path / "pf", **overrides),
                                         **{"prefixflow_min_prefix_tokens": 2, "prefixflow_min_speedup": 1.0,
                                            **(prefixflow or {})})
    else:
        args = OnlineDPOConfig(**options(tmp_path / trainer_cls.__name__, **overrides))
    ref_model = None if peft_config is not None else copy.deepcopy(base)
    tokenizer = setup.make_tokenizer()
    reward_model = isinstance(reward, torch.nn.Module)
    trainer = trainer_cls(model=copy.deepcopy(base), ref_model=ref_model, args=args,
                          reward_funcs=copy.deepcopy(reward) if reward_model else reward,
                          reward_processing_classes=tokenizer if reward_model else None,
                          train_dataset=setup.make_dataset(prompts=8, lengths=(10, 30)),
                          processing_class=tokenizer, peft_config=peft_config)
    if freeze:
        freeze_generation(trainer, pad)
    return trainer


def train(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    losses = []
    step = trainer.training_step

    def recording(*args, **kwargs):
        loss = step(*args, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer.training_step = recording
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, start, weights, losses, trainer.state.log_history


def assert_aligned(stock, prefixflow, rtol=1e-5):
    """Every microbatch's loss, every gradient before every optimizer step, every weight's total update, and every
    metric TRL logs (PrefixFlow's own and the run's timings aside)."""
    (stock_grads, start, stock_weights, stock_losses, stock_logs) = stock
    (pf_grads, _, pf_weights, pf_losses, pf_logs) = prefixflow
    assert len(stock_grads) == len(pf_grads) > 0 and len(stock_losses) == len(pf_losses) > 0
    for step, (expected, actual) in enumerate(zip(stock_losses, pf_losses)):
        assert_rel_close(actual, expected, f"microbatch {step} loss", rtol)
    for step, (expected, actual) in enumerate(zip(stock_grads, pf_grads)):
        assert expected.keys() == actual.keys() and expected
        for name in expected:
            assert_rel_close(actual[name], expected[name], f"step {step} grad {name}", rtol)
    for name in stock_weights:
        assert_rel_close(pf_weights[name] - start[name], stock_weights[name] - start[name], f"update {name}", rtol)
    assert len(stock_logs) == len(pf_logs)
    compared = 0
    for expected, actual in zip(stock_logs, pf_logs):
        for key, value in expected.items():
            if "runtime" in key or "per_second" in key:
                continue
            assert_rel_close(torch.tensor(actual[key]), torch.tensor(value), f"metric {key}", rtol)
            compared += 1
    assert compared


_STOCK: dict[str, tuple] = {}


def stock_run(base, tmp_path, **kwargs):
    """TRL's run for these settings, trained once per module (several tests compare against the same one)."""
    key = repr(sorted(kwargs.items()))
    if key not in _STOCK:
        _STOCK[key] = train(build(OnlineDPOTrainer, base, tmp_path, **kwargs))
    return _STOCK[key]


@pytest.fixture(scope="module")
def base():
    return setup.make_model(dtype=torch.float64)


def metric(logs, name) -> float:
    return sum(entry.get(name, 0.0) for entry in logs)


def test_matches_stock_reference_model(base, tmp_path):
    """A separate reference model (scored in its own no-grad groups); TRL's default gradient checkpointing."""
    stock = stock_run(base, tmp_path, loss_type="sigmoid")
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, loss_type="sigmoid"))
    assert_aligned(stock, prefixflow)
    logs = prefixflow[-1]
    assert metric(logs, "prefixflow/groups") > 0 and metric(logs, "prefixflow/scoring_groups") > 0
    assert metric(logs, "prefixflow/fallback_rows") == 0


def test_matches_stock_every_metric_without_padding(base, tmp_path):
    """With no completion padded, the metrics read from padded positions agree too."""
    stock = train(build(OnlineDPOTrainer, base, tmp_path, pad=False))
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, pad=False))
    assert_aligned(stock, prefixflow)


def test_real_generation_matches_stock(base, tmp_path):
    """TRL's own sampling on the switched model: the same seed gives both trainers the same completions."""
    stock = train(build(OnlineDPOTrainer, base, tmp_path, freeze=False, gradient_checkpointing=False))
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, freeze=False, gradient_checkpointing=False))
    assert_aligned(stock, prefixflow)
    assert metric(prefixflow[-1], "prefixflow/groups") > 0


def test_reward_model(base, tmp_path):
    """A reward model (a tiny sequence classifier built from a config) in place of the reward function."""
    config = base.config.__class__(**{**base.config.to_dict(), "num_labels": 1})
    torch.manual_seed(1)
    reward = Qwen3ForSequenceClassification(config).to(torch.float64)
    stock = train(build(OnlineDPOTrainer, base, tmp_path, reward=reward, gradient_checkpointing=False))
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, reward=reward, gradient_checkpointing=False))
    assert_aligned(stock, prefixflow)
    assert metric(prefixflow[-1], "prefixflow/groups") > 0


def test_matches_stock_lora_accumulation(base, tmp_path):
    """PEFT: the reference is the adapter disabled, scored in no-grad groups inside the training session; two
    microbatches per optimizer step; the IPO loss; checkpointing off."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    settings = dict(peft_config=lora, gradient_accumulation_steps=2, loss_type="ipo", gradient_checkpointing=False)
    stock = train(build(OnlineDPOTrainer, base, tmp_path, **settings))
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, **settings))
    assert_aligned(stock, prefixflow)
    assert metric(prefixflow[-1], "prefixflow/scoring_groups") > 0


def test_plain_config_mixes_shared_and_plain_pairs(base, tmp_path):
    """A plain `OnlineDPOConfig` gets the defaults: prompts under 16 tokens take the plain path in the same call as
    shared pairs, counted in prefixflow/fallback_rows."""
    stock = train(build(OnlineDPOTrainer, base, tmp_path, per_device_train_batch_size=4))
    prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path, plain_config=True,
                             per_device_train_batch_size=4))
    assert_aligned(stock, prefixflow)
    logs = prefixflow[-1]
    assert metric(logs, "prefixflow/groups") > 0 and metric(logs, "prefixflow/fallback_rows") > 0


def test_all_plain_is_stock(base, tmp_path, caplog):
    stock = stock_run(base, tmp_path, loss_type="sigmoid")
    with caplog.at_level("WARNING"):
        prefixflow = train(build(PrefixFlowOnlineDPOTrainer, base, tmp_path,
                                 prefixflow={"prefixflow_min_prefix_tokens": 1000}))
    assert_aligned(stock, prefixflow)
    assert metric(prefixflow[-1], "prefixflow/groups") == 0 and metric(prefixflow[-1], "prefixflow/fallback_rows") > 0
    assert "prefixflow_min_prefix_tokens" in caplog.text


class _SwappedPairs(PrefixFlowOnlineDPOTrainer):
    """Broken: each shared pair's two rows of log-probs trade places."""

    def _shared_pairs(self, model, pairs, *args):
        out = super()._shared_pairs(model, pairs, *args)
        for pair in pairs:
            i, j = pair.rows
            out[i], out[j] = out[j], out[i]
        return out


def _drop_phase_c(self, error=None):
    """Broken: the groups are freed without the delayed prefix backward."""
    session, self.session, self.hidden = self.session, None, []
    if session is not None:
        session.finish(RuntimeError("prefix gradient dropped"))


@pytest.mark.parametrize("broken", ["swapped", "no_phase_c", "causal_padding"])
def test_broken_variants_fail(base, tmp_path, monkeypatch, broken):
    stock = stock_run(base, tmp_path, loss_type="sigmoid")
    if broken == "no_phase_c":
        monkeypatch.setattr(pf_dpo.PairScorer, "phase_c", _drop_phase_c)
    if broken == "causal_padding":  # padded positions computed bottom-right causally: TRL's KL and entropy differ
        monkeypatch.setattr(layouts.Wave, "padding_sees_row", property(lambda self: False, lambda self, value: None))
    cls = _SwappedPairs if broken == "swapped" else PrefixFlowOnlineDPOTrainer
    with pytest.raises(AssertionError) as caught:
        assert_aligned(stock, train(build(cls, base, tmp_path)))
    if broken == "causal_padding":
        assert "metric objective/" in str(caught.value)


def test_torch_compile_compiles_each_decoder_layer_and_generates_eagerly(tmp_path, monkeypatch, caplog):
    """`torch_compile=True`: OnlineDPOTrainer compiles the whole model (Accelerate); the swap compiles each decoder
    layer of the policy and the reference in place (10 layers: past dynamo's recompile limit, were any layer its own
    graph), the reward model whole as Accelerate does, generates eagerly, shares its pairs and trains as the stock
    trainer does."""
    base = setup.make_model(dtype=torch.float64, num_hidden_layers=10)
    torch.manual_seed(1)
    config = setup.make_model(num_hidden_layers=2).config
    reward = Qwen3ForSequenceClassification(config.__class__(**{**config.to_dict(), "num_labels": 1})).to(torch.float64)
    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager", max_steps=1, reward=reward,
                    gradient_checkpointing=False)
    stances = []
    torch._dynamo.reset()
    # The trainer raises the process-wide recompile limit; the patch puts torch's back as it exits.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8), \
            caplog.at_level("INFO", logger="hf_prefixflow.trainers"):
        stock = train(build(OnlineDPOTrainer, base, tmp_path, **compiled))
        trainer = build(PrefixFlowOnlineDPOTrainer, base, tmp_path, **compiled)
        assert isinstance(trainer.reward_funcs[0], torch._dynamo.eval_frame.OptimizedModule)
        frozen = trainer.__dict__.pop("_generate")  # frozen one level down: the trainer's own `_generate` runs
        monkeypatch.setattr(OnlineDPOTrainer, "_generate", lambda self, *args: (
            stances.append(torch._dynamo.eval_frame._stance.stance), frozen(*args))[1])
        pf = train(trainer)
    torch._dynamo.reset()
    assert_aligned(stock, pf)
    assert metric(pf[-1], "prefixflow/groups") > 0 and stances and set(stances) == {"force_eager"}
    assert caplog.text.count("compiles each of the 10 decoder layers") == 2


def test_fallback_reasons(base, tmp_path):
    """Runs the groups cannot make exact train on the stock path; nothing is refused."""
    trainer = build(PrefixFlowOnlineDPOTrainer, base, tmp_path, gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": True})
    assert trainer._reason == "reentrant activation checkpointing"
    # TRL's private scoring call as this TRL has it; another signature sends the run to the plain path.
    assert _compat.online_dpo_forward_matches(OnlineDPOTrainer)

    class Renamed(OnlineDPOTrainer):
        def _forward(self, model, input_ids, attention_mask):
            return None

    assert not _compat.online_dpo_forward_matches(Renamed)
    assert pf_online.left_padded_lengths(torch.tensor([[0, 1, 1], [1, 1, 1]])) == [2, 3]
    assert pf_online.left_padded_lengths(torch.tensor([[1, 0, 1]])) is None


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_padding_sees_row_is_the_stock_padded_row(implementation):
    """`Wave.padding_sees_row`: every position of a padded wave, padding included, equals the full padded sequence's
    output."""
    torch.manual_seed(0)
    model = setup.make_model(dtype=torch.float64)
    model.config._attn_implementation = implementation
    hf_prefixflow.apply_prefixflow(model)
    prompt = torch.randint(3, 90, (9,))
    completions = torch.randint(3, 90, (2, 6))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        full = model(torch.cat([prompt.expand(2, -1), completions], 1),
                     attention_mask=torch.cat([torch.ones(2, 9, dtype=torch.long), mask], 1)).logits[:, 8:-1]
        with hf_prefixflow.prefix_group(model, prompt) as group:
            wave = group.padded_wave(completions, attention_mask=mask)
            wave.padding_sees_row = True
            shared = group.run_wave(wave).logits
            causal = group(completions, attention_mask=mask).logits
    assert_rel_close(shared, full, f"{implementation} padded wave")
    assert_rel_close(causal[mask.bool()], full[mask.bool()], "real positions")
    assert not torch.allclose(causal[0, 4:], full[0, 4:])  # padding queries: bottom-right causal differs


def test_padding_sees_row_flex_mask_is_the_dense_mask():
    """FlexAttention's mask function (FlexAttention on a CPU refuses float64) allows what `Wave.visible` does."""
    from hf_prefixflow.core import attention

    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    wave = layouts.padded_wave(torch.tensor([[5]]), torch.randint(3, 90, (2, 6)), mask, cached_length=8)
    wave.padding_sees_row = True
    dense = wave.visible(None)[:, 0]
    query = torch.zeros(2, 4, 6, 8)
    block = attention._block_mask(wave, None, query, 14)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(6), torch.arange(14), indexing="ij")
    assert torch.equal(block.mask_mod(b, 0, q, kv), dense)
    assert not dense[0, 4, 8 + 4] and dense[0, 4, 8 + 3] and not dense[0, 4, 8 + 5]  # not itself; real keys only


# -- DDP: two gloo processes -----------------------------------------------------------------------------------------


def test_ddp_matches_stock(tmp_path):
    """Plain DDP: each process shares its prompts, accumulates its backwards and Phase C locally; one all-reduce per
    step gives the stock trainer's weights on every process."""
    from launcher import torchrun

    for name in ("stock", "prefixflow"):
        result = torchrun("test_online_dpo.py", name, str(tmp_path))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stock, pf = (torch.load(tmp_path / f"{name}_rank0.pt") for name in ("stock", "prefixflow"))
    start = torch.load(tmp_path / "start.pt")
    for name in stock:
        assert_rel_close(pf[name] - start[name], stock[name] - start[name], f"update {name}")
    assert torch.load(tmp_path / "prefixflow_shared.pt") > 0
    ranks = [torch.load(tmp_path / f"prefixflow_rank{rank}.pt") for rank in (0, 1)]
    for name, weight in ranks[0].items():
        assert torch.equal(weight, ranks[1][name]), name


def ddp_worker(name: str, out: str) -> None:
    """One process of `test_ddp_matches_stock`: two steps of two microbatches of two prompts per process."""
    from launcher import finish_worker

    rank = int(os.environ.get("RANK", 0))
    base = setup.make_model(dtype=torch.float64)
    trainer = build(PrefixFlowOnlineDPOTrainer if name == "prefixflow" else OnlineDPOTrainer, base,
                    pathlib.Path(out) / name, gradient_accumulation_steps=2, ddp_backend="gloo",
                    gradient_checkpointing=False)
    assert trainer.accelerator.num_processes == 2
    if rank == 0 and name == "stock":
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, os.path.join(out, "start.pt"))
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(weights, os.path.join(out, f"{name}_rank{rank}.pt"))
    if name == "prefixflow" and rank == 0:
        torch.save(metric(trainer.state.log_history, "prefixflow/groups"), os.path.join(out, "prefixflow_shared.pt"))
    finish_worker()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    ddp_worker(*sys.argv[1:3])
