"""FLOP accounting: what a group costs as N full sequences versus one prefix pass plus N suffix passes.

Per layer, with `W` the layer's matmul weights, `h` = query heads x head dim and a sequence of `T` tokens,
training costs `6 W T + 6 h T^2` (causal attention: `12 h T^2 / 2`), and the LM head `6 d V` per scored token.
PrefixFlow pays the prefix terms once and, per suffix of `S` tokens, `6 W S + 12 h (S P + S^2 / 2)`. Forward-only
scoring costs a third of each term. The ratio is the speedup no implementation can beat on compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# The cost model: a group is shared when its FLOP bound reaches this. On an H200 PrefixFlow realises 93-100% of the
# bound (benchmarks/results/latest.md), so the gain is about 0.95x the bound and below ~1.1 it would not pay.
MIN_SPEEDUP = 1.1
# On a GPU every forward and backward pass costs at least about this many tokens' work however few it carries: the
# launches and Python of each checkpointed layer, and TRL's per-microbatch bookkeeping. On an H200 at the Qwen3-1.7B
# shape a TRL microbatch of 2,048 tokens took as long as one of 8,192 (benchmarks/results/2026-12-02_trainer_step).
PASS_FLOOR_TOKENS = 7500


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    attention_width: int  # query heads x head dim
    layer_weights: int  # matmul parameters a token meets in one layer (active experts only for MoE)
    vocab: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        d = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        q = config.num_attention_heads * head_dim
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        attention = 2 * d * q + 2 * d * kv * head_dim
        experts = getattr(config, "num_experts_per_tok", None)
        if experts:
            width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            mlp = experts * 3 * d * width
        else:
            mlp = 3 * d * config.intermediate_size
        return cls(config.num_hidden_layers, d, q, attention + mlp, config.vocab_size)

    def _tokens(self, tokens: int, context: int) -> float:
        """Training FLOPs of `tokens` new tokens after `context` earlier ones, across all layers."""
        attention = 12 * self.attention_width * (tokens * context + tokens * tokens / 2)
        return (6 * self.layer_weights * tokens + attention) * self.layers

    def _head(self, tokens: int) -> float:
        return 6 * self.hidden * self.vocab * tokens

    def full_sequence(self, prefix: int, suffixes: list[int], train: bool = True) -> float:
        flops = sum(self._tokens(prefix + s, 0) + self._head(s) for s in suffixes)
        return flops if train else flops / 3

    def prefixflow(self, prefix: int, suffixes: list[int], train: bool = True) -> float:
        flops = self._tokens(prefix, 0) + sum(self._tokens(s, prefix) + self._head(s) for s in suffixes)
        return flops if train else flops / 3

    def bound(self, prefix: int, suffixes: list[int]) -> float:
        """The FLOP bound on the speedup of one group."""
        return self.full_sequence(prefix, suffixes) / self.prefixflow(prefix, suffixes)

    def step_bound(self, prefix: int, suffixes: list[int], rows_per_pass: int | None = None,
                   floor_tokens: int = 0) -> float:
        """The speedup bound when every pass costs at least `floor_tokens` tokens' work: the plain path runs the
        group's rows in passes of `rows_per_pass` (default: one pass), PrefixFlow its prefix in one pass (Phase A and
        C) and its suffixes in one. With `floor_tokens=0` this is `bound`."""
        floor = floor_tokens * self._tokens(1, 0)
        per = rows_per_pass or len(suffixes)
        plain = sum(max(floor, self.full_sequence(prefix, suffixes[i:i + per])) for i in range(0, len(suffixes), per))
        waves = sum(self._tokens(s, prefix) + self._head(s) for s in suffixes)
        return plain / (max(floor, self._tokens(prefix, 0)) + max(floor, waves))

    def pays(self, prefix: int, suffixes: list[int], min_speedup: float = MIN_SPEEDUP, rows_per_pass: int | None = None,
             floor_tokens: int = 0) -> bool:
        """The cost model's verdict: share this group's prefix, or train its rows on the plain path."""
        return self.step_bound(prefix, suffixes, rows_per_pass, floor_tokens) >= min_speedup
