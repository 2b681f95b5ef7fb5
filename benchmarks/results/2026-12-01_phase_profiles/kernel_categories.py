"""Phase B against the baseline, kernel by kernel: CUDA time per category (GEMM, attention, element-wise, ...).

    python benchmarks/kernel_categories.py --model llama3-8b --wave 2

Profiles `--wave` baseline sequences `[P || S_i]` and then two Phase-B waves of `--wave` suffixes each (Phase A and
C outside the profile), and prints each side's kernel time by category with the largest non-GEMM, non-attention
kernels. Divide by the tokens each side ran (baseline: wave x (P + S); Phase B: 2 x wave x S) to compare per token.
"""

from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

import hf_prefixflow
from speed import baseline_group, build, group_parser, random_group, suffix_loss

CATEGORIES = (
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")), ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("memcpy", ("memcpy", "memset")), ("compiled", ("triton",)), ("reduce", ("reduce",)),
    ("element-wise", ("elementwise", "vectorized")),
)


def category(name: str) -> str:
    name = name.lower()
    return next((label for label, keys in CATEGORIES if any(k in name for k in keys)), "other")


def breakdown(prof, label: str, rows: int) -> None:
    total, calls, others = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = category(event.name)
            total[kind] += event.device_time_total / 1000
            calls[kind] += 1
            if kind not in ("gemm", "attention"):
                others[event.name[:90]] += event.device_time_total / 1000
    print(f"== {label}: {sum(total.values()):.1f} ms of kernels")
    for kind, ms in total.most_common():
        print(f"  {kind:13s} {ms:9.1f} ms  {calls[kind]:6d} kernels")
    for name, ms in others.most_common(rows):
        print(f"     {ms:8.1f} ms  {name}")


def main() -> None:
    parser = group_parser(__doc__, model="llama3-8b")
    parser.add_argument("--wave", type=int, default=2)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()

    model = build(args.model)
    prompt, suffixes = random_group(model, args.prefix, args.suffix, 2 * args.wave)

    def waves(group) -> None:
        for start in range(0, len(suffixes), args.wave):
            batch = torch.stack(suffixes[start : start + args.wave])
            suffix_loss(group(batch).logits, batch).backward()

    for _ in range(2):  # warm-up: allocator, kernel selection, the compiled merge
        baseline_group(model, prompt, suffixes[:1])
        with hf_prefixflow.prefix_group(model, prompt) as group:
            waves(group)
    with profile(activities=[ProfilerActivity.CUDA]) as baseline:
        baseline_group(model, prompt, suffixes[: args.wave])
        torch.cuda.synchronize()
    with hf_prefixflow.prefix_group(model, prompt) as group:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as phase_b:
            waves(group)
            torch.cuda.synchronize()
    breakdown(baseline, f"baseline, {args.wave} sequences of {args.prefix + args.suffix} tokens", args.rows)
    breakdown(phase_b, f"Phase B, 2 waves of {args.wave} x {args.suffix} tokens", args.rows)


if __name__ == "__main__":
    main()
