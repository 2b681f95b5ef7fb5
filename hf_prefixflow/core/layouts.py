"""Suffix layouts: how a wave of suffixes is laid out (padded rows or one packed row) and which keys each query sees.

A wave's model input for suffix `s` is `[p_last, s_0, ..., s_{L-2}]` at positions `P-1 ... P+L-2`, where `p_last` is
the prefix's last token and the other `P' = P - 1` prefix tokens sit in the cache. Output position `t` then predicts
`s_t`, exactly like position `P-1+t` of the full sequence `[P || s]`. Every layout reduces to two per-token arrays,
`segment_ids` (-1 marks padding) and absolute `position_ids`, from which one predicate decides visibility: a query
sees every cached prefix key and, causally, the real keys of its own segment, all within the layer's sliding window if
it has one, and within the query's own chunk in a chunked-attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PrefixFlowError

PADDING = -1
PREFIX = -2


@dataclass(eq=False)
class Wave:
    """One Phase-B microbatch: model inputs plus the geometry its attention masks are derived from.

    Built by `padded_wave` / `packed_wave` (or `PrefixGroup.padded_wave`); every tensor is on the group's device.
    `S` is the wave's width: the suffix width for padded rows, `sum(L_i)` for a packed row (`B = 1`).

    Attributes:
        input_ids: `[B, S]` int64: per suffix, the prefix's last token, then the suffix without its last token.
        position_ids: `[B, S]` int64 absolute positions in `[P || s]`: `position_offset + cached_length + t` for a
            suffix's input `t`.
        segment_ids: `[B, S]` integer: the suffix index within the row (0 for padded rows), `PADDING` (-1) for pad
            inputs.
        cached_length: `P'`, the prefix tokens held in the cache (`P - 1`).
        packed: whether the row holds several suffixes (`packed_wave`).
        position_offset: position of the first prefix token (left padding in the stock trainer).
        segment_lengths: packed only, `[L_1, ..., L_n]` tokens per suffix; `[]` for padded rows.
        routes: MoE routing replay, `[layers, B, S, k]` int aligned with `input_ids`, or None.
        router_logits: MoE, None or a dict the forward fills with each layer's router logits `[B*S, E]`.
        padding_sees_row: padded rows only: a padding query attends as in a stock padded sequence (the prefix and its
            row's earlier real keys, not itself) instead of bottom-right causally; for callers that read padded
            positions' outputs (Online DPO's metrics). Costs the masked kernel instead of the causal one.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    cached_length: int
    packed: bool
    position_offset: int = 0
    segment_lengths: list[int] = field(default_factory=list)
    routes: torch.Tensor | None = None
    router_logits: dict | None = None
    padding_sees_row: bool = False
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def is_plain_causal(self) -> bool:
        """Right-padded rows with one suffix each: bottom-right causality alone gives every real query its keys."""
        return not self.packed and not self.padding_sees_row

    def visible(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Which keys each query attends to: every cached prefix key and, causally, the real keys of its own
        segment, within `window` if given, and within the query's chunk if `chunk` is given. A padding query sees
        itself, so no softmax row is empty.

        Args:
            window: the layer's sliding window in tokens, or None.
            chunk: the layer's attention chunk in tokens (Llama 4's chunked layers), or None: a query sees only the
                keys whose position lies in its chunk, `(position - position_offset) // chunk`.

        Returns:
            Bool `[B, 1, S, P'+S]` over the keys `[cached prefix ; wave]`, built once per window and chunk and
            shared by the layers.
        """
        key = window if chunk is None else (window, chunk)
        if key not in self._masks:
            self._masks[key] = self._build(window) if chunk is None else self._build(window, chunk)
        return self._masks[key]

    def key_geometry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ids and positions of the keys `[cached prefix ; wave]`.

        Returns:
            `(segments, positions)`, each int64 `[B, P'+S]`; prefix keys have segment `PREFIX` (-2).
        """
        batch, device = self.input_ids.shape[0], self.input_ids.device
        prefix_pos = self.position_offset + torch.arange(self.cached_length, device=device).expand(batch, -1)
        prefix_seg = torch.full_like(prefix_pos, PREFIX)
        return (torch.cat([prefix_seg, self.segment_ids], dim=1), torch.cat([prefix_pos, self.position_ids], dim=1))

    def _build(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        key_seg, key_pos = self.key_geometry()
        q_seg, q_pos = self.segment_ids[:, :, None], self.position_ids[:, :, None]
        k_seg, k_pos = key_seg[:, None, :], key_pos[:, None, :]
        own = (k_seg == q_seg) & (k_seg != PADDING) & (k_pos <= q_pos)
        if self.padding_sees_row:
            own |= (q_seg == PADDING) & (k_seg >= 0) & (k_pos <= q_pos)
        allowed = (k_seg == PREFIX) | own
        if window is not None:
            allowed &= q_pos - k_pos < window
        if chunk is not None:  # chunks count from the sequence's first token, as transformers' chunked masks do
            allowed &= (q_pos - self.position_offset) // chunk == (k_pos - self.position_offset) // chunk
        # A padding query sees at least itself, so no softmax row is empty (its output is never used).
        size = self.input_ids.shape[1]
        eye = torch.eye(size, dtype=torch.bool, device=allowed.device)
        if self.padding_sees_row:  # only where a padding query would see nothing else
            eye = eye & ~allowed.any(-1, keepdim=True)
        allowed[:, :, self.cached_length :] |= eye
        return allowed[:, None]


def _check_ids(name: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise PrefixFlowError(f"{name} must be an integer tensor of token ids, got {getattr(ids, 'dtype', type(ids))}.")


def right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a mask is right-padded (1...1 0...0; an all-zero row counts).

    Args:
        mask: `[B, S]`, 1 / True for real tokens, any dtype.

    Returns:
        A Python bool (reads the device: one synchronisation).
    """
    real = mask.bool()
    return not bool((real[:, 1:] & ~real[:, :-1]).any())


def padded_wave(
    last_prefix_token: torch.Tensor, suffix_ids: torch.Tensor, attention_mask, cached_length: int,
    position_offset: int = 0,
) -> Wave:
    """Lay out right-padded suffixes, one per row, as a wave.

    Args:
        last_prefix_token: the prefix's last token id, `[1, 1]` (any shape of one element broadcast to `[B, 1]`).
        suffix_ids: `[B, S]` int64/int32, `S >= 1`.
        attention_mask: `[B, S]`, 1 / True for real tokens, right-padded; None: every token is real.
        cached_length: `P'`, the prefix tokens in the cache.
        position_offset: position of the first prefix token.

    Returns:
        A `Wave` with `input_ids [B, S]` = `[last_prefix_token, suffix_ids[:, :-1]]` per row, positions
        `position_offset + cached_length + t`.

    Raises:
        PrefixFlowError: non-integer ids, `suffix_ids` not `[B, S]` with `S >= 1`, a mask of another shape, or a
            mask that is not right-padded.
    """
    _check_ids("suffix_ids", suffix_ids)
    if suffix_ids.dim() != 2 or suffix_ids.shape[1] == 0:
        raise PrefixFlowError(f"suffix_ids must be [B, S] with S >= 1, got shape {tuple(suffix_ids.shape)}.")
    batch, length = suffix_ids.shape
    device = suffix_ids.device
    if attention_mask is None:
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
    else:
        if attention_mask.shape != suffix_ids.shape:
            raise PrefixFlowError(
                f"attention_mask shape {tuple(attention_mask.shape)} must match suffix_ids {tuple(suffix_ids.shape)}."
            )
        real = attention_mask.to(device=device, dtype=torch.bool)
        if not right_padded(real):
            raise PrefixFlowError(
                "suffix rows must be right-padded (mask 1...1 0...0); left or inner padding is not a suffix layout. "
                "Use group.packed(...) for suffixes of different lengths without padding."
            )
    inputs = torch.cat([last_prefix_token.expand(batch, 1), suffix_ids[:, :-1]], dim=1)
    positions = position_offset + cached_length + torch.arange(length, device=device).expand(batch, -1)
    return Wave(inputs, positions, padded_segments(real), cached_length, packed=False, position_offset=position_offset)


def padded_segments(attention_mask: torch.Tensor) -> torch.Tensor:
    """Segment ids of a padded wave's inputs from its suffixes' mask: input `t` carries token `t-1`, input 0 the
    prefix's last token, always real.

    Args:
        attention_mask: `[B, S]`, 1 / True for real suffix tokens, right-padded.

    Returns:
        int64 `[B, S]`: 0 for real inputs, `PADDING` (-1) for pad ones.
    """
    real = attention_mask.bool()
    input_real = torch.cat([torch.ones_like(real[:, :1]), real[:, :-1]], dim=1)
    return torch.where(input_real, 0, PADDING)


def packed_wave(
    last_prefix_token: torch.Tensor, suffixes: list[torch.Tensor], cached_length: int, position_offset: int = 0
) -> Wave:
    """Lay out suffixes end to end in one row as a wave; each sees the whole prefix and, causally, only itself.

    Args:
        last_prefix_token: the prefix's last token id, one element (e.g. `[1, 1]`).
        suffixes: n int64/int32 tensors of `L_i >= 1` ids each, flattened (`[L_i]` or `[1, L_i]`).
        cached_length: `P'`, the prefix tokens in the cache.
        position_offset: position of the first prefix token.

    Returns:
        A packed `Wave` of `[1, T]` tensors, `T = sum(L_i)`; suffix `i` is segment `i`, its positions restart at
        `position_offset + cached_length`.

    Raises:
        PrefixFlowError: no suffixes, an empty suffix, or non-integer ids.
    """
    if not suffixes:
        raise PrefixFlowError("packed() needs at least one suffix.")
    inputs, positions, segments, lengths = [], [], [], []
    for index, suffix in enumerate(suffixes):
        _check_ids(f"suffixes[{index}]", suffix)
        suffix = suffix.reshape(-1)
        if suffix.numel() == 0:
            raise PrefixFlowError(f"suffixes[{index}] is empty; drop empty suffixes before packing.")
        lengths.append(suffix.numel())
        inputs.append(torch.cat([last_prefix_token.reshape(1), suffix[:-1]]))
        positions.append(position_offset + cached_length + torch.arange(suffix.numel(), device=suffix.device))
        segments.append(torch.full_like(suffix, index))
    return Wave(
        torch.cat(inputs)[None],
        torch.cat(positions)[None],
        torch.cat(segments)[None],
        cached_length,
        packed=True,
        position_offset=position_offset,
        segment_lengths=lengths,
    )
