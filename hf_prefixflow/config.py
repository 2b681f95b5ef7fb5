"""`PrefixFlowConfig`: every setting of the low-level API in one validated object, stored once on the model."""

from __future__ import annotations

import dataclasses

import torch

from .errors import PrefixFlowError

# The share of prefix layers recomputed in Phase C instead of copied back under offload (the `prefix_recompute`
# default): calibrated on GPU, where a layer recomputes faster than its activations cross PCIe (docs/offload.md,
# docs/benchmarks.md).
RECOMPUTE_SHARE = 1.0
# The dtype names `kv_grad_dtype` accepts, here and as the trainers' prefixflow_kv_grad_dtype: one table.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class PrefixFlowConfig:
    """How PrefixFlow trains a model; checked once here, read by every phase through `config_of(model)`.

    Args:
        offload: keep the prefix graph's dormant saved tensors in a host pool between Phase A and Phase C.
        offload_kv: also keep the prefix K/V and their gradient sums (gK/gV) on the host, each layer's brought to the
            device for its turn in every wave and in Phase C (implies `offload`). Under activation checkpointing
            Phase B then holds about two layers' of them instead of all, for the longest prompts (waves that keep
            their activations keep each layer's K/V they read until their backward); it costs host-device traffic
            of about four times the K/V bytes per wave (two reads of each layer's K/V under checkpointing, its sum
            in and out).
        prefix_recompute: share of prefix layers in [0, 1] that Phase A checkpoints and Phase C recomputes. `None`:
            `RECOMPUTE_SHARE` with offload (recomputing beats copying activations back), 0 without.
        suffix_checkpointing: with activation checkpointing on, `False` runs suffix waves without it (their backward
            skips the recompute; the prefix stays checkpointed).
        kv_grad_dtype: the dtype gK/gV sum in across waves (a `torch.dtype` or its name). `None`: the widest dtype of
            the trainable parameters, the precision their own gradients accumulate in.
        allow_unprobed: train a model whose architecture `apply_prefixflow` could not probe (no tiny copy could be
            built or run) on the strength of its structure checks alone. Off: such a model is refused.

    Raises:
        PrefixFlowError: `prefix_recompute` is not a number in [0, 1], or `kv_grad_dtype` is neither a floating-point
            `torch.dtype` nor one of its names (`"float32"`, `"bfloat16"`, `"float16"`, `"float64"`).
    """

    offload: bool = False
    offload_kv: bool = False
    prefix_recompute: float | None = None
    suffix_checkpointing: bool = True
    kv_grad_dtype: torch.dtype | str | None = None
    allow_unprobed: bool = False

    def __post_init__(self) -> None:
        share = self.prefix_recompute
        if share is not None and not (isinstance(share, (int, float)) and 0.0 <= share <= 1.0):
            raise PrefixFlowError(f"prefix_recompute is the share of prefix layers that Phase C recomputes, a number "
                                  f"in [0, 1]; got {share!r}.")
        dtype = DTYPES.get(self.kv_grad_dtype, self.kv_grad_dtype) if isinstance(self.kv_grad_dtype, str) \
            else self.kv_grad_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise PrefixFlowError(f"kv_grad_dtype must be a floating-point torch.dtype or one of {sorted(DTYPES)}, "
                                  f"got {self.kv_grad_dtype!r}.")
        object.__setattr__(self, "kv_grad_dtype", dtype)
        object.__setattr__(self, "offload_kv", bool(self.offload_kv))
        object.__setattr__(self, "offload", bool(self.offload) or self.offload_kv)
        object.__setattr__(self, "suffix_checkpointing", bool(self.suffix_checkpointing))
        if share is not None:
            object.__setattr__(self, "prefix_recompute", float(share))

    @property
    def recompute_share(self) -> float:
        """The share of prefix layers Phase C recomputes, the default resolved."""
        if self.prefix_recompute is not None:
            return self.prefix_recompute
        return RECOMPUTE_SHARE if self.offload else 0.0

    def replace(self, **changes) -> "PrefixFlowConfig":
        """A copy with `changes` applied.

        Args:
            **changes: field values; `None` keeps the current value.

        Returns:
            A new, validated `PrefixFlowConfig`.

        Raises:
            PrefixFlowError: an invalid value (see the class); TypeError for an unknown field.
        """
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})
