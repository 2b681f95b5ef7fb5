"""The processor once per distinct row: a GRPO batch repeats each prompt, images included, `num_generations` times,
and TRL runs the processor on every row, twice a step (the prompts' tokens for generation, then the forward's
tensors). `RowsOnce.applied(trainer)` lets it process each distinct row (same text, images equal pixel for pixel)
once and repeats its outputs; the first call of each kind is also processed whole and compared, and a difference
turns the sharing off for the run, logged.

Each output's layout is known by its name: per row (token ids, masks, token types; Idefics3's `pixel_values` stacked
per row, 5-D, and its `pixel_attention_mask`), per image (`image_grid_thw`, `image_sizes`, one pixel tensor per image)
or per patch (Qwen-VL's `pixel_values`, cut by `image_grid_thw`). An output of another name, or whose length does not
match its layout (tiled or cropped images: several entries per image), has the rows processed whole, as do calls
with videos or audio.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)


class RowsOnce:
    """A trainer's processor sharing: on until a checked call differs; `checked` holds the kinds of call compared."""

    def __init__(self):
        self.enabled = True
        self.checked: set[tuple] = set()
        self._views: dict[type, type] = {}

    @contextlib.contextmanager
    def applied(self, trainer):
        """Within the block `trainer.processing_class` is a view of the same processor that processes repeated rows
        once."""
        processor = trainer.processing_class
        if not self.enabled or getattr(processor, "image_processor", None) is None:
            yield
            return
        trainer.processing_class = self._view(processor)
        try:
            yield
        finally:
            trainer.processing_class = processor

    def _view(self, processor):
        cls = type(processor)
        if cls not in self._views:
            self._views[cls] = type(cls.__name__, (cls,), {"__call__": _call_once_per_row, "_rows_once": self,
                                                           "__reduce_ex__": _reduce_as_processor})
        view = object.__new__(self._views[cls])
        view.__dict__ = processor.__dict__  # the same processor: settings and sub-processors shared, nothing copied
        return view

    def call(self, process, kwargs: dict):
        """`process(**kwargs)` with each distinct row processed once, or every row where it cannot be shared."""
        images, text = kwargs.get("images"), kwargs.get("text")
        others = any(kwargs.get(name) is not None for name in ("videos", "audio", "audio_from_video_indices"))
        if not self.enabled or others or not _rows(images, text):
            return process(**kwargs)
        firsts, index = distinct_rows(text, images)
        if len(firsts) == len(index):
            return process(**kwargs)
        try:
            once = process(**{**kwargs, "images": [images[r] for r in firsts], "text": [text[r] for r in firsts]})
        except Exception:  # whatever the distinct rows raise, every row decides: processed whole below
            once = None
        out = None if once is None else repeat_rows(once, index, [len(images[r] or []) for r in firsts])
        kind = (tuple(sorted(once.keys())) if once is not None else None, str(kwargs.get("return_tensors")))
        if out is not None and kind in self.checked:
            return out
        whole = process(**kwargs)
        self.checked.add(kind)
        if out is None:
            self.enabled = False
            logger.info("PrefixFlow: the processor's outputs have a layout repeated rows cannot be read in; every row "
                        "is processed.")
        elif not same_outputs(out, whole):
            self.enabled = False
            logger.warning("PrefixFlow: the processor's outputs for repeated rows differ from processing every row; "
                           "every row is processed from now on.")
        return whole


def _reduce_as_processor(self, protocol):
    """A view pickles as the processor it shows."""
    processor = object.__new__(type(self).__mro__[1])
    processor.__dict__ = self.__dict__
    return _as_is, (processor,)


def _as_is(processor):
    return processor


def _call_once_per_row(self, *args, **kwargs):
    process = super(type(self), self).__call__
    return process(*args, **kwargs) if args else self._rows_once.call(process, kwargs)


def _rows(images, text) -> bool:
    return (isinstance(text, (list, tuple)) and isinstance(images, (list, tuple)) and len(text) == len(images) > 1
            and all(isinstance(t, str) for t in text)
            and all(i is None or isinstance(i, (list, tuple)) for i in images))


