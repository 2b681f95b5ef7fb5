"""Tiny random-init decoders of every family the suite covers, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MixtralConfig,
    MixtralForCausalLM,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)

# family -> (model class, config class, config overrides, attention implementation)
FAMILIES = {
    "gpt2": (GPT2LMHeadModel, GPT2Config, {}, "sdpa"),  # learned absolute positions, no RoPE
    "llama": (LlamaForCausalLM, LlamaConfig, {}, "sdpa"),
    "llama_eager": (LlamaForCausalLM, LlamaConfig, {}, "eager"),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}, "sdpa"),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}, "sdpa"),  # q/k norms
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 5}, "sdpa"),
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config,
        {"sliding_window": 5, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "num_hidden_layers": 3},
        "eager",
    ),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "num_hidden_layers": 3},
        "sdpa",
    ),
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1},
        "sdpa",
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
        "sdpa",
    ),
    "smollm3": (
        SmolLM3ForCausalLM,
        SmolLM3Config,
        {"no_rope_layers": [1, 0], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        "sdpa",
    ),  # a layer without RoPE
    "gpt_oss": (
        GptOssForCausalLM,
        GptOssConfig,
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
         "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0}},
        "eager",  # attention sinks
    ),
}

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def build(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, attn: str | None = None, **overrides):
    """A tiny model of `family` with random weights (scaled up so attention is far from uniform)."""
    model_cls, config_cls, family_overrides, default_attn = FAMILIES[family]
    base = GPT2 if config_cls is GPT2Config else COMMON
    config = config_cls(**{**base, **family_overrides, **overrides})
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.set_attn_implementation(attn or default_attn)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25)
    return model
