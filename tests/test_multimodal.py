"""Image-text prompts: loss, every gradient (vision tower and projector included) and weights after 3 optimizer steps
equal full-sequence training, per family; what is refused; and broken schedules that the checks catch."""

import copy
import pathlib
import random
import sys

import pytest
import torch
import transformers
import trl.trainer.grpo_trainer as trl_grpo
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hf_prefixflow import _compat
import hf_prefixflow
import synthetic_vision  # examples/, on the path through conftest.py
from test_processing import counting  # noqa: E402 - tests/ is on the path
from hf_prefixflow import PrefixFlowGRPOTrainer
from hf_prefixflow.models import multimodal as mm
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.trainers import mixin as pf_mixin
from hf_prefixflow.trainers.grouping import check_group_prompts
from equivalence import assert_rel_close, assert_same_gradients, gradients, random_plan, token_loss

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import grpo_vision  # noqa: E402

FAMILIES = {
    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    "gemma3": transformers.Gemma3ForConditionalGeneration,
    "paligemma": transformers.PaliGemmaForConditionalGeneration,
    "llava": transformers.LlavaForConditionalGeneration,
    "idefics3": transformers.Idefics3ForConditionalGeneration,
    "smolvlm": transformers.SmolVLMForConditionalGeneration,
}
# Per family the variant it trains in (every variant covered, the file kept fast): activation checkpointing, LoRA.
VARIANTS = {"qwen2_vl": (True, False), "qwen2_5_vl": (False, True), "qwen3_vl": (True, True), "gemma3": (True, False),
            "paligemma": (False, False), "llava": (True, True), "idefics3": (False, False), "smolvlm": (True, False)}
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=r".*(q_proj|v_proj|qkv)$")


# Gemma3's default text layers repeat five sliding and one global: two layers, one of each.
CONFIGS = {"gemma3": {"text_config": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}}}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float64 model of the family's default config: 32 hidden, 2 layers, images of a few patches."""
    cls = FAMILIES[family]
    return mm.tiny_model(cls, cls.config_class(**CONFIGS.get(family, {})), seed=seed).train()


def text(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(*mm.TEXT_IDS, shape, generator=gen)  # never a placeholder id, pads included


def pad(rows: list[torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids, mask = text(gen, len(rows), width), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return ids, mask


def draw_group(model, gen: torch.Generator, images: int, count: int):
    prompt, inputs = mm.sample_prompt(model, gen, images)
    suffixes = [text(gen, int(torch.randint(1, 7, (1,), generator=gen))) for _ in range(count)]
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in suffixes]
    return prompt, inputs, suffixes, weights


def full_sequence_backward(model, prompt, inputs, suffixes, weights, gen, batched: bool) -> float:
    """Reference: every `[P || S_i]` with its images, one row at a time or one right-padded batch."""
    p, total = len(prompt), 0.0
    for rows in [list(range(len(suffixes)))] if batched else [[i] for i in range(len(suffixes))]:
        ids, mask = pad([torch.cat([prompt, suffixes[i]]) for i in rows], gen)
        extra = mm.full_inputs(model, inputs, len(rows), ids.shape[1])
        logits = model(input_ids=ids, attention_mask=mask, **extra).logits
        loss = sum(token_loss(logits[r, p - 1:p - 1 + len(suffixes[i])], suffixes[i], weights[i])
                   for r, i in enumerate(rows))
        loss.backward()
        total += loss.item()
    return total


def prefixflow_backward(model, prompt, inputs, suffixes, weights, plan, gen) -> float:
    total = 0.0
    with hf_prefixflow.prefix_group(model, prompt, **inputs) as group:
        for layout, rows in plan:
            rows_suffixes = [suffixes[i] for i in rows]
            if layout == "padded":
                ids, mask = pad(rows_suffixes, gen)
                logits = group(ids, attention_mask=mask).logits
                per_row = [logits[r, :len(s)] for r, s in enumerate(rows_suffixes)]
            else:
                out = group.packed(rows_suffixes)
                per_row = out.split(out.logits)
            loss = sum(token_loss(lg, s, weights[i]) for lg, s, i in zip(per_row, rows_suffixes, rows))
            loss.backward()
            total += loss.item()
    return total


def train_side_by_side(model, seed: int = 0, images=(1, 2, 1), lr: float = 1e-2, broken=None, settings=None) -> None:
    """SGD-momentum steps (one per entry of `images`, the prompt's image count) on two copies, full sequences vs
    PrefixFlow (`apply_prefixflow` with `settings`): loss, every gradient, every update. `broken(candidate)` breaks
    the PrefixFlow copy."""
    reference, candidate = model, copy.deepcopy(model)
    hf_prefixflow.apply_prefixflow(candidate, **(settings or {}))
    if broken is not None:
        broken(candidate)
    gen = torch.Generator().manual_seed(seed)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr, momentum=0.9)
            for m in (reference, candidate)]
    for step, count in enumerate(images):
        size = int(torch.randint(2, 5, (1,), generator=gen))
        prompt, inputs, suffixes, weights = draw_group(reference, gen, count, size)
        plan = random_plan(gen, len(suffixes))
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        expected = full_sequence_backward(reference, prompt, inputs, suffixes, weights, gen, batched=step % 2 == 0)
        actual = prefixflow_backward(candidate, prompt, inputs, suffixes, weights, plan, gen)
        assert_rel_close(actual, expected, f"step {step} loss")
        assert_same_gradients(gradients(candidate), gradients(reference))
        for opt in opts:
            opt.step()
        for (name, p_ref), (_, p_pf) in zip(reference.named_parameters(), candidate.named_parameters()):
            assert_rel_close(p_pf - start[name], p_ref - start[name], f"step {step} update {name}")


