"""`apply_prefixflow`: switch any HF decoder (or PEFT wrapper) to the PrefixFlow attention and check it can be exact."""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings

import torch
from transformers import PretrainedConfig, PreTrainedModel

from . import _compat as compat
from . import architecture, attention, moe, states
from .errors import PrefixFlowError
from .config import PrefixFlowConfig

# RoPE types whose frequencies transformers recomputes from the batch's longest position
# (`modeling_rope_utils.dynamic_rope_update`: any type naming "dynamic", and "longrope"); every other type's
# frequencies are fixed at construction (`proportional`, `llama3`, `yarn`, a family's own `ntk_alpha` ...).
LENGTH_DEPENDENT_ROPE = re.compile(r"dynamic|^longrope$")


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside DDP / DeepSpeed engines and PEFT (or similar) wrappers.

    Args:
        model: a `PreTrainedModel`, or wrappers of one that expose it as `.module` or `get_base_model()`.

    Returns:
        The innermost `PreTrainedModel` (the same object the wrappers hold).

    Raises:
        PrefixFlowError: no `PreTrainedModel` inside.
    """
    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, PreTrainedModel):
        raise PrefixFlowError(
            f"apply_prefixflow needs a transformers PreTrainedModel or a peft PeftModel, got {type(model).__name__}."
        )
    return inner


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings + layers, no LM head) that Phase A runs over the prefix.

    Args:
        model: a transformers model or a wrapper of one.

    Returns:
        `get_decoder()` of the unwrapped model, or its `base_model` when it has none.
    """
    inner = unwrap(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    return decoder if decoder is not None else inner.base_model


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


def check_checkpointing(model: torch.nn.Module) -> None:
    """Refuse reentrant activation checkpointing: its Phase A K/V carry no graph, so Phase C could not run.

    Args:
        model: the model as trained (wrappers included); every module with `gradient_checkpointing` on is checked.

    Raises:
        PrefixFlowError: a module checkpoints without `use_reentrant=False`.
    """
    for name, module in model.named_modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        if compat.checkpoint_function_kwargs(module).get("use_reentrant", True) is not False:
            raise PrefixFlowError(
                f"{name or type(module).__name__} uses reentrant activation checkpointing, which detaches the prefix "
                "K/V from the prefix graph. Enable it as "
                "model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False}) "
                "(gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) before transformers 5.24)."
            )


# Module attributes that draw noise in training outside dropout modules (MoE router and input jitter).
NOISE_ATTRIBUTES = ("jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps")


def _random_in_training(model: torch.nn.Module) -> list[str]:
    """Modules that draw random numbers in training: active dropout, and jitter knobs above zero."""
    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found.append(f"{name} (dropout p={module.p})")
        for attribute in NOISE_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, float) and value > 0:
                found.append(f"{name} ({type(module).__name__}.{attribute}={value})")
    return found


def warn_shared_randomness(model: torch.nn.Module) -> None:
    """Warn once per model that randomness drawn in training (dropout modules, MoE jitter) is drawn once per group
    over the prompt, so the group's completions share those draws.

    Args:
        model: the model as trained; modules in training mode with dropout `p > 0` or a `NOISE_ATTRIBUTES` knob
            above 0 count.
    """
    inner = unwrap(model)
    if getattr(inner, "_prefixflow_dropout_warned", False):
        return
    found = _random_in_training(model)
    if found:
        inner._prefixflow_dropout_warned = True
        warnings.warn(
            f"{len(found)} modules draw random numbers in training (e.g. {found[0]}): PrefixFlow runs the prompt once "
            "per group, so their draws over the prompt (dropout masks, router or input jitter) are made once and "
            "shared by the group's completions, where full sequences draw one per completion. The expected gradient "
            "is the same, the sample is not. For training equal to full sequences set them to 0 (e.g. "
            "LoraConfig(lora_dropout=0.0), config.router_jitter_noise=0.0).", stacklevel=3)


def config_of(model: torch.nn.Module) -> PrefixFlowConfig:
    """The settings `apply_prefixflow` stored on `model`.

    Args:
        model: a transformers model or a wrapper of one.

    Returns:
        The stored `PrefixFlowConfig`, or a default one if none is stored.
    """
    return getattr(unwrap(model), "_prefixflow_config", None) or PrefixFlowConfig()


