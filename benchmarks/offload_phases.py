"""What offload costs per phase: CUDA-event times of Phase A, B and C in variants that isolate each cause.

    python benchmarks/offload_phases.py --model qwen3-1.7b --n 4

Variants: `plain` (no offload, no recompute), `recompute` (prefix layers checkpointed on the device, no offload),
`offload` (the default offload: recompute 1, attention replayed), `offload-drained` (the same, but the host waits for
Phase A's copies to the host before Phase B starts), `offload-nogc` (the same, Python's collector off during the
group), `offload-keepdown` (the same, the compiled recompute running the MLP's down projection that it leaves out by
default), `offload:S` (offload recomputing a share S of the prefix layers, copying the others back). Phase B runs the
suffixes in waves of `--wave` (at one suffix a wave, Phase B is host-bound: its time then follows the host's speed
more than the GPU's). Phases are timed by events on the compute stream without synchronising between waves (as a
training step runs); median of `--repeats` groups after two warm-up groups, the variants interleaved round by round
(and each group's time against the first variant's in its round); Phase B's peak allocated memory from one more group.
`--profile B` (or `A`, `C`) adds a profile of that phase alone per variant: its kernel time, and the time the compute
stream had no kernel running. `--compare-gradients V` checks that the variants train alike: each one's gradients
against variant V's. With `--out`, a row per variant (its medians, Phase-B peak, paired ratio, and the gradient
comparison and profile summary where run) also goes to `offload_phases.json`, `.md` and a generated `MANIFEST.md`
there (`harness.RunFolder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import harness
from hf_prefixflow import _compat
import hf_prefixflow
from hf_prefixflow.core.recompute import RESIDUAL_MLP_LAYERS
from speed import build, group_parser, random_group, suffix_loss

@dataclasses.dataclass(frozen=True)
class Variant:
    offload: bool = False
    recompute: float = 0.0  # prefix_recompute
    drain: bool = False  # the host waits for Phase A's copies to the host before Phase B starts
    nogc: bool = False  # Python's collector off during the group
    keepdown: bool = False  # the compiled recompute runs the MLP's down projection


OFFLOAD = Variant(offload=True, recompute=1.0)
VARIANTS = {"plain": Variant(), "recompute": Variant(recompute=1.0), "offload": OFFLOAD,
            "offload-drained": dataclasses.replace(OFFLOAD, drain=True),
            "offload-nogc": dataclasses.replace(OFFLOAD, nogc=True),
            "offload-keepdown": dataclasses.replace(OFFLOAD, keepdown=True)}


def event() -> torch.cuda.Event:
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def settings(variant: str) -> Variant:
    name, _, share = variant.partition(":")
    return dataclasses.replace(VARIANTS[name], recompute=float(share)) if share else VARIANTS[name]


def group(model, prompt, waves, variant: str, watch=None, phase: str = "B") -> tuple[float, float, float, float]:
    """One group: Phase A, B and C in ms, and Phase B's peak allocated GiB when `watch` is given: a context (a
    profiler, or a null context) entered around `phase` ("A", "B" or "C"), the host then waiting for the device around
    that phase."""
    setting = settings(variant)
    hf_prefixflow.apply_prefixflow(model, offload=setting.offload, prefix_recompute=setting.recompute)
    # An empty allowlist makes the compiled recompute run the MLP's down projection, as before it was left out.
    hf_prefixflow.core.recompute.RESIDUAL_MLP_LAYERS = frozenset() if setting.keepdown else RESIDUAL_MLP_LAYERS
    watched = lambda name: watch if watch is not None and name == phase else contextlib.nullcontext()  # noqa: E731
    if setting.nogc:
        gc.disable()
    try:
        scope = hf_prefixflow.prefix_group(model, prompt)
        if watch is not None:
            torch.cuda.synchronize()
        start = event()
        with watched("A"):
            opened = scope.__enter__()
            if watch is not None:
                torch.cuda.synchronize()
        if setting.drain or watch is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        after_a = event()
        with watched("B"):
            for batch in waves:
                suffix_loss(opened(batch).logits, batch).backward()
            after_b = event()
            if watch is not None:
                torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        with watched("C"):
            scope.__exit__(None, None, None)
            end = event()
            torch.cuda.synchronize()
    finally:
        gc.enable()
    return start.elapsed_time(after_a), after_a.elapsed_time(after_b), after_b.elapsed_time(end), peak


def gradients_after(model, prompt, waves, variant: str) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after one group of `variant` from zero gradients, on the host."""
    model.zero_grad(set_to_none=True)
    group(model, prompt, waves, variant)
    return {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}


