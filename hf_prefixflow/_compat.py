"""Every touch point with another library's private or version-dependent API, in one place.

`tests/test_compat.py` checks each symbol here, and the signature of each private method PrefixFlow overrides, so a
library upgrade that moves one fails one clear test instead of a training run.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: F401 - re-exported

# -- torch ------------------------------------------------------------------------------------------------------

aten = torch.ops.aten
# Fused attention kernels that return their log-sum-exp (split attention merges partial results with it).
SDPA_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu
SDPA_FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
SDPA_FLASH = aten._scaled_dot_product_flash_attention
SDPA_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward
SDPA_CUDNN = aten._scaled_dot_product_cudnn_attention
SDPA_CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward

dynamo_disable: Callable = torch._dynamo.disable


def dynamo_inlines_modules() -> bool:
    """Whether dynamo inlines nn.Module calls (guarding on their classes): torch's default since 2.5, and always so
    from 2.13, where reading the flag only warns that it is deprecated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True)


def global_forward_hooks() -> dict:
    """Forward hooks registered for every module (`torch.nn.modules.module.register_module_forward_hook`)."""
    return torch.nn.modules.module._global_forward_hooks


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether `module.compile()` compiled the module's call in place."""
    return getattr(module, "_compiled_call_impl", None) is not None


# `torch.distributed.pipelining.PipelineStage` methods `distributed.pipeline` overrides (name -> parameters after
# self), to answer the schedule's warm-up locally.
PIPELINE_STAGE_OVERRIDES = {
    "_get_init_p2p_neighbors_ops": (),
    "_warmup_forward_vote": ("has_backward", "received_acc"),
    "_warmup_backward_result": ("received_result",),
}

# -- transformers -----------------------------------------------------------------------------------------------


def checkpoint_function(module: torch.nn.Module) -> Callable | None:
    """The checkpoint function transformers' `gradient_checkpointing_enable` set on a layer (None if none)."""
    return getattr(module, "_gradient_checkpointing_func", None)


def checkpoint_function_kwargs(module: torch.nn.Module) -> dict:
    """The keyword arguments bound into a layer's checkpoint function (`use_reentrant`, ...)."""
    function = checkpoint_function(module)
    return dict(function.keywords) if isinstance(function, functools.partial) else {}


def own_checkpoint_function(module: torch.nn.Module) -> Callable | None:
    """The checkpoint function set on this layer instance itself (None if it uses the class default)."""
    return module.__dict__.get("_gradient_checkpointing_func")


def set_checkpoint_function(module: torch.nn.Module, function: Callable | None) -> None:
    """Set a layer's checkpoint function; `None` removes the instance's own."""
    if function is None:
        module.__dict__.pop("_gradient_checkpointing_func", None)
    else:
        module._gradient_checkpointing_func = function


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """transformers' per-layer activation checkpointing (`activation_checkpointing_enable` from 5.24 on,
    `gradient_checkpointing_enable` before)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# -- accelerate -------------------------------------------------------------------------------------------------


def set_sync_gradients(accelerator, value: bool) -> None:
    """Tell Accelerate whether the coming backward ends the accumulation window (it steps DeepSpeed there)."""
    accelerator.gradient_state._set_sync_gradients(value)


# -- TRL --------------------------------------------------------------------------------------------------------

# `trl.GRPOTrainer` methods `PrefixFlowGRPOTrainer` overrides or calls (name -> parameters after self).
GRPO_TRAINER_PRIVATE = {
    "_build_accelerator_args": None,  # None: any signature (it forwards **kwargs)
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate": ("prompts",),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    "_prepare_inputs": ("generation_batch",),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                           "compute_entropy", "compute_aux_loss", "pixel_values", "image_grid_thw",
                                           "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                                           "image_sizes", "token_type_ids", "mm_token_type_ids",
                                           "image_position_ids"),
}
