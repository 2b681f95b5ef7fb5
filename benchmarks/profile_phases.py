"""Where PrefixFlow's time goes on a GPU: CUDA time per phase and the top kernels, next to one baseline sequence.

    python benchmarks/profile_phases.py --model qwen3-1.7b --prefix 10240 --suffix 2048 --n 4

Prints (and writes to `profile_<model>.txt`, `_offload` appended with `--offload`): baseline time per sequence;
Phase A, per-wave B and Phase C times (CUDA events, after a warm-up) with the TFLOP/s each reaches by
`hf_prefixflow.planning.flops` (Phase A is a third of the prefix's training FLOPs, C the rest): a phase well below the
baseline's rate is where the FLOP bound is lost; then torch.profiler's top CUDA kernels for one baseline sequence and
for one group. The times and rates also go to `profile_<model>.json` and `.md`, with a generated `MANIFEST.md`
(`harness.RunFolder`).
"""

from __future__ import annotations

import datetime

import torch
from torch.profiler import ProfilerActivity, profile

import harness
import hf_prefixflow
from hf_prefixflow.planning.flops import ModelShape
from speed import baseline_group, build, group_parser, random_group, suffix_loss


def phases(model, prompt, suffixes, wave: int = 1) -> dict[str, float]:
    times = {"A": 0.0, "B": 0.0, "C": 0.0}
    scope = hf_prefixflow.prefix_group(model, prompt)
    group = None

    def enter():
        nonlocal group
        group = scope.__enter__()

    times["A"] = harness.seconds(enter)
    for start in range(0, len(suffixes), wave):
        batch = torch.stack(suffixes[start : start + wave])
        times["B"] += harness.seconds(lambda: suffix_loss(group(batch).logits, batch).backward())
    times["C"] = harness.seconds(lambda: scope.__exit__(None, None, None))
    return times


def top_kernels(fn, rows: int) -> str:
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> None:
    parser = group_parser(__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--wave", type=int, default=1, help="suffixes per wave")
    parser.add_argument("--offload", action="store_true", help="prefix activation offload (hf_prefixflow.core.offload)")
    parser.add_argument("--prefix-recompute", type=float, default=None, help="share of prefix layers recomputed")
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_profile_phases")
    args = parser.parse_args()

    model = hf_prefixflow.apply_prefixflow(build(args.model), offload=args.offload,
                                           prefix_recompute=args.prefix_recompute)
    prompt, suffixes = random_group(model, args.prefix, args.suffix, args.n)
    for _ in range(2):  # warm-up: allocator, cuBLAS handles, kernel selection
        baseline_group(model, prompt, suffixes[:1])
        phases(model, prompt, suffixes, args.wave)
    per_sequence = harness.seconds(lambda: baseline_group(model, prompt, suffixes[:1]))
    split = phases(model, prompt, suffixes, args.wave)
    shape, p, s = ModelShape.from_config(model.config), args.prefix, args.suffix
    prefix_flops = shape.prefixflow(p, [])
    rate = {"baseline": shape.full_sequence(p, [s]) / per_sequence, "A": prefix_flops / 3 / split["A"],
            "B": (shape.prefixflow(p, [s] * args.n) - prefix_flops) / split["B"], "C": prefix_flops * 2 / 3 / split["C"]}
    waves = -(-args.n // args.wave)
    lines = [f"{args.model} P={args.prefix} S={args.suffix} N={args.n} wave={args.wave} offload={args.offload} "
             f"prefix_recompute={args.prefix_recompute}",
             f"baseline per sequence: {per_sequence:.3f} s  (group of N: {per_sequence * args.n:.3f} s)",
             f"PrefixFlow: A {split['A']:.3f} s, B {split['B']:.3f} s ({split['B'] / waves:.3f} s per wave), "
             f"C {split['C']:.3f} s, total {sum(split.values()):.3f} s",
             "TFLOP/s: " + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in rate.items()), "",
             "== baseline, one sequence ==", top_kernels(lambda: baseline_group(model, prompt, suffixes[:1]), args.rows),
             "== PrefixFlow, one group ==", top_kernels(lambda: phases(model, prompt, suffixes, args.wave), args.rows)]
    text = "\n".join(lines)
    print(text)
    run = harness.RunFolder("profile_phases", args.out, tag=f"profile_{args.model}{'_offload' * args.offload}")
    row = {"model": args.model, "P": p, "S": s, "N": args.n, "wave": args.wave, "offload": args.offload,
           "prefix_recompute": args.prefix_recompute, "baseline_per_sequence_s": round(per_sequence, 4),
           **{f"phase_{k.lower()}_s": round(v, 4) for k, v in split.items()},
           **{f"{'phase_' * (k != 'baseline')}{k.lower()}_tflops": round(v / 1e12, 1) for k, v in rate.items()},
           **run.environment}
    run.write([row], [f"- {line}" for line in lines[:4]])
    run.attach(f"{run.stem}.txt", text + "\n", "the times and the top kernels")


if __name__ == "__main__":
    main()