def distinct_rows(text: list[str], images: list) -> tuple[list[int], list[int]]:
    """The first row of each distinct (text, images) and, per row, the position of its distinct row in that list."""
    firsts, index, contents = [], [], {}

    def content(image):  # each image read once per call
        if id(image) not in contents:
            contents[id(image)] = image_content(image)
        return contents[id(image)]

    for row, (words, pictures) in enumerate(zip(text, images)):
        pictures = pictures or []
        match = next((k for k, first in enumerate(firsts) if text[first] == words
                      and len(images[first] or []) == len(pictures)
                      and all(content(a) == content(b) for a, b in zip(images[first] or [], pictures))), None)
        if match is None:
            firsts.append(row)
            match = len(firsts) - 1
        index.append(match)
    return firsts, index


def image_content(image) -> tuple:
    """What the processor reads of an image: its pixels, and for PIL its mode, size, metadata and palette (a
    transparent index changes the pixels it converts to); an unknown type by identity, never equal to another."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        return "array", image.shape, image.dtype.str, image.tobytes()
    if hasattr(image, "getpalette") and hasattr(image, "tobytes"):
        return ("pil", image.mode, image.size, image.info, image.getpalette("RGBA") if image.palette else None,
                image.tobytes())
    return "object", id(image)


ROW_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "batch_num_images")
IMAGE_KEYS = ("image_grid_thw", "image_sizes")


def layout(name: str, out) -> str | None:
    """How output `name` lines up with the rows: "row", "image", "patch" (by `image_grid_thw`) or None (unknown)."""
    pixels = out.get("pixel_values")
    stacked_per_row = getattr(pixels, "ndim", 0) == 5 and "image_sizes" not in out  # Idefics3, not LLaVA-OneVision
    if name in ROW_KEYS or (name in ("pixel_values", "pixel_attention_mask") and stacked_per_row):
        return "row"
    if name == "pixel_values":
        return "patch" if "image_grid_thw" in out else "image"
    return "image" if name in IMAGE_KEYS else None


def repeat_rows(out, index: list[int], images_per_row: list[int]):
    """`out` (the processor's outputs for the distinct rows) as the outputs for every row (`index`: each row's distinct
    row; `images_per_row`: the distinct rows' image counts), or None where an output's layout is unknown or its length
    does not match it."""
    counts = {"row": [1] * len(images_per_row), "image": images_per_row}
    grid = out.get("image_grid_thw")
    if grid is not None:
        patches = [int(np.prod(list(g))) for g in grid]
        counts["patch"] = [sum(patches[s:e]) for s, e in _bounds(images_per_row)]
    repeated = {}
    for name, value in out.items():
        kind = layout(name, out)
        if kind is None or kind not in counts or getattr(value, "ndim", 1) == 0 or len(value) != sum(counts[kind]):
            return None
        repeated[name] = _take(value, _spans(counts[kind], index))
    return type(out)(data=repeated)


def _bounds(counts: list[int]) -> list[tuple[int, int]]:
    starts = np.cumsum([0] + counts).tolist()
    return list(zip(starts[:-1], starts[1:]))


def _spans(sizes: list[int], index: list[int]) -> list[int]:
    """Each row's entries, taken from its distinct row's span (`sizes`: the distinct rows' entry counts)."""
    bounds = _bounds(sizes)
    return [i for row in index for i in range(*bounds[row])]


def _take(value, positions: list[int]):
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(positions, dtype=torch.long, device=value.device)]
    if isinstance(value, np.ndarray):
        return value[positions]
    return [value[p] for p in positions]


def same_outputs(a, b) -> bool:
    """Whether two processor outputs hold the same keys and values (tensors, arrays and nested lists)."""
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)


def _same_value(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                and x.dtype == y.dtype and torch.equal(x, y))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype
                and np.array_equal(x, y))
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_value(u, v) for u, v in zip(x, y))
    return type(x) is type(y) and x == y