def compute_stream_profile(prof) -> tuple[float, float, float]:
    """(kernel ms, idle ms, span ms) of the stream that ran the most kernel time, from a profile's GPU events."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            by_stream.setdefault(e.device_resource_id, []).append((e.time_range.start, e.time_range.end))
    spans = max(by_stream.values(), key=lambda s: sum(b - a for a, b in s))
    spans.sort()
    busy, reach = 0.0, spans[0][0]
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    span = spans[-1][1] - spans[0][0]
    return busy / 1e3, (span - busy) / 1e3, span / 1e3


def main() -> None:
    parser = group_parser(__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--wave", type=int, default=1, help="suffixes per wave")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)} (offload:S for a recompute share S)")
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--checkpointing", action="store_true",
                        help="non-reentrant activation checkpointing in every variant (offload then moves the layer "
                             "inputs that checkpointing keeps, recomputing nothing more)")
    parser.add_argument("--profile", choices=("A", "B", "C"), help="also profile this phase of each variant")
    parser.add_argument("--compare-gradients", metavar="VARIANT",
                        help="also train one group per variant from zero gradients and compare the others' "
                             "gradients with this variant's (kept on the host)")
    parser.add_argument("--out", default=None, help="a run folder for the rows (default: print only)")
    args = parser.parse_args()
    variants = args.variants.split(",")

    model = build(args.model, compile=args.compile)
    if args.checkpointing:
        _compat.enable_checkpointing(model)
    prompt, suffixes = random_group(model, args.prefix, args.suffix, args.n)
    waves = [torch.stack(suffixes[i : i + args.wave]) for i in range(0, args.n, args.wave)]
    for variant in variants:
        for _ in range(2):
            group(model, prompt, waves, variant)
    setting = {k: getattr(args, k) for k in ("model", "prefix", "suffix", "n", "wave", "compile", "checkpointing")}
    rows = {v: {**setting, "variant": v} for v in variants}
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            times[variant].append(group(model, prompt, waves, variant))
    for variant in variants:
        a, b, c = (statistics.median(t[i] for t in times[variant]) for i in range(3))
        peak = group(model, prompt, waves, variant, watch=contextlib.nullcontext())[3]
        paired = [sum(t[:3]) / sum(r[:3]) - 1 for t, r in zip(times[variant], times[variants[0]])]
        rows[variant].update(a_ms=round(a, 2), b_ms=round(b, 2), c_ms=round(c, 2), group_ms=round(a + b + c, 2),
                             phase_b_peak_gib=round(peak, 3), paired_group_ratio=round(statistics.median(paired), 4))
        print(f"{variant}: A {a:.1f} ms, B {b:.1f} ms, C {c:.1f} ms, group {a + b + c:.1f} ms; "
              f"Phase-B peak {peak:.2f} GiB; against {variants[0]}, median of the per-round group ratios "
              f"{statistics.median(paired):+.1%}", flush=True)
    base = args.compare_gradients
    reference = gradients_after(model, prompt, waves, base) if base else {}
    for variant in [v for v in variants if v != base] if base else []:
        actual = gradients_after(model, prompt, waves, variant)
        equal = all(torch.equal(actual[name], grad) for name, grad in reference.items())
        ratios = {name: ((actual[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30)).item()
                  for name, grad in reference.items()}
        worst = max(ratios, key=ratios.get)
        rows[variant].update(gradients_against=base, gradients_bitwise_equal=equal, worst_gradient_ratio=ratios[worst],
                             worst_gradient_parameter=worst)
        print(f"{variant}: gradients {'bitwise equal to' if equal else 'differ from'} {base}'s (max |difference| / "
              f"max |gradient|: worst {ratios[worst]:.2e} in {worst}, median over parameters "
              f"{statistics.median(ratios.values()):.2e})", flush=True)
    for variant in variants if args.profile else []:
        prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
        group(model, prompt, waves, variant, watch=prof, phase=args.profile)
        kernels, idle, span = compute_stream_profile(prof)
        rows[variant].update({f"phase_{args.profile.lower()}_profile_ms": {"kernels": round(kernels, 2),
                                                                          "idle": round(idle, 2),
                                                                          "span": round(span, 2)}})
        print(f"== {variant}, Phase {args.profile} profiled: compute stream {kernels:.1f} ms of kernels, "
              f"{idle:.1f} ms idle, {span:.1f} ms span", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows), flush=True)
    if args.out:
        run = harness.RunFolder("offload_phases", args.out)
        rows = [{**row, **run.environment} for row in rows.values()]
        run.write(rows, [f"{args.model}, P={args.prefix}, S={args.suffix}, N={args.n}, wave {args.wave}; median of "
                         f"{args.repeats} groups after two, variants interleaved.", "",
                         "| variant | A ms | B ms | C ms | group ms | Phase-B peak GiB "
                         "| against the first, per round |",
                         "| --- " * 7 + "|"] + [
            f"| {r['variant']} | {r['a_ms']} | {r['b_ms']} | {r['c_ms']} | {r['group_ms']} | {r['phase_b_peak_gib']} | "
            f"{r['paired_group_ratio']:+.1%} |" for r in rows])


if __name__ == "__main__":
    main()
