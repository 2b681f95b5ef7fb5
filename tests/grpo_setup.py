"""A tiny, offline GRPO setup: a local word-level tokenizer, a random-init model, prompts, rewards, frozen rollouts."""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback)

WORDS = [f"w{i}" for i in range(90)]
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", padding_side="left")


def _random_init(model_class, config, seed: int, dtype=torch.float32):
    """`model_class(config)` in `dtype` with its matrices drawn from N(0, 0.2^2) under `seed` (wide enough that the
    tiny model's outputs depend on its inputs)."""
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    return model


def make_model(seed: int = 0, dtype=torch.float32, **overrides) -> Qwen3ForCausalLM:
    config = Qwen3Config(**{**dict(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                   tie_word_embeddings=False), **overrides})
    return _random_init(Qwen3ForCausalLM, config, seed, dtype)


def make_moe_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                            pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    return _random_init(Qwen3MoeForCausalLM, config, seed)


def make_gpt_oss_model(seed: int = 0) -> GptOssForCausalLM:
    """A tiny gpt-oss: attention sinks, sliding and full layers, its own router."""
    config = GptOssConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=16,
                          num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    config._attn_implementation = "eager"  # attention sinks
    return _random_init(GptOssForCausalLM, config, seed)


def make_dataset(prompts: int = 4, seed: int = 0, lengths=(12, 30)) -> Dataset:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*lengths))) for _ in range(prompts)]
    return Dataset.from_dict({"prompt": texts})


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c.split()) % 3) + 0.1 * c.count("w1") for c in completions]


def freeze_rollouts(trainer, max_length: int, seed: int = 0, per_prompt: bool = False) -> None:
    """Replace sampling by completions that depend only on the prompt and the call count: both trainers see the
    same rollouts however their weights drift. `per_prompt` numbers each prompt's copies on their own, so a
    prompt's rollouts do not depend on which process, or how many, generated the batch."""
    calls = {"n": 0}
    eos = 1

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls["n"] += 1
        out = []
        seen: dict[tuple, int] = {}
        for index, prompt in enumerate(prompt_ids):
            if per_prompt:
                index = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
            rng = random.Random(hash((tuple(prompt), index, calls["n"], seed)) & 0xFFFFFFFF)
            length = rng.randint(1, max_length)
            tokens = [rng.randrange(3, len(SPECIALS) + len(WORDS)) for _ in range(length)]
            if length < max_length and rng.random() < 0.7:
                tokens[-1] = eos
            out.append(tokens)
        return out, None

    trainer._generate_single_turn = generate


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return key


def simulate_tool_calls(trainer, result=(10, 11, 12)) -> None:
    """TRL's tool loop for a tokenizer without a tool chat template: every other row calls `lookup`, whose result
    tokens are appended (tool_mask 0), and the model generates again from prompt + completion + result (TRL's
    `_generate_single_turn`, one completion per row), within max_completion_length."""
    trainer.tools = [lookup]

    def loop(prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        budget = trainer.max_completion_length - len(result)
        calling = [i for i, ids in enumerate(completion_ids) if i % 2 == 0 and len(ids) < budget]
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        if calling:
            contexts = [prompt_ids[i] + completion_ids[i] + list(result) for i in calling]
            later, _ = trainer._generate_single_turn(contexts, None, {}, 1)
            for i, more in zip(calling, later):
                more = more[: budget - len(completion_ids[i])]
                completion_ids[i] = completion_ids[i] + list(result) + more
                tool_mask[i] += [0] * len(result) + [1] * len(more)
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return tool_mask, texts, completion_ids, logprobs, len(calling), 0, [[] for _ in completion_ids]

    trainer._tool_call_loop = loop


def frozen_rollout_func(prompts: list[str], trainer) -> dict:
    """A custom rollout (TRL's `rollout_func`): completions that depend only on the prompt and its copy's index."""
    prompt_ids = [trainer.processing_class(text)["input_ids"] for text in prompts]
    completion_ids = []
    for index, ids in enumerate(prompt_ids):
        rng = random.Random(hash((tuple(ids), index)) & 0xFFFFFFFF)
        completion_ids.append([rng.randrange(3, len(SPECIALS) + len(WORDS)) for _ in range(rng.randint(1, 6))])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


class GradientRecorder(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
