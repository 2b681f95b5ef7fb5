"""The switch: a model's attention function becomes PrefixFlow's, its routers replay and its recurrent mixers read
the group's states. No checks of what the model can train exactly (those are `apply_prefixflow`'s)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..errors import PrefixFlowError
from . import attention, moe, states
from .access import decoder_of, takes_images, unwrap


def check_base(model: PreTrainedModel) -> None:
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
        check_base(inner)
        inner.set_attn_implementation(attention.wrapped_name(current))
        if inner.config._attn_implementation != attention.wrapped_name(current):
            raise PrefixFlowError(
                f"{type(inner).__name__} did not switch its attention implementation to PrefixFlow's: it does not "
                "route attention through transformers' AttentionInterface. Train this model with the plain trainer."
            )
    moe.enable_replay(inner)  # routers replay `prefixflow_routes` when a forward carries them
    if states.enable_states(inner):  # recurrent mixers read the group's prefix state
        bridge_decoder(inner)
    if takes_images(inner):
        mark_towers(inner)
    return inner


def bridge_decoder(model: PreTrainedModel) -> None:
    """Carry the PrefixFlow kwargs of `model`'s forward to its decoder: a causal LM that calls its decoder with a fixed
    argument list (Mamba2ForCausalLM) would start the waves' recurrent states from zero. The decoder hands the kwargs
    on to its layers itself, so a checkpoint recompute sees them too. A no-op where the forward passes them."""
    decoder = decoder_of(model)
    if decoder is not model:
        attention.bridge_layers([model], [decoder])


def mark_towers(model: PreTrainedModel) -> None:
    """Mark every module outside the decoder: some models hand the forward's kwargs, Phase A's marker included, on to
    their vision tower (Qwen2-VL, LLaVA), whose attention then runs as the model's own implementation."""
    decoder = {id(m) for m in decoder_of(model).modules()}
    for module in model.modules():
        if id(module) not in decoder:
            setattr(module, attention.TOWER, True)
