"""Prefix Grouper's packed layout on SDPA (benchmarks/prefix_grouper_step.py) trains the gradients of N full sequences,
as PrefixFlow does, on a tiny float64 Qwen3 with completions of uneven lengths; broken layouts fail the same check."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import prefix_grouper_step as pg  # noqa: E402

# float64 throughout, but RoPE's cos/sin tables are float32, and their vectorised and scalar paths differ in the last
# bit: a correct layout lands near 1e-7, a broken one far above.
RTOL = 1e-6


@pytest.fixture(scope="module")
def group():
    model = pg.build_tiny(checkpointing=True)
    prompt, suffixes = pg.tiny_group(model)
    return model, prompt, suffixes


def test_both_grouped_sides_match_full_sequences(group):
    errors = pg.gradient_errors(*group, wave=1)
    assert errors["prefix_grouper"] < RTOL, errors
    assert errors["prefixflow"] < RTOL, errors


def _restarting_positions(self, device):
    return torch.cat([torch.arange(self.prefix)] + [torch.arange(s) for s in self.suffixes]).to(device)[None]


def _own_future_visible(self):
    return None  # no mask: every query sees the whole prompt and its whole completion


def _next_completion_keys(x, layout, groups, completion_keys=pg.completion_keys):
    keys = completion_keys(x, layout, groups)
    return torch.cat([keys[:, :, :layout.prefix], keys[:, :, layout.prefix:].roll(1, dims=0)], dim=2)


@pytest.mark.parametrize("target, name, broken", [
    (pg.PackedLayout, "position_ids", _restarting_positions),
    (pg.PackedLayout, "suffix_mask", _own_future_visible),
    (pg, "completion_keys", _next_completion_keys),
], ids=["positions restart at 0", "a completion sees its later tokens", "a completion sees another's keys"])
def test_a_broken_layout_fails_the_check(group, monkeypatch, target, name, broken):
    monkeypatch.setattr(target, name, broken)
    assert pg.gradient_errors(*group, wave=1)["prefix_grouper"] > 1e3 * RTOL


def _flash_varlen_emulation(q, k, v, mask):
    """What the package's stock FlashAttention-2 call computes, on SDPA: each row's valid queries (the last `Sq`
    columns of the 2D padding mask) and valid keys, causal aligned at the bottom right; `[B, Sq, H, D]` out."""
    q_valid = mask[:, -q.shape[2]:]
    rank_q, rank_k = q_valid.cumsum(1) - 1, mask.cumsum(1) - 1
    shift = (mask.sum(1) - q_valid.sum(1))[:, None, None]
    allowed = mask[:, None] & (rank_k[:, None] <= rank_q[:, :, None] + shift)
    allowed |= ~q_valid[:, :, None]  # padded queries: any row, discarded by the package
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return out.transpose(1, 2)


def test_the_attention_matches_the_prefix_grouper_package():
    """Cross-check on random q/k/v: the package's own ungroup/group around an emulation of its FA2 call."""
    package = pytest.importorskip("prefix_grouper")
    layout = pg.PackedLayout(6, (5, 2, 4))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6 + 11, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    grouper = package.PrefixGrouper([[layout.prefix, *layout.suffixes]])
    expected = grouper.forward(_flash_varlen_emulation, q, k, v)
    actual, _ = pg.packed_attention(None, q, k, v, None, **{pg.LAYOUT_KWARG: layout})
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
