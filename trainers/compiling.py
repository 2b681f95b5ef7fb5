"""`torch_compile=True` in PrefixFlow trainers: each decoder layer compiled in place, not the whole model.

Accelerate would wrap the whole model in one compiled module, which the phases cannot run through (a group's
Phase A, its waves and Phase C are separate calls of the layers); `layerwise_accelerator_args` turns that off and
`compile_decoder_layers` compiles each decoder layer instead. One compiled graph serves every layer: PrefixFlow's
attention is a graph break (docs/compile.md).
"""

from __future__ import annotations

import logging

import torch
from accelerate.utils import TorchDynamoPlugin

from hf_prefixflow import _compat
from hf_prefixflow.core.attention import RECOMPILE_LIMIT
from hf_prefixflow.core.recompute import decoder_layers
from hf_prefixflow.errors import PrefixFlowError

logger = logging.getLogger(__name__)


def layerwise_accelerator_args(options: dict) -> dict:
    """Accelerator options with Accelerate's whole-model compile off (`compile_decoder_layers` replaces it)."""
    options["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
    return options


def compile_decoder_layers(models: list[torch.nn.Module], backend: str, mode: str | None) -> None:
    """Compile each decoder layer of each model in place (idempotent) and raise dynamo's recompile limit to
    `RECOMPILE_LIMIT` (the phases' variants of one layer's graph), logging both.

    Raises:
        PrefixFlowError: a model has no decoder layers (transformers' `GradientCheckpointingLayer`).
    """
    for model in models:
        layers = decoder_layers(model)
        if not layers:
            raise PrefixFlowError("torch_compile: PrefixFlow compiles a model's decoder layers (transformers' "
                                  f"GradientCheckpointingLayer), and {type(model).__name__} has none.")
        fresh = [layer for layer in layers if not _compat.is_compiled(layer)]
        for layer in fresh:
            layer.compile(backend=backend, mode=mode)
        if fresh:
            logger.info("PrefixFlow: torch_compile compiles each of the %d decoder layers in place, not the whole "
                        "model.", len(fresh))
    previous = _compat.raise_recompile_limit(RECOMPILE_LIMIT)
    if previous is not None:
        logger.info("PrefixFlow: torch_compile raises torch._dynamo.config.recompile_limit from %d to %d (the "
                    "phases' variants of a layer's graph).", previous, RECOMPILE_LIMIT)
