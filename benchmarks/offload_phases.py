"""What offload costs per phase: CUDA-event times of Phase A, B and C with and without it, then a profile of each.

    python benchmarks/offload_phases.py --model qwen3-1.7b --n 4

Phases are timed by events on the compute stream without synchronising between waves (as a training step runs);
median of `--repeats` groups after two warm-up groups. Offload runs with `prefix_recompute` 1 (the default).
"""

from __future__ import annotations

import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import hf_prefixflow
from speed import build, group_parser, random_group, suffix_loss


def event() -> torch.cuda.Event:
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def group(model, prompt, suffixes) -> tuple[float, float, float]:
    scope = hf_prefixflow.prefix_group(model, prompt)
    start = event()
    waves = scope.__enter__()
    after_a = event()
    for suffix in suffixes:
        suffix_loss(waves(suffix[None]).logits, suffix[None]).backward()
    after_b = event()
    scope.__exit__(None, None, None)
    end = event()
    torch.cuda.synchronize()
    return start.elapsed_time(after_a), after_a.elapsed_time(after_b), after_b.elapsed_time(end)


def main() -> None:
    parser = group_parser(__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()

    model = build(args.model)
    prompt, suffixes = random_group(model, args.prefix, args.suffix, args.n)
    for offload in (False, True):
        hf_prefixflow.apply_prefixflow(model, offload=offload, prefix_recompute=1.0 if offload else 0.0)
        for _ in range(2):
            group(model, prompt, suffixes)
        times = [group(model, prompt, suffixes) for _ in range(args.repeats)]
        a, b, c = (statistics.median(t[i] for t in times) for i in range(3))
        print(f"offload={offload}: A {a:.1f} ms, B {b:.1f} ms, C {c:.1f} ms, group {a + b + c:.1f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            group(model, prompt, suffixes)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows), flush=True)


if __name__ == "__main__":
    main()
