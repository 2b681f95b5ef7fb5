"""Every touch point with another library's private or version-dependent API, in one place.

`tests/test_compat.py` checks each symbol here, and the signature of each private method PrefixFlow overrides, so a
library upgrade that moves one fails one clear test instead of a training run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: F401 - re-exported
from transformers.utils import ModelOutput

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


def outside_dispatch_modes(method: Callable) -> Callable:
    """Run `method` (a host copy: offload's, streamed K/V's) with torch's dispatch modes popped. Selective activation
    checkpointing records every op of a checkpointed region and refuses a recompute whose ops differ; the copies of
    Phase A (to the host) and Phase C (back) differ by design and are not the model's arithmetic."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            return method(*args, **kwargs)

    return wrapped


def register_host_memory(buffer: torch.Tensor) -> int:
    """Page-lock a contiguous CPU tensor's memory in place for asynchronous copies (`cudaHostRegister`); returns
    CUDA's error code, 0 on success. torch's own pinned allocations round every request up to a power of two."""
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    if error:
        consume_cuda_error()
    return error


def unregister_host_memory(buffer: torch.Tensor) -> int:
    """Undo `register_host_memory` (no copy may still read or write it); returns CUDA's error code."""
    error = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if error:
        consume_cuda_error()
    return error


def consume_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error pending on the thread, and torch raises a pending error at its next
    kernel launch, whichever kernel that is. `torch.cuda.cudart()` has no `cudaGetLastError`: a one-element fill's
    launch check takes the error here instead (a sticky error would still surface at the next operation)."""
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device="cuda").fill_(1)


def raise_recompile_limit(limit: int) -> int | None:
    """Raise `torch._dynamo.config.recompile_limit` (a process-wide setting) to `limit`; returns the limit it had,
    None where it was already as high. Checked on torch 2.11 and 2.13."""
    previous = torch._dynamo.config.recompile_limit
    if previous >= limit:
        return None
    torch._dynamo.config.recompile_limit = limit
    return previous


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


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = False, **checkpoint_kwargs) -> None:
    """transformers' per-layer activation checkpointing (`activation_checkpointing_enable` from 5.24 on,
    `gradient_checkpointing_enable` before); `checkpoint_kwargs` go to `torch.utils.checkpoint` (e.g. a selective
    policy's `context_fn`)."""
    kwargs = {"use_reentrant": use_reentrant, **checkpoint_kwargs}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# The closure of transformers' `use_kernel_func_from_hub_with_fallback` wrapper (5.2x): a fused package's function
# (flash-linear-attention, mamba-ssm, causal-conv1d) chosen once at import, with the PyTorch function as `__wrapped__`.
_KERNEL_WRAPPER_FREEVARS = {"implementation", "torch_function"}


@contextlib.contextmanager
def reference_kernels(model_class: type):
    """Inside: the module-level kernel functions of `model_class`'s modeling file run their PyTorch reference path.
    The probe's float64 CPU copy needs it where a fused package is installed (its Triton kernels take GPU tensors
    of half or single precision only)."""
    module = __import__(model_class.__module__, fromlist=["_"])
    swapped = {name: fn for name, fn in vars(module).items() if callable(fn) and hasattr(fn, "__wrapped__")
               and _KERNEL_WRAPPER_FREEVARS <= set(getattr(getattr(fn, "__code__", None), "co_freevars", ()))}
    for name, fn in swapped.items():
        setattr(module, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in swapped.items():
            setattr(module, name, fn)


# -- accelerate -------------------------------------------------------------------------------------------------


def set_sync_gradients(accelerator, value: bool) -> None:
    """Tell Accelerate whether the coming backward ends the accumulation window (it steps DeepSpeed there)."""
    accelerator.gradient_state._set_sync_gradients(value)


# -- TRL --------------------------------------------------------------------------------------------------------

# TRL releases PrefixFlowGRPOTrainer supports, [first, end) (setup.py pins the same). 1.14.0 is left out: its
# `_generate_single_turn` has no `num_generations` (1.14.1 added it, with the fix that a tool call's later turns
# generate one completion per row), which the override and its MoE routing replay read.
TRL_SUPPORTED = ("1.14.1", "1.17")

_LOGPS_PARAMETERS = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                     "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                     "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
                     "image_position_ids")

# `trl.GRPOTrainer` methods `PrefixFlowGRPOTrainer` overrides or calls (name -> parameters after self), TRL 1.15 on.
GRPO_TRAINER_PRIVATE = {
    "_build_accelerator_args": None,  # None: any signature (it forwards **kwargs)
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate": ("prompts",),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    "_prepare_inputs": ("generation_batch",),
    "_get_per_token_logps_and_entropies": _LOGPS_PARAMETERS,
}
# TRL 1.14: `_get_per_token_logps_and_entropies(model, *args, batch_size, compute_aux_loss, **kwargs)` hands its
# arguments to `_full_logits_logps` (1.15's parameters); the trainer calls it with keywords past `logits_to_keep`.
GRPO_TRAINER_PRIVATE_1_14 = {
    **GRPO_TRAINER_PRIVATE,
    "_get_per_token_logps_and_entropies": ("model", "args", "batch_size", "compute_aux_loss", "kwargs"),
    "_full_logits_logps": _LOGPS_PARAMETERS,
}
# `trl.RLOOTrainer` methods `PrefixFlowRLOOTrainer` overrides or calls, TRL 1.14.1 on: GRPO's but for its single turn,
# which returns the completion ids alone.
RLOO_TRAINER_PRIVATE = {
    **GRPO_TRAINER_PRIVATE,
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields"),
}
# TRL 1.14 functions (`trl.trainer.utils`) the fused-LM-head stand-in scores with (name -> parameters).
TRL_1_14_SCORING = {
    "selective_log_softmax": ("logits", "index", "temperature", "row_mask"),
    "selective_log_softmax_and_entropy": ("logits", "index", "entropy_requires_grad", "temperature", "row_mask"),
}


# The state of TRL's trainers that PrefixFlow reads or replaces, by attribute: each set in the trainer's `__init__`
# (checked on TRL 1.14.1 and 1.16). `_step` and `_buffered_inputs`: GRPOTrainer and RLOOTrainer; `_metrics`: those
# and DPOTrainer and RewardTrainer.
GROUP_TRAINER_STATE = ("_step", "_buffered_inputs", "_metrics")
PAIR_TRAINER_STATE = ("_metrics",)


def trl_step(trainer) -> int:
    """The microbatches TRL's group trainer has trained (it picks the buffered microbatch and when to generate)."""
    return trainer._step


def buffered_inputs(trainer) -> list[dict] | None:
    """The microbatches of TRL's group trainer's buffered generation batch, None before the first generation."""
    return trainer._buffered_inputs


def set_buffered_inputs(trainer, microbatches: list[dict]) -> None:
    """Replace the buffered generation batch (PrefixFlow splits it by whole groups instead of rows)."""
    trainer._buffered_inputs = microbatches


def trl_metrics(trainer, mode: str) -> dict[str, list[float]]:
    """The values TRL's trainer logs as means per logging step (`mode`: "train" or "eval"), by metric name."""
    return trainer._metrics[mode]


def trl_version():
    import trl
    from packaging.version import Version

    return Version(trl.__version__)


def trl_supported(version=None) -> bool:
    """Whether TRL `version` (default: the installed one) is in `TRL_SUPPORTED`."""
    from packaging.version import Version

    version = trl_version() if version is None else Version(str(version))
    return Version(TRL_SUPPORTED[0]) <= version < Version(TRL_SUPPORTED[1])


def grpo_trainer_private(version=None) -> dict:
    """`GRPO_TRAINER_PRIVATE` as TRL `version` (default: the installed one) has it."""
    from packaging.version import Version

    version = trl_version() if version is None else Version(str(version))
    return GRPO_TRAINER_PRIVATE_1_14 if version < Version("1.15") else GRPO_TRAINER_PRIVATE


def forward_without_mixed_precision(module: torch.nn.Module) -> Callable:
    """`module.forward` without Accelerate's mixed-precision wrapper, which `Accelerator.prepare_model` puts on the
    instance, keeping the forward it wrapped in `_original_forward` (private; checked on accelerate 1.15). That
    wrapper enters one `torch.autocast` object on every call, and the object is not reentrant: entered again while
    active, its exit restores the inner entry's state, so a forward that calls the module again through it leaves
    autocast enabled after the outer call returns."""
    return module.__dict__.get("_original_forward", module.forward)


def trl_fused_lm_head() -> Callable | None:
    """TRL's `add_fused_lm_head` (1.15 on), which `GRPOTrainer.__init__` applies to its models; None before."""
    import trl.trainer.utils

    return getattr(trl.trainer.utils, "add_fused_lm_head", None)


def add_fused_lm_head(trainer) -> None:
    """Give the trainer's models TRL's fused-LM-head call, which the suffix waves (and the MoE-replay and SP
    forwards) use: `model(..., labels=... or shift_labels=..., fused_lm_head=True)` returns `log_probs` (and
    `entropy`) of each label, zero where it is -100. TRL 1.15 on adds it in `GRPOTrainer.__init__`. TRL 1.14 scores
    full logits instead, so there the same call scores the model's logits through TRL 1.14's own
    `selective_log_softmax(_and_entropy)` at the trainer's temperature: the stock trainer's computation."""
    if trl_fused_lm_head() is not None:
        return
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    # RLOOTrainer 1.14 has no entropy bonus: its entropies (a metric) carry no gradient
    logits_lm_head(model, trainer.temperature, ("log_probs", "entropy"),
                   getattr(trainer, "_entropy_bonus_enabled", False))
    if trainer.ref_model is not None:
        logits_lm_head(trainer.ref_model, trainer.temperature)


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """The fields of TRL's `FusedCausalLMOutput` that `logits_lm_head` fills."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def logits_lm_head(model: torch.nn.Module, temperature: float = 1.0, outputs: tuple[str, ...] = ("log_probs",),
                   entropy_requires_grad: bool = True) -> None:
    """TRL 1.15's `add_fused_lm_head(model, temperature, outputs=...)` call contract, computed from the model's own
    logits (TRL 1.14's scoring); without `fused_lm_head=True` the forward is the model's own."""
    from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

    original_forward = model.forward

    @functools.wraps(type(model).forward)  # `generate` validates its model kwargs against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        kwargs["use_cache"] = False
        out = original_forward(*args, **kwargs)
        logits = out.logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(logits.device)
        mask = labels != -100
        index = labels.masked_fill(~mask, 0)
        entropy = None
        if "entropy" in outputs:
            log_probs, entropy = selective_log_softmax_and_entropy(
                logits, index, entropy_requires_grad=entropy_requires_grad, temperature=temperature, row_mask=mask)
        else:
            log_probs = selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedLMHeadOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                 label_mask=mask, aux_loss=getattr(out, "aux_loss", None))

    model.forward = types.MethodType(forward, model)


def fused_head_on_hidden(fused_forward, hidden: torch.Tensor, shift_labels: torch.Tensor):
    """TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, 1.15 on) applied to hidden states computed
    elsewhere (a prefix group's Phase A output): its forward function runs with a stand-in whose backbone returns
    `hidden`, so the temperature, softcapping, logit scale and output fields are the model's own.

    Args:
        fused_forward: the model's `forward` as TRL's `add_fused_lm_head` left it (a bound method).
        hidden: `[B, T, d]` last hidden states (after the final norm).
        shift_labels: `[B, T]` the token each position predicts, -100 where none is scored.

    Returns:
        TRL's `FusedCausalLMOutput`, per-token fields `[B, T]`.
    """
    owner = fused_forward.__self__
    output = types.SimpleNamespace(last_hidden_state=hidden)

    class StandIn:  # what `_fused_forward` reads of `self`: the backbone (either attribute name) and the head
        def base_model(self, *args, **kwargs):
            return output

        model = base_model

        def get_output_embeddings(self):
            return owner.get_output_embeddings()

    return fused_forward.__func__(StandIn(), shift_labels=shift_labels, fused_lm_head=True)


def generic_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether `model` is transformers' `GenericForSequenceClassification` (`transformers.modeling_layers`, not
    exported at the top level): a `score` head applied to the decoder's last hidden state, read at each row's
    rightmost token that is not the pad id."""
    try:
        from transformers.modeling_layers import GenericForSequenceClassification
    except ImportError:
        return False
    return isinstance(model, GenericForSequenceClassification) and isinstance(getattr(model, "score", None),
                                                                               torch.nn.Module)


@contextlib.contextmanager
def sdpa_grouped_by_shapes():
    """Inside: transformers' `sdpa` attention groups query heads over key/value heads by the tensors' head counts
    (`enable_gqa`), as its `flex_attention` does, instead of repeating K/V `module.num_key_value_groups` times
    (`integrations.sdpa_attention.use_gqa_in_sdpa` reads `TRANSFORMERS_SDPA_FORCE_GQA` per call). A model whose K/V
    carry more heads than `num_key_value_heads` says (DeepSeek's MLA) runs under flex_attention but not under sdpa's
    repeat; the probe stands sdpa in for flex on the CPU."""
    name = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# `trl.experimental.online_dpo.OnlineDPOTrainer._forward`, which `PrefixFlowOnlineDPOTrainer` overrides: its parameters
# after self (TRL 1.14.1-1.16). Another signature sends the run to the plain path.
ONLINE_DPO_FORWARD = ("model", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "vision_inputs")


def online_dpo_forward_matches(trainer_class: type) -> bool:
    """Whether `trainer_class._forward` takes `ONLINE_DPO_FORWARD` (TRL's private scoring call of Online DPO)."""
    import inspect

    method = getattr(trainer_class, "_forward", None)
    if method is None:
        return False
    return tuple(inspect.signature(method).parameters)[1:] == ONLINE_DPO_FORWARD