def kv_grad_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype gK/gV sum in across waves.

    Args:
        model: the model as trained; its trainable floating-point parameters are read.

    Returns:
        The config's `kv_grad_dtype` if set, else the widest dtype of the trainable parameters, the precision their
        own gradients accumulate in across microbatches: bf16 for bf16 weights (as the full-sequence baseline's
        `param.grad`), fp32 with fp32 weights under autocast or PEFT's fp32 adapters; fp32 with nothing trainable.
    """
    setting = config_of(model).kv_grad_dtype
    if setting is not None:
        return setting
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def apply_prefixflow(
    model: torch.nn.Module, config: PrefixFlowConfig | None = None, *, offload: bool | None = None,
    offload_kv: bool | None = None, suffix_checkpointing: bool | None = None, prefix_recompute: float | None = None,
    kv_grad_dtype: torch.dtype | str | None = None,
) -> torch.nn.Module:
    """Switch `model` (a transformers decoder or a PEFT wrapper of one) to PrefixFlow's attention; returns it.

    Idempotent. Outside a `prefix_group` the model computes exactly what it did before: the attention function
    delegates to the implementation the model had (`sdpa`, `eager` or `flex_attention`). MoE routers also accept
    recorded routes through the `prefixflow_routes` kwarg (see `hf_prefixflow.moe`).

    Args:
        model: the model to train. Checked once, at the first call: token mixers other than attention, attention
            outside transformers' AttentionInterface and dynamic RoPE are refused (`PrefixFlowError`), and a tiny
            float64 copy of the architecture trains one group both ways (`architecture.probe`); an image-text
            model's copy also trains an image prompt, whose refusal is kept for image prompts (`multimodal.check`).
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
        _check_base(inner)
        architecture.check_structure(inner)
        _check_rope(inner)
        from . import multimodal  # imports the scheduler, which imports this module

        probed = multimodal.check(inner)  # image prompts; a prefix-LM's probe covers its text prompts too
        if probed is None:
            probed = architecture.probe(inner)
        if probed.skipped and not settings.allow_unprobed:
            raise PrefixFlowError(
                f"PrefixFlow could not verify {type(inner).__name__}: {probed.skipped}. Its structure passed the "
                "checks, but its gradients were never compared with full sequences. Pass "
                "PrefixFlowConfig(allow_unprobed=True) to train it anyway, unverified."
            )
        _own_config(inner)
        enable(inner)
        architecture.bridge(inner, probed)
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


def _check_base(model: PreTrainedModel) -> None:
    current = model.config._attn_implementation
    if current not in attention.SUPPORTED_BASES:
        raise PrefixFlowError(
            f"attention implementation {current!r} is not supported; load the model with attn_implementation "
            f"in {attention.SUPPORTED_BASES} ('sdpa' runs the flash and cuDNN kernels on GPU)."
        )


def enable(model: torch.nn.Module) -> PreTrainedModel:
    """Switch the attention from `X` to `prefixflow_X` and let MoE routers replay; no architecture checks (used on
    the probe's tiny copy). Idempotent.

    Args:
        model: a transformers model or a wrapper of one, on attention `sdpa`, `eager` or `flex_attention`.

    Returns:
        The unwrapped model, switched.

    Raises:
        PrefixFlowError: another attention implementation, or a model that does not route attention through
            transformers' `AttentionInterface`.
    """
    inner = unwrap(model)
    current = inner.config._attn_implementation
    if not attention.is_wrapped(current):
        _check_base(inner)
        inner.set_attn_implementation(attention.wrapped_name(current))
        if inner.config._attn_implementation != attention.wrapped_name(current):
            raise PrefixFlowError(
                f"{type(inner).__name__} did not switch its attention implementation to PrefixFlow's: it does not "
                "route attention through transformers' AttentionInterface. Train this model with the plain trainer."
            )
    moe.enable_replay(inner)  # routers replay `prefixflow_routes` when a forward carries them
    states.enable_states(inner)  # recurrent mixers read the group's prefix state
    from . import multimodal

    if multimodal.is_multimodal(inner):
        multimodal.mark_towers(inner)
    return inner


@contextlib.contextmanager
def checkpointing_suspended(model: PreTrainedModel):
    """Run the enclosed forward without transformers' per-layer activation checkpointing (its backward then uses
    the saved activations: the same values, as non-reentrant checkpointing recomputes them exactly).

    Args:
        model: the unwrapped transformers model; layers with `gradient_checkpointing` on are switched off for the
            block and back on after it.

    Raises:
        PrefixFlowError: the model holds torch `CheckpointWrapper`s, which this cannot suspend.
    """
    if any(type(m).__name__ == "CheckpointWrapper" for m in model.modules()):
        raise PrefixFlowError(
            "suffix_checkpointing=False suspends transformers' layer checkpointing, but this model is wrapped in "
            "torch checkpoint wrappers (e.g. FSDP activation_checkpointing); keep suffix_checkpointing=True."
        )
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True
