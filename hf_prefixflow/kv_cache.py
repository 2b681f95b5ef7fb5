"""The training-time KV cache: live prefix K/V, the detached leaves suffix waves read, and their gK/gV.

One `TrainingKVCache` lives for one prefix group. Phase A captures, per attention layer, the live post-RoPE
K/V (still attached to the prefix graph) and hands Phase B detached leaves of the same values. Autograd
accumulates every wave's gradient into the leaves' `.grad` (gK/gV). Phase C feeds those gradients into the live
tensors in one backward through the prefix graph. Nothing outlives `free()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One layer's prefix K/V: `live_*` belong to the prefix graph, `leaf_*` are what suffix waves read."""

    live_key: torch.Tensor
    live_value: torch.Tensor
    leaf_key: torch.Tensor
    leaf_value: torch.Tensor


def _leaf(live: torch.Tensor) -> torch.Tensor:
    # Only tensors that reach trainable parameters need gK/gV; the others stay plain constants.
    return live.detach().requires_grad_(live.requires_grad)


class TrainingKVCache:
    """Per-layer prefix K/V for one group, with gK/gV accumulated across suffix waves."""

    def __init__(self, prefix_length: int):
        self.prefix_length = prefix_length
        self.layers: dict[int, LayerKV] = {}

    def capture(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Record a layer's live prefix K/V. Idempotent: a checkpoint recompute in Phase C must not replace them."""
        if layer_idx in self.layers:
            return
        self.layers[layer_idx] = LayerKV(key, value, _leaf(key), _leaf(value))

    def leaves(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        entry = self.layers.get(layer_idx)
        return None if entry is None else (entry.leaf_key, entry.leaf_value)

    def needs_gradients(self) -> bool:
        """Whether any cached K/V leads back to a trainable parameter."""
        return any(e.leaf_key.requires_grad or e.leaf_value.requires_grad for e in self.layers.values())

    def received_gradients(self) -> bool:
        return any(e.leaf_key.grad is not None or e.leaf_value.grad is not None for e in self.layers.values())

    def pending_gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Live tensors and their accumulated gK/gV, for the tensors that received any gradient."""
        outputs, grads = [], []
        for entry in self.layers.values():
            for live, leaf in ((entry.live_key, entry.leaf_key), (entry.live_value, entry.leaf_value)):
                if leaf.grad is not None and live.grad_fn is not None:
                    outputs.append(live)
                    grads.append(leaf.grad)
        return outputs, grads

    def backward(self) -> int:
        """Phase C: inject gK/gV into the live prefix K/V and run the one delayed prefix backward."""
        outputs, grads = self.pending_gradients()
        if outputs:
            torch.autograd.backward(outputs, grads)
        return len(outputs)

    def free(self) -> None:
        """Drop every reference, which releases the prefix graph and its saved activations."""
        self.layers.clear()

    def nbytes(self) -> int:
        total = 0
        for entry in self.layers.values():
            for t in (entry.leaf_key, entry.leaf_value):
                total += t.numel() * t.element_size() * (2 if t.grad is not None else 1)
        return total
