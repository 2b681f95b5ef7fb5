"""Every touch point with another library's private or version-dependent API, in one place.

`tests/test_compat.py` checks each symbol, so a library upgrade that moves one fails one clear test.
"""

from __future__ import annotations

import torch


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """transformers' per-layer activation checkpointing (`activation_checkpointing_enable` from 5.24 on,
    `gradient_checkpointing_enable` before)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