def prepared(family: str, checkpointing: bool, lora: bool) -> torch.nn.Module:
    model = build(family)
    if checkpointing:
        _compat.enable_checkpointing(model)
    return get_peft_model(model, LORA) if lora else model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_like_full_sequences(family):
    checkpointing, lora = VARIANTS[family]
    model = prepared(family, checkpointing, lora)
    train_side_by_side(model)
    if not lora:  # the tower and the projector trained, through Phase C
        tower = [n for n, p in model.named_parameters() if p.grad is not None and not n.startswith(
            ("lm_head", "model.language_model", "model.text_model"))]
        assert tower, "no vision-side parameter got a gradient"


@pytest.mark.parametrize("settings", [{"offload": True}, {"prefix_recompute": 1.0}, {"suffix_checkpointing": False}])
def test_prompt_memory_settings_compose(settings):
    train_side_by_side(prepared("qwen2_vl", True, False), images=(2,), settings=settings)


def test_text_prompts_of_an_image_model_stay_exact():
    model = build("qwen2_5_vl")
    train_side_by_side(model, images=(0, 0))


def test_prefix_lm_needs_token_types_and_trains_text_prompts():
    model = hf_prefixflow.apply_prefixflow(build("paligemma"))
    with pytest.raises(PrefixFlowError, match="token_type_ids"):
        hf_prefixflow.prefix_group(model, text(torch.Generator(), 6))
    train_side_by_side(build("paligemma"), images=(0, 1))


def test_refusals_name_the_reason():
    model = hf_prefixflow.apply_prefixflow(build("qwen2_vl"))
    gen = torch.Generator().manual_seed(0)
    prompt, inputs = mm.sample_prompt(model, gen, 1)
    with pytest.raises(PrefixFlowError, match="must end with text"):
        hf_prefixflow.prefix_group(model, torch.cat([prompt, torch.tensor([mm.IMAGE_ID])]), **inputs)
    with pytest.raises(PrefixFlowError, match="pixel_values_videos"):
        hf_prefixflow.prefix_group(model, prompt, **inputs, pixel_values_videos=inputs["pixel_values"])
    with pytest.raises(PrefixFlowError, match="one entry per prompt token"):
        hf_prefixflow.prefix_group(model, prompt[:-1], **inputs)


def test_a_family_without_an_image_probe_keeps_text_prompts_only():
    cls = transformers.LlavaNextForConditionalGeneration
    model = architecture_tiny(cls)
    with pytest.warns(UserWarning, match="no image probe for the 'llava_next' family"):
        hf_prefixflow.apply_prefixflow(model)
    assert "llava_next" in mm.refusal(model)
    with pytest.raises(PrefixFlowError, match="no image probe"):
        hf_prefixflow.prefix_group(model, text(torch.Generator(), 5), pixel_values=torch.zeros(1, 3, 4, 4))
    with hf_prefixflow.prefix_group(model, text(torch.Generator(), 5)) as group:  # text prompts share as before
        group(text(torch.Generator(), 2, 3)).logits.sum().backward()


def architecture_tiny(cls) -> torch.nn.Module:
    from hf_prefixflow.models.tiny import build_tiny

    return build_tiny(cls, cls.config_class(), "sdpa").train()


# ---- broken schedules the checks must catch -----------------------------------------------------------------

@pytest.fixture
def probed_qwen():
    """Probe Qwen2-VL before a test breaks the schedule: the checks under test are the equivalence checks, not
    `apply_prefixflow`'s probe, which would refuse the broken schedule first."""
    hf_prefixflow.apply_prefixflow(build("qwen2_vl"))


def test_suffix_positions_without_the_rope_delta_are_caught(probed_qwen, monkeypatch):
    rope_index = mm._rope_index
    monkeypatch.setattr(mm, "_rope_index", lambda *a: (rope_index(*a)[0], torch.zeros(1, 1, dtype=torch.long)))
    with pytest.raises(AssertionError):
        train_side_by_side(build("qwen2_vl"), images=(2,))


def test_phase_c_stopping_at_the_decoder_is_caught(probed_qwen):
    def detach_image_features(candidate):  # its merger runs in Phase A only: the image features leave the graph
        candidate.model.visual.merger.register_forward_hook(lambda module, args, out: out.detach())

    with pytest.raises(AssertionError, match="different parameters got gradients"):
        train_side_by_side(build("qwen2_vl"), images=(1,), broken=detach_image_features)


