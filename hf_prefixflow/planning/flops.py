"""FLOP accounting: what a group costs as N full sequences versus one prefix pass plus N suffix passes.

Per layer, with `W` the layer's matmul weights, `h` = query heads x head dim and a sequence of `T` tokens,
training costs `6 W T + 6 h T^2` (causal attention: `12 h T^2 / 2`), and the LM head `6 d V` per scored token.
PrefixFlow pays the prefix terms once and, per suffix of `S` tokens, `6 W S + 12 h (S P + S^2 / 2)`. Forward-only
scoring costs a third of each term. The ratio is the speedup no implementation can beat on compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# The cost model's default threshold: a group is shared when its FLOP bound reaches this. Calibrated: PrefixFlow
# realises most of the bound on GPU, not all of it (docs/benchmarks.md, docs/limits.md).
MIN_SPEEDUP = 1.1
# The least work, in tokens, that one forward and backward pass costs on a GPU however few tokens it carries (per-layer
# launches and Python, TRL's per-microbatch bookkeeping). Calibrated from trainer steps (docs/benchmarks.md#trainer)
# on the Qwen3-1.7B shape. That cost is time per layer, the same for a wider layer, so it counts as this many tokens
# of a Qwen3-1.7B layer's matmul work (`FLOOR_LAYER_WEIGHTS`) in each layer of any model: fewer tokens of a wider one.
PASS_FLOOR_TOKENS = 7500
FLOOR_LAYER_WEIGHTS = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144


@dataclass(frozen=True)
class ModelShape:
    """What a decoder's training FLOPs depend on; every method counts FLOPs of a whole model.

    Attributes:
        layers: decoder layers.
        hidden: hidden size `d`.
        attention_width: query heads x head dim (`h`).
        layer_weights: matmul parameters a token meets in one layer (`W`; active experts only for MoE).
        vocab: vocabulary size `V`.
    """

    layers: int
    hidden: int
    attention_width: int
    layer_weights: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """The shape of a transformers config (its text config for an image-text model).

        Args:
            config: a `PretrainedConfig` with `hidden_size`, `num_attention_heads`, `intermediate_size` (or
                `moe_intermediate_size` with `num_experts_per_tok`), `num_hidden_layers` and `vocab_size`.

        Returns:
            The `ModelShape`.
        """
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
        """FLOPs of one group as N full sequences `[P || S_i]`, the LM head on completion tokens only.

        Args:
            prefix: P, prompt tokens.
            suffixes: `[S_1, ..., S_N]`, completion tokens per row.
            train: forward and backward; False: forward only (a third).

        Returns:
            The FLOP count.
        """
        flops = sum(self._tokens(prefix + s, 0) + self._head(s) for s in suffixes)
        return flops if train else flops / 3

    def prefixflow(self, prefix: int, suffixes: list[int], train: bool = True) -> float:
        """FLOPs of one group under PrefixFlow: the prompt once, each completion attending to it.

        Args:
            prefix, suffixes, train: as in `full_sequence`.

        Returns:
            The FLOP count.
        """
        flops = self._tokens(prefix, 0) + sum(self._tokens(s, prefix) + self._head(s) for s in suffixes)
        return flops if train else flops / 3

    def bound(self, prefix: int, suffixes: list[int]) -> float:
        """The FLOP bound on the speedup of one group: `full_sequence / prefixflow`.

        Args:
            prefix, suffixes: as in `full_sequence`.
        """
        return self.full_sequence(prefix, suffixes) / self.prefixflow(prefix, suffixes)

    def step_bound(self, prefix: int, suffixes: list[int], rows_per_pass: int | None = None,
                   floor_tokens: int = 0) -> float:
        """The speedup bound when every pass costs at least `floor_tokens` tokens' work: the plain path runs the
        group's rows in passes of `rows_per_pass`, PrefixFlow its prefix in one pass (Phase A and C) and its
        suffixes in one.

        Args:
            prefix, suffixes: as in `full_sequence`.
            rows_per_pass: rows per plain-path microbatch; None: all rows in one.
            floor_tokens: the least work per pass, in tokens of the calibration shape's layers (`PASS_FLOOR_TOKENS`
                on a GPU); 0: `bound`.

        Returns:
            The ratio of the plain path's FLOPs to PrefixFlow's, each pass raised to the floor.
        """
        floor = floor_tokens * 6 * FLOOR_LAYER_WEIGHTS * self.layers
        per = rows_per_pass or len(suffixes)
        plain = sum(max(floor, self.full_sequence(prefix, suffixes[i:i + per])) for i in range(0, len(suffixes), per))
        waves = sum(self._tokens(s, prefix) + self._head(s) for s in suffixes)
        return plain / (max(floor, self._tokens(prefix, 0)) + max(floor, waves))

    def pays(self, prefix: int, suffixes: list[int], min_speedup: float = MIN_SPEEDUP, rows_per_pass: int | None = None,
             floor_tokens: int = 0) -> bool:
        """The cost model's verdict: share this group's prefix, or train its rows on the plain path.

        Args:
            prefix, suffixes, rows_per_pass, floor_tokens: as in `step_bound`.
            min_speedup: the threshold.

        Returns:
            True (share) when `step_bound` reaches `min_speedup`.
        """
        return self.step_bound(prefix, suffixes, rows_per_pass, floor_tokens) >= min_speedup
