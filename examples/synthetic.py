"""A synthetic long-prefix RAG task, a word-level tokenizer built locally, and a tiny model: runnable offline.

Each prompt is a stack of retrieved passages ("the key of door 17 is 4092 .") followed by a question ("what is
the key of door 17 ?"); the reward checks that the answer appears in the completion. Prompts are long and
completions short, the regime PrefixFlow is for.
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<pad>", "<eos>", "<bos>"]
TEMPLATE = ["passage", ":", "the", "key", "of", "door", "is", ".", "question", "what", "?", "answer"]
NUMBERS = [str(n) for n in range(100)]  # small enough that a random policy sometimes answers


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the task's vocabulary (no download)."""
    vocab = {token: i for i, token in enumerate(SPECIALS + TEMPLATE + NUMBERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", padding_side="left")


def make_dataset(rows: int, passages: int, seed: int = 0) -> Dataset:
    """`rows` prompts of `passages` passages (about 9 tokens each) and one question; columns prompt, answer."""
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(rows):
        doors = rng.sample(range(len(NUMBERS)), passages)
        keys = [rng.randrange(len(NUMBERS)) for _ in doors]
        context = " ".join(f"passage {i} : the key of door {d} is {k} ." for i, (d, k) in enumerate(zip(doors, keys)))
        asked = rng.randrange(passages)
        prompts.append(f"{context} question : what is the key of door {doors[asked]} ? answer :")
        answers.append(str(keys[asked]))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def answer_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 if the answer appears among the completion's words, else 0: verifiable, no judge."""
    return [float(expected in completion.split()) for completion, expected in zip(completions, answer)]


def make_model(tokenizer: PreTrainedTokenizerFast, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A tiny random-init Qwen3-style decoder sized to the tokenizer."""
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=8192, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)