# ---- the trainer: PrefixFlowGRPOTrainer against TRL's GRPOTrainer on image prompts ---------------------------

class GradientRecorder(TrainerCallback):
    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})


def frozen_rollouts(trainer, processor, max_length: int = 5) -> None:
    """Completions that depend only on the prompt and the call count: both trainers train the same rollouts."""
    calls, words = [0], range(len(synthetic_vision.SPECIALS), len(processor.tokenizer))

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls[0] += 1
        out = []
        for index, prompt in enumerate(prompt_ids):
            rng = random.Random(hash((tuple(prompt), index, calls[0])) & 0xFFFFFFFF)
            out.append([rng.choice(words) for _ in range(rng.randint(1, max_length))])
        return out, None

    trainer._generate_single_turn = generate


def train_trainer(trainer_cls, model, processor, dataset, out, **overrides):
    options = dict(output_dir=str(out / trainer_cls.__name__), per_device_train_batch_size=8, num_generations=4,
                   max_completion_length=5, max_steps=2, report_to="none", logging_steps=1, use_cpu=True,
                   save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3, bf16=False, max_grad_norm=0.0,
                   beta=0.0)
    options.update(overrides)
    trainer = trainer_cls(model=model, reward_funcs=synthetic_vision.shape_reward, args=GRPOConfig(**options),
                          train_dataset=dataset, processing_class=processor)
    frozen_rollouts(trainer, processor)
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, \
        [log for log in trainer.state.log_history if "loss" in log]


@pytest.fixture
def rows_in_sampler_order(monkeypatch):
    """Both trainers keep rows in sampler order, so their microbatches hold the same rows."""
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    monkeypatch.setattr(pf_mixin, "shuffle_groups", lambda batch, size, generator=None, offset=0:
                        (check_group_prompts(batch, size, offset), batch)[1])


def test_trainer_shares_image_groups_like_grpo_trainer(tmp_path, rows_in_sampler_order):
    """Groups spanning two microbatches (one Phase A, one Phase C) and old-policy scoring passes (no grad), each
    prompt with two images; the example's test covers whole groups per microbatch."""
    geometry = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "num_iterations": 2,
                "max_steps": 1}
    processor = synthetic_vision.make_processor()
    model = synthetic_vision.make_model(processor, hidden=32)
    dataset = synthetic_vision.make_dataset(rows=8, images=2)
    images = counting(processor)
    stock = train_trainer(GRPOTrainer, copy.deepcopy(model), processor, dataset, tmp_path, **geometry)
    stock_images = sum(images)
    ours = train_trainer(PrefixFlowGRPOTrainer, copy.deepcopy(model), processor, dataset, tmp_path, **geometry)
    # One generation: each of its two processor calls ran every row once, as a check, and each distinct row (a
    # group's: num_generations=4 rows) once more.
    assert sum(images) - stock_images == stock_images + stock_images // 4
    for expected, actual in zip(stock[0], ours[0]):
        assert expected.keys() == actual.keys()
        assert any(n.startswith("model.visual") for n in actual), "the vision tower got no gradient"
        for name in expected:
            assert_rel_close(actual[name], expected[name], f"grad {name}", rtol=2e-4)
    for name in stock[1]:
        torch.testing.assert_close(ours[1][name], stock[1][name], rtol=0, atol=1e-5, msg=name)
    for expected, actual in zip(stock[2], ours[2]):
        assert actual["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-5)
        assert actual.get("reward") == expected.get("reward")
        assert actual["prefixflow/groups"] > 0 and "prefixflow/fallback_rows" not in actual
    assert any(log.get("prefixflow/scoring_groups", 0) > 0 for log in ours[2])  # the old policy's log-probs too


def test_a_refused_model_trains_image_rows_on_the_plain_path(tmp_path, rows_in_sampler_order, monkeypatch, caplog):
    monkeypatch.setattr(mm, "probe", lambda model: ("no image probe (test)", None))
    processor = synthetic_vision.make_processor()
    model = synthetic_vision.make_model(processor, hidden=32)
    with pytest.warns(UserWarning, match="no image probe"):
        _, _, logs = train_trainer(PrefixFlowGRPOTrainer, model, processor, synthetic_vision.make_dataset(8), tmp_path)
    assert [log["prefixflow/fallback_rows"] for log in logs] == [8, 8]
    warned = [r for r in caplog.records if "no image probe (test)" in r.getMessage()]
    assert len(warned) == 1 and "prefixflow/fallback_rows" in warned[0].getMessage()


def test_the_vision_example_trains_both_trainers_identically(tmp_path):
    results = grpo_vision.main(["--steps", "2", "--hidden", "32", "--num-generations", "4", "--batch-size", "4",
                                "--out", str(tmp_path)])
    for stock, ours in zip(results["stock"], results["prefixflow"]):
        assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-4, abs=1e-5) and ours["reward"] == stock["reward"]
        assert ours["prefixflow/groups"] > 0 and "prefixflow/fallback_rows" not in ours
