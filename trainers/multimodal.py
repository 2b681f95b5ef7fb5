"""Image-text rows in PrefixFlowGRPOTrainer: TRL's multimodal tensors cut per row as TRL cuts them, groups told apart by
their images (a prompt's text can recur with other images; rows of one group must carry the same ones, compared, not
assumed), and each group's tensors for its Phase A (`hf_prefixflow.prefix_group`'s `prefix_inputs`).

TRL hands `_get_per_token_logps_and_entropies` the batch's images flattened (`pixel_values` over every image or patch
of every row, `image_grid_thw` and `image_sizes` per image, `num_images` per row; Idefics3's `pixel_values` and
`pixel_attention_mask` per row) and per-token types over `[prompt | completion]`.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from hf_prefixflow.models import multimodal as core  # the module, not the package face
from hf_prefixflow.core.access import unwrap

from .grouping import BatchIndex

PER_IMAGE = ("image_grid_thw", "image_sizes")
PER_ROW = ("pixel_attention_mask",)
TOKEN_TYPES = core.PER_TOKEN
# Fields of modalities and layouts no family with an image probe uses (videos, tiles, LFM2-VL's shapes).
UNSUPPORTED = ("pixel_values_videos", "video_grid_thw", "spatial_shapes", "num_tiles", "image_position_ids")
_image_keys = itertools.count()  # tells apart groups of one prompt text with different images


def present(extra: dict) -> bool:
    """Whether a forward's kwargs carry multimodal tensors."""
    return any(isinstance(value, torch.Tensor) for value in extra.values())


def refusal(trainer) -> str | None:
    """Why this trainer runs image rows on the plain path whatever the batch (None: it shares them)."""
    model = unwrap(trainer.model)
    if not core.takes_images(model):
        return None
    why = core.refusal(model)
    if why is not None:
        return f"image prompts of {type(model).__name__}: {why}"
    if not trainer._engine.shares_images or trainer._sp is not None or trainer._split:
        return "image prompts share their prefix on one process or under plain DDP with whole groups"
    return None


class ImageRows:
    """One forward's multimodal kwargs (TRL's layout), cut per row."""

    def __init__(self, extra: dict):
        self.extra = {name: value for name, value in extra.items() if value is not None}
        counts = self.extra.get("num_images")
        self.images = None if counts is None else [int(n) for n in counts]
        grid = self.extra.get("image_grid_thw")
        self.patches = None if grid is None else grid.prod(-1).tolist()  # rows of pixel_values per image

    def _span(self, row: int) -> tuple[int, int]:
        return (sum(self.images[:row]), sum(self.images[:row + 1])) if self.images is not None else (row, row + 1)

    def row(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row`'s tensors: its images (none if it has none) and its per-token types `[L]`."""
        out = {name: self.extra[name][row] for name in TOKEN_TYPES if name in self.extra}
        first, last = self._span(row)
        pixels = self.extra.get("pixel_values")
        if pixels is None or first == last:
            return out
        if self.patches is not None:
            start = sum(self.patches[:first])
            out["pixel_values"] = pixels[start:start + sum(self.patches[first:last])]
        elif self.images is not None and pixels.shape[0] == sum(self.images):
            out["pixel_values"] = pixels[first:last]
        else:
            out["pixel_values"] = pixels[row:row + 1]
        out.update({name: self.extra[name][first:last] for name in PER_IMAGE if name in self.extra})
        out.update({name: self.extra[name][row:row + 1] for name in PER_ROW if name in self.extra})
        return out

    def rows(self, rows: list[int]) -> dict:
        """The kwargs TRL would pass for `rows` alone (the plain path's subset), in TRL's layout."""
        pieces = [self.row(r) for r in rows]
        out = {name: torch.stack([p[name] for p in pieces]) for name in TOKEN_TYPES if name in self.extra}
        for name in ("pixel_values", *PER_IMAGE, *PER_ROW):
            parts = [p[name] for p in pieces if name in p]
            if parts:
                out[name] = torch.cat(parts)
        if self.images is not None and "pixel_values" in out:
            out["num_images"] = [self.images[r] for r in rows]
        return out


def plain_kwargs(extra: dict, rows: list[int], count: int) -> dict:
    """`extra` for the plain path's `rows` of a `count`-row forward: as it is for all rows in order."""
    if rows == list(range(count)) or not present(extra):
        return extra
    return ImageRows(extra).rows(rows)


def image_groups(trainer, index: BatchIndex, input_ids: torch.Tensor, completion_length: int, extra: dict,
                 open_groups: dict) -> tuple[BatchIndex, dict, str | None]:
    """`index`'s groups split by the images their rows carry (compared), each image group keyed by its prompt and a
    number, the key of the group already open in `open_groups` (an earlier microbatch of the window) with the same
    tensors if there is one; each image group's prompt tensors for `prefix_group`; or a reason for the plain path."""
    model = unwrap(trainer.model)
    family = core.family_of(model)
    unsupported = sorted(name for name in UNSUPPORTED if name in extra and extra[name] is not None)
    if unsupported:
        return index, {}, f"multimodal fields {unsupported} (videos and tiled layouts are not shared)"
    width = input_ids.shape[1] - completion_length
    batch = ImageRows(extra)
    types = [batch.extra[name][:, width:] for name in TOKEN_TYPES if name in batch.extra]
    # Image placeholders in completions are tool results' images (other ones would fail the stock forward's count).
    placeholders = [getattr(model.config, name, None) for name in ("image_token_id", "image_token_index")]
    placeholders = torch.tensor([i for i in placeholders if isinstance(i, int)], device=input_ids.device)
    if any(bool(t.any()) for t in types) or bool(torch.isin(input_ids[:, width:], placeholders).any()):
        return index, {}, "images inside completions (tool results) are not shared"
    if family.prefix_lm:
        return index, {}, (f"{type(model).__name__} is a prefix-LM and TRL marks completion tokens as prefix "
                           "(token_type_ids 0), so the stock forward lets prompt and completions attend both ways; "
                           "PrefixFlow trains completions causally")
    # Multimodal RoPE positions come from the attention mask when the forward holds images: real tokens from 0.
    counts_from_mask = family.mrope and "image_grid_thw" in batch.extra
    groups, inputs = [], {}
    for group in index.groups:
        parts: list[tuple[dict, list[int]]] = []
        for row in group.rows:
            tensors = batch.row(row)
            match = next((rows for first, rows in parts if _same(first, tensors)), None)
            if match is None:
                parts.append((tensors, [row]))
            else:
                match.append(row)
        for tensors, rows in parts:
            prompt = {name: (t[group.position_offset:width] if name in TOKEN_TYPES else t) for name, t in
                      tensors.items()}
            offset = 0 if counts_from_mask else group.position_offset
            if "pixel_values" not in prompt:  # a text row: an ordinary group
                groups.append(dataclasses.replace(group, rows=rows, position_offset=offset))
                continue
            # The key of the open group with these images (an earlier microbatch's), else a new one.
            key = next((k for k, g in open_groups.items() if k[:2] == group.key and len(k) > 2
                        and _same(g.runner.inputs, _as_run(prompt))), None) or group.key + (next(_image_keys),)
            groups.append(dataclasses.replace(group, rows=rows, key=key, position_offset=offset))
            inputs[key] = prompt
    return BatchIndex(groups, index.lengths), inputs, None


def _as_run(prompt: dict) -> dict:
    """`prompt` as the runner keeps it (per-token types `[1, P]`)."""
    return {name: (t.reshape(1, -1) if name in TOKEN_TYPES else t) for name, t in prompt.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)
