"""CUDA-event timing shared by the benchmarks: warm up, then the median of timed repetitions."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   after_warmup: Callable[[], object] | None = None) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)
