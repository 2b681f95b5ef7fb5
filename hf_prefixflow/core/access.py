"""What PrefixFlow reads of a model: the transformers model inside wrappers, its decoder and stored settings, and the
checks of how it is trained (checkpointing, randomness) that every phase relies on."""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from transformers import PreTrainedModel

from .. import _compat as compat
from ..config import PrefixFlowConfig
from ..errors import PrefixFlowError


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


def takes_images(model: torch.nn.Module) -> bool:
    """Whether `model` (or the transformers model inside it) takes images."""
    return callable(getattr(unwrap(model), "get_image_features", None))


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


def attribute(module: torch.nn.Module, name: str, default=None):
    """`getattr(module, name, default)` for a plain attribute (a flag, a number, a marker), read without
    `nn.Module.__getattr__`: that fallback looks the name up among parameters, buffers and submodules and raises
    for every name a module lacks, several microseconds a read, which walks over every module of a model and
    per-layer attention calls would otherwise pay for each module without the attribute."""
    if hasattr(type(module), name):  # a class attribute or property: as `getattr` reads it
        return getattr(module, name, default)
    return module.__dict__.get(name, default)


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


def check_checkpointing(model: torch.nn.Module) -> None:
    """Refuse reentrant activation checkpointing: its Phase A K/V carry no graph, so Phase C could not run.

    Args:
        model: the model as trained (wrappers included); every module with `gradient_checkpointing` on is checked.

    Raises:
        PrefixFlowError: a module checkpoints without `use_reentrant=False`.
    """
    for name, module in model.named_modules():
        if not attribute(module, "gradient_checkpointing", False):
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
        for knob in NOISE_ATTRIBUTES:
            value = attribute(module, knob)
            if isinstance(value, float) and value > 0:
                found.append(f"{name} ({type(module).__name__}.{knob}={value})")
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
    modules = list(model.modules())
    if any(type(m).__name__ == "CheckpointWrapper" for m in modules):
        raise PrefixFlowError(
            "suffix_checkpointing=False suspends transformers' layer checkpointing, but this model is wrapped in "
            "torch checkpoint wrappers (e.g. FSDP activation_checkpointing); keep suffix_checkpointing=True."
        )
    layers = [m for m in modules if attribute(m, "gradient_checkpointing", False)]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True
