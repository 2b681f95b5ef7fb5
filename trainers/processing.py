"""The processor once per distinct row: a GRPO batch repeats each prompt, images included, `num_generations` times,
and TRL runs the processor on every row, twice a step (the prompts' tokens for generation, then the forward's
tensors). `RowsOnce.applied(trainer)` lets it process each distinct row (same text, images equal pixel for pixel) once and
repeats its outputs; the first call of each kind is also processed whole and compared, and a difference turns the
sharing off for the run, logged.

The outputs' leading dimension tells their layout: per row (token ids, masks, Idefics3's per-row pixel tensors), per
image (`image_grid_thw`, `image_sizes`, one pixel tensor per image) or per patch (Qwen-VL's `pixel_values`, cut by
`image_grid_thw`). Where two layouts would read one length differently, the rows are processed whole.
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
            self._views[cls] = type(cls.__name__, (cls,), {"__call__": _call_once_per_row, "_rows_once": self})
        view = object.__new__(self._views[cls])
        view.__dict__ = processor.__dict__  # the same processor: settings and sub-processors shared, nothing copied
        return view

    def call(self, process, kwargs: dict):
        """`process(**kwargs)` with each distinct row processed once, or every row where it cannot be shared."""
        images, text = kwargs.get("images"), kwargs.get("text")
        if not self.enabled or not _rows(images, text):
            return process(**kwargs)
        firsts, index = distinct_rows(text, images)
        if len(firsts) == len(index):
            return process(**kwargs)
        once = process(**{**kwargs, "images": [images[r] for r in firsts], "text": [text[r] for r in firsts]})
        out = repeat_rows(once, index, [len(images[r] or []) for r in firsts])
        kind = (tuple(sorted(once.keys())), str(kwargs.get("return_tensors")))
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


def _call_once_per_row(self, *args, **kwargs):
    process = super(type(self), self).__call__
    return process(*args, **kwargs) if args else self._rows_once.call(process, kwargs)


def _rows(images, text) -> bool:
    return (isinstance(text, (list, tuple)) and isinstance(images, (list, tuple)) and len(text) == len(images) > 1
            and all(isinstance(t, str) for t in text) and all(i is None or isinstance(i, (list, tuple)) for i in images))


def distinct_rows(text: list[str], images: list) -> tuple[list[int], list[int]]:
    """The first row of each distinct (text, images) and, per row, the position of its distinct row in that list."""
    firsts, index = [], []
    for row, (words, pictures) in enumerate(zip(text, images)):
        match = next((k for k, first in enumerate(firsts)
                      if text[first] == words and _same_images(images[first], pictures)), None)
        if match is None:
            firsts.append(row)
            match = len(firsts) - 1
        index.append(match)
    return firsts, index


def _same_images(a, b) -> bool:
    a, b = a or [], b or []
    return len(a) == len(b) and all(x is y or _same_image(x, y) for x, y in zip(a, b))


def _same_image(x, y) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
    if hasattr(x, "tobytes") and hasattr(y, "tobytes") and hasattr(x, "mode"):  # PIL
        return (x.mode, x.size, x.getpalette()) == (y.mode, y.size, y.getpalette()) and x.tobytes() == y.tobytes()
    return False


def repeat_rows(out, index: list[int], images_per_row: list[int]):
    """`out` (the processor's outputs for the distinct rows) as the outputs for every row (`index`: each row's distinct
    row; `images_per_row`: the distinct rows' image counts), or None where a length reads as two layouts or none."""
    rows, images = len(images_per_row), sum(images_per_row)
    image_take = _spans(images_per_row, index)
    grid = out.get("image_grid_thw")
    repeated = {}
    for name, value in out.items():
        if not hasattr(value, "__len__"):
            return None
        length = len(value)
        if name == "pixel_values" and grid is not None:
            patches = [int(np.prod(list(g))) for g in grid]
            if length != sum(patches):
                return None
            take = _spans([sum(patches[s:e]) for s, e in _bounds(images_per_row)], index)
        elif length == rows == images and index != image_take:
            return None
        elif length == rows:
            take = index
        elif length == images:
            take = image_take
        else:
            return None
        repeated[name] = _take(value, take)
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
