"""`apply_prefixflow`: switch any HF decoder (or PEFT wrapper) to the PrefixFlow attention and check it can be exact."""

from __future__ import annotations

import copy
import re

import torch
from transformers import PretrainedConfig, PreTrainedModel

from .config import PrefixFlowConfig
from .core import attention
from .core.access import config_of, decoder_of, unwrap
from .core.switch import check_base, enable
from .errors import PrefixFlowError
from .models import multimodal, probe, structure

# RoPE types whose frequencies transformers recomputes from the batch's longest position
# (`modeling_rope_utils.dynamic_rope_update`: any type naming "dynamic", and "longrope"); every other type's
# frequencies are fixed at construction (`proportional`, `llama3`, `yarn`, a family's own `ntk_alpha` ...).
LENGTH_DEPENDENT_ROPE = re.compile(r"dynamic|^longrope$")


def apply_prefixflow(
    model: torch.nn.Module, config: PrefixFlowConfig | None = None, *, offload: bool | None = None,
    offload_kv: bool | None = None, suffix_checkpointing: bool | None = None, prefix_recompute: float | None = None,
    kv_grad_dtype: torch.dtype | str | None = None,
) -> torch.nn.Module:
    """Switch `model` (a transformers decoder or a PEFT wrapper of one) to PrefixFlow's attention; returns it.

    Idempotent. Outside a `prefix_group` the model computes exactly what it did before: the attention function
    delegates to the implementation the model had (`sdpa`, `eager` or `flex_attention`). MoE routers also accept
    recorded routes through the `prefixflow_routes` kwarg (see `core.moe`).

    Args:
        model: the model to train. Checked once, at the first call: token mixers other than attention, attention
            outside transformers' AttentionInterface and dynamic RoPE are refused (`PrefixFlowError`), and a tiny
            float64 copy of the architecture trains one group both ways (`models.probe`); an image-text
            model's copy also trains an image prompt, whose refusal is kept for image prompts
            (`models.multimodal.check`).
        config: the settings (`PrefixFlowConfig`); replaces the stored one. Default: keep the stored one.
        offload, offload_kv, suffix_checkpointing, prefix_recompute, kv_grad_dtype: single settings of
            `PrefixFlowConfig` applied on top; `None` keeps the current value of each.

    Returns:
        `model` itself, switched (its transformers model now holds the settings and a config object of its own).

    Raises:
        PrefixFlowError: an unsupported attention implementation, architecture or RoPE; a probe that fails, or that
            could not run without `allow_unprobed`; invalid settings (see `PrefixFlowConfig`).
    """
    inner = unwrap(model)
    settings = (config or config_of(inner)).replace(
        offload=offload, offload_kv=offload_kv, suffix_checkpointing=suffix_checkpointing,
        prefix_recompute=prefix_recompute, kv_grad_dtype=kv_grad_dtype)
    if not attention.is_wrapped(inner.config._attn_implementation):
        check_base(inner)
        structure.check_structure(inner)
        _check_rope(inner)
        probed = multimodal.check(inner)  # image prompts; a prefix-LM's probe covers its text prompts too
        if probed is None:
            probed = probe.probe(inner)
        if probed.skipped and not settings.allow_unprobed:
            raise PrefixFlowError(
                f"PrefixFlow could not verify {type(inner).__name__}: {probed.skipped}. Its structure passed the "
                "checks, but its gradients were never compared with full sequences. Pass "
                "PrefixFlowConfig(allow_unprobed=True) to train it anyway, unverified."
            )
        _own_config(inner)
        enable(inner)
        probe.bridge(inner, probed)
    inner._prefixflow_config = settings
    return model


def _own_config(model: PreTrainedModel) -> None:
    """Give `model` a config object of its own before switching its attention, so that another model built from
    the same config object stays as it was. Modules read the attention implementation from their `config`."""
    shared = model.config
    private = copy.deepcopy(shared)
    mapping = {id(shared): private}
    for name, value in vars(shared).items():
        if isinstance(value, PretrainedConfig):  # text / vision configs, which their modules hold
            mapping[id(value)] = getattr(private, name)
    for module in model.modules():
        replacement = mapping.get(id(getattr(module, "config", None)))
        if replacement is not None:
            module.config = replacement


def _check_rope(model: PreTrainedModel) -> None:
    # The decoder's: a vision tower's RoPE rotates each whole image alike in both schedules.
    for name, module in decoder_of(model).named_modules():
        rope_type = getattr(module, "rope_type", None)
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type] if rope_type else []
        for kind in types:
            if isinstance(kind, str) and LENGTH_DEPENDENT_ROPE.search(kind):
                raise PrefixFlowError(
                    f"{name} uses rope_type={kind!r}, whose frequencies depend on the longest position in the batch, "
                    "so a prefix rotated alone differs from the same prefix inside [P || S]. Use a static RoPE "
                    "(one whose frequencies are fixed: default, linear, llama3, yarn, proportional ...), e.g. rope "
                    "'linear' or 'yarn' with the same factor."
                )
