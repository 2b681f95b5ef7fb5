"""Memory on one GPU (paper Claim 4): the baseline's peak against PrefixFlow's Phase-B peak with and without
offload, step times, and the capacity frontier.

    PYTHONPATH=. python benchmarks/memory.py --out $OUT            # about 6-7 minutes on one H200
    PYTHONPATH=. python benchmarks/memory.py --tiny --out /tmp/mem  # CPU smoke run of every code path

Setup, the same for every mode: one model object (speed.py's `build`: the Qwen3-1.7B shape from config, bf16
weights and gradients, SDPA, full-parameter, activation checkpointing only with --checkpointing) and speed.py's loss
on suffix tokens.
A *step* is one group, gradients set to None before it (as after an optimizer step), no optimizer step:
  baseline    N rows [P || S_i] forward+backward, --wave rows per forward, logits only for suffix tokens;
  PrefixFlow  Phase A (prefix forward), N suffix waves of --wave rows forward+backward, Phase C.
Peaks are torch.cuda.max_memory_allocated, weights and gradients included (`static_gib`). The allocator counts in
program order, so the Phase-B peak is the statistic reset when Phase A returns and read before Phase C, with no
synchronisation that would change the timing (a tensor waiting for its offload copy counts as freed; the
allocator waits for such copies before it reports out-of-memory, so the frontier search sees their cost).
No checkpointing by default: with per-layer checkpointing the prefix keeps only each layer's input (offloaded as
well, see tests/test_offload.py) while its K/V and fp32 gK/gV are 3x that, so little dormant state is left to move
(and offload costs little); the paper's default, selective checkpointing, lies between the two.

 1. fixed total: --total tokens split as --splits, N=--n; a warm-up step per (split, mode), then --repeats
    rounds of one timed step per mode (interleaved) at --timed-split, --repeats-other elsewhere (time: median;
    peaks: the last step; the offload cost: the median of each round's offload step over its PrefixFlow step).
 2. frontier: per mode, the longest total length that trains at --frontier-split's prefix ratio with
    N=--frontier-n: doubling from --frontier-start, then bisection to --frontier-resolution, under a device
    cap of --frontier-cap-gib (set_per_process_memory_fraction; the H200's 139 GiB would need lengths whose
    pinned pool exceeds the host's memory and minutes per trial). An offload trial whose predicted pinned pool
    exceeds --host-budget-gib is not run and counts as failed with that reason. --frontier-mode-s caps each mode.
 3. long prefix: P = the shortest total the baseline failed at plus --frontier-resolution; a baseline step on
    [P || 256], and
    PrefixFlow+offload with the longest of a few suffixes that trains.
Everything stops at --deadline-s and writes what it has (memory.json, memory.md, memory.png) after each section.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import pathlib
import statistics
import time
from typing import Callable

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import hf_prefixflow
from hf_prefixflow.model import unwrap
from hf_prefixflow.recompute import RECOMPUTE_SHARE
from speed import SHAPES, build, suffix_loss

GIB = 2**30
MODES = ("baseline", "prefixflow", "offload")
TARGETS = {"phase_b_reduction_at_timed_split": 0.60, "frontier_ratio": 1.8, "offload_time_cost": 0.03}
TINY_SHAPE = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)
TINY_ARGS = dict(total=96, splits="80/16,64/32,48/48,32/64,16/80", timed_split="80/16", n=4, frontier_split="80/16",
                 frontier_start=32, frontier_resolution=16, frontier_max=1024, tiny_oom_tokens=200)


class Bench:
    """The model under test, its device, the arguments, and the wall-clock deadline."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device("cpu" if args.tiny else "cuda")
        missing = [name for name, owner in (("host_memory_stats", torch.cuda), ("_host_emptyCache", torch._C))
                   if not args.tiny and not hasattr(owner, name)]
        if missing:
            raise SystemExit(f"this torch lacks {missing}, which bound the pinned host pool between steps")
        self.model = build_tiny() if args.tiny else build(args.model, compile=args.compile)
        if args.checkpointing:  # baseline and PrefixFlow alike
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.vocab = self.model.config.vocab_size
        self.started = time.monotonic()
        self.deadline = self.started + args.deadline_s
        self.trial_total = 0  # --tiny: the length the next step runs at, for the simulated out-of-memory
        self.phase_ms: dict[str, float] = {}  # the last step's milliseconds per phase (CUDA only)
        self.host_bytes_per_token = 0.0  # offload: pinned bytes per cached prefix token, measured by the steps
        if args.tiny:
            self.model.model.layers[0].register_forward_pre_hook(self._simulated_oom)

    def _simulated_oom(self, module, args) -> None:
        if self.trial_total > self.args.tiny_oom_tokens:
            raise torch.cuda.OutOfMemoryError(f"--tiny: simulated out of memory at {self.trial_total} tokens")

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def group(self, prefix: int, suffix: int, n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        prompt = torch.randint(0, self.vocab, (prefix,), device=self.device, generator=gen)
        return prompt, list(torch.randint(0, self.vocab, (n, suffix), device=self.device, generator=gen))

    def static_gib(self) -> float:
        """Weights plus their gradients."""
        return 2 * sum(p.numel() * p.element_size() for p in self.model.parameters()) / GIB


def build_tiny() -> torch.nn.Module:
    spec = dict(TINY_SHAPE)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=4096, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return hf_prefixflow.apply_prefixflow(model.train())


# -- steps and measurement -----------------------------------------------------------------------------------

class PhasePeaks:
    """Peak allocated GiB per phase: each mark records the peak since the previous mark, and a CUDA event for the
    phase's time. CPU: no statistics (0)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.gib: dict[str, float] = {}
        self.events: list[tuple[str | None, torch.cuda.Event]] = []

    def mark(self, phase: str | None) -> None:
        if phase is not None:
            self.gib[phase] = torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.events.append((phase, torch.cuda.Event(enable_timing=True)))
            self.events[-1][1].record()

    def ms(self) -> dict[str, float]:
        """Milliseconds per phase, once the device has run past the last mark."""
        return {phase: start.elapsed_time(end) for (_, start), (phase, end) in zip(self.events, self.events[1:])}


def baseline_step(model, prompt, suffixes, wave: int, mark: Callable[[str | None], None]) -> None:
    for start in range(0, len(suffixes), wave):
        batch = torch.stack(suffixes[start : start + wave])
        ids = torch.cat([prompt.expand(len(batch), -1), batch], dim=1)
        logits = model(ids, logits_to_keep=batch.shape[1] + 1, use_cache=False).logits[:, :-1]
        suffix_loss(logits, batch).backward()
    mark("step")


def prefixflow_step(model, prompt, suffixes, wave: int, mark: Callable[[str | None], None]) -> None:
    with hf_prefixflow.prefix_group(model, prompt) as group:
        mark("A")
        for start in range(0, len(suffixes), wave):
            batch = torch.stack(suffixes[start : start + wave])
            suffix_loss(group(batch).logits, batch).backward()
        mark("B")
    mark("C")


def run_step(bench: Bench, mode: str, prompt, suffixes, wave: int) -> tuple[float, dict[str, float]]:
    """One step of `mode`; its seconds (synchronised at both ends only) and its peaks per phase."""
    model = bench.model
    offload = mode == "offload"
    hf_prefixflow.apply_prefixflow(model, offload=offload, prefix_recompute=bench.args.prefix_recompute if offload else 0)
    model.zero_grad(set_to_none=True)
    bench.trial_total = len(prompt) + len(suffixes[0])
    peaks = PhasePeaks(bench.device)
    bench.sync()
    peaks.mark(None)
    start = time.perf_counter()
    (baseline_step if mode == "baseline" else prefixflow_step)(model, prompt, suffixes, wave, peaks.mark)
    bench.sync()
    seconds = time.perf_counter() - start
    bench.phase_ms = peaks.ms()
    if mode == "offload":
        cached = len(prompt) - 1
        bench.host_bytes_per_token = max(bench.host_bytes_per_token, host_pool_bytes(bench) / cached)
    return seconds, peaks.gib


def host_pool_bytes(bench: Bench) -> int:
    """Host bytes behind the model's offload pool; pinned buffers come from torch's host allocator, which rounds
    every request up to a power of two."""
    pool = unwrap(bench.model)._prefixflow_pool
    sizes = [buffer.numel() for buffer in pool.free]
    return sum(1 << (size - 1).bit_length() for size in sizes) if pool.pin else sum(sizes)


def fresh_host_pool(bench: Bench) -> None:
    """Drop the model's offload pool (its buffers go back to torch's host allocator, which caches them)."""
    inner = unwrap(bench.model)
    if hasattr(inner, "_prefixflow_pool"):
        del inner._prefixflow_pool
    gc.collect()


def pinned_bytes() -> int:
    """Pinned host bytes torch's host allocator owns, cached blocks included."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def make_room_on_host(bench: Bench, prefix: int) -> None:
    """Return cached pinned blocks to the driver when they and the next offload step would exceed the host
    budget (keeping them otherwise saves pinning again for nearby lengths)."""
    need = bench.host_bytes_per_token * 1.1 * prefix
    if bench.device.type == "cuda" and pinned_bytes() + need > bench.args.host_budget_gib * GIB:
        torch._C._host_emptyCache()


def cleanup(bench: Bench) -> None:
    bench.model.zero_grad(set_to_none=True)
    fresh_host_pool(bench)
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


# -- 1. fixed total ------------------------------------------------------------------------------------------

def fixed_total(bench: Bench) -> list[dict]:
    args = bench.args
    rows = []
    baseline_warm = False
    for split in args.splits.split(","):
        prefix, suffix = map(int, split.split("/"))
        if prefix + suffix != args.total:
            raise SystemExit(f"split {split} does not add up to --total {args.total}")
        prompt, suffixes = bench.group(prefix, suffix, args.n)
        repeats = args.repeats if split == args.timed_split else args.repeats_other
        if bench.past_deadline():
            bench.log(f"deadline: fixed-total stops before {split}")
            return rows
        fresh_host_pool(bench)
        make_room_on_host(bench, prefix)
        for mode in MODES:  # warm-up (the baseline once: its shapes barely change across splits)
            if mode != "baseline" or not baseline_warm:
                run_step(bench, mode, prompt, suffixes, args.wave)
        baseline_warm = True
        steps: dict[str, list] = {mode: [] for mode in MODES}
        phases: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(repeats):  # interleaved, so that a drift in the machine's speed meets every mode alike
            for mode in MODES:
                steps[mode].append(run_step(bench, mode, prompt, suffixes, args.wave))
                phases[mode].append(bench.phase_ms)
        measured = {mode: (statistics.median(s for s, _ in runs), runs[-1][1]) for mode, runs in steps.items()}
        # Each repeat's offload step against the PrefixFlow step next to it, the median of those ratios.
        paired_cost = statistics.median(on / off - 1 for (on, _), (off, _) in zip(steps["offload"],
                                                                                  steps["prefixflow"]))
        for mode in MODES:
            medians = {p: round(statistics.median(r[p] for r in phases[mode]), 1) for p in phases[mode][0]}
            bench.log(f"{split} N={args.n} {mode}: {measured[mode][0]:.3f} s (rounds: "
                      f"{', '.join(f'{s:.3f}' for s, _ in steps[mode])}), peaks {measured[mode][1]}, "
                      f"median ms per phase {medians}")
        base_s, base_peaks = measured["baseline"]
        for mode in ("prefixflow", "offload"):
            seconds, peaks = measured[mode]
            rows.append({
                "model": bench.args.model, "P": prefix, "S": suffix, "N": args.n, "wave": args.wave,
                "offload": mode == "offload", "baseline_peak_gib": round(base_peaks["step"], 3),
                "phase_b_peak_gib": round(peaks["B"], 3), "phase_a_peak_gib": round(peaks["A"], 3),
                "phase_c_peak_gib": round(peaks["C"], 3), "time_s": round(seconds, 4),
                "baseline_time_s": round(base_s, 4), "repeats": repeats, "static_gib": round(bench.static_gib(), 3),
                "host_pool_gib": round(host_pool_bytes(bench) / GIB, 3) if mode == "offload" else 0.0,
                "offload_cost_paired": round(paired_cost, 4) if mode == "offload" else None,
                "step_times_s": [round(s, 4) for s, _ in steps[mode]],
            })
        cleanup(bench)
    return rows


# -- 2. capacity frontier --------------------------------------------------------------------------------------

def bracket(trains: Callable[[int], tuple[bool, str]], start: int, resolution: int, maximum: int,
            stop_at: float, log: Callable[[str], None]) -> dict:
    """Longest length that trains: doubling from `start` until a failure, then bisection down to `resolution`."""
    if start % resolution:
        raise SystemExit("--frontier-start must be a multiple of --frontier-resolution")
    trials: list[dict] = []
    longest, failed, stop = 0, None, "resolution"

    def attempt(total: int) -> bool:
        began = time.monotonic()
        ok, reason = trains(total)
        trials.append({"total": total, "trains": ok, "reason": reason, "seconds": round(time.monotonic() - began, 2)})
        log(f"  total {total}: {reason} ({trials[-1]['seconds']} s)")
        return ok

    total = start
    while failed is None:
        if total > maximum or time.monotonic() > stop_at:
            stop = "maximum" if total > maximum else "time cap"
            break
        if attempt(total):
            longest, total = total, total * 2
        else:
            failed = total
    while failed is not None and failed - longest > resolution:
        if time.monotonic() > stop_at:
            stop = "time cap"
            break
        middle = longest + (failed - longest) // resolution // 2 * resolution
        if attempt(middle):
            longest = middle
        else:
            failed = middle
    return {"longest_trains": longest, "shortest_fails": failed, "stop": stop, "trials": trials}


def trial(bench: Bench, mode: str, prefix: int, suffix: int, n: int) -> tuple[bool, str]:
    """Does one step of `mode` train at this size? Out-of-memory is caught and everything it held is freed."""
    args = bench.args
    if mode == "offload":
        if bench.host_bytes_per_token * 1.1 * prefix > args.host_budget_gib * GIB:
            return False, f"host budget (pinned pool predicted > {args.host_budget_gib} GiB)"
        make_room_on_host(bench, prefix)
    prompt, suffixes = bench.group(prefix, suffix, n)
    try:
        run_step(bench, mode, prompt, suffixes, args.wave)
        outcome = (True, "trains")
    except torch.cuda.OutOfMemoryError:
        outcome = (False, "out of memory")
    cleanup(bench)  # outside the handler: the traceback, and the tensors its frames hold, are gone by now
    return outcome


def split_total(total: int, ratio: float) -> tuple[int, int]:
    prefix = round(total * ratio)
    return prefix, total - prefix


def frontier(bench: Bench) -> dict:
    args = bench.args
    prefix, suffix = map(int, args.frontier_split.split("/"))
    ratio = prefix / (prefix + suffix)
    result = {}
    for mode in MODES:
        bench.log(f"frontier {mode} (prefix ratio {ratio:.3f}, N={args.frontier_n})")
        stop_at = min(bench.deadline, time.monotonic() + args.frontier_mode_s)
        result[mode] = bracket(lambda total: trial(bench, mode, *split_total(total, ratio), args.frontier_n),
                               args.frontier_start, args.frontier_resolution, args.frontier_max, stop_at, bench.log)
    return result


def long_prefix(bench: Bench, search: dict) -> dict:
    """A prefix at least as long as a whole sequence the baseline failed on, trained with a long suffix."""
    args = bench.args
    if search["baseline"]["shortest_fails"] is None:
        return {"skipped": "the baseline frontier search found no failing length"}
    prefix = search["baseline"]["shortest_fails"] + args.frontier_resolution
    result = {"P": prefix, "N": args.frontier_n}
    ok, reason = trial(bench, "baseline", prefix, 256, 1)
    result["baseline_prefix_plus_256"] = reason
    reach = search["offload"]["longest_trains"] - prefix
    candidates = sorted({s for s in (reach, prefix // 2, prefix // 4, args.frontier_resolution) if s > 0}, reverse=True)
    result["tried"] = []
    for suffix in candidates:
        if bench.past_deadline():
            result["tried"].append({"S": suffix, "trains": False, "reason": "deadline"})
            break
        ok, reason = trial(bench, "offload", prefix, suffix, args.frontier_n)
        result["tried"].append({"S": suffix, "trains": ok, "reason": reason})
        bench.log(f"long prefix P={prefix} S={suffix} offload: {reason}")
        if ok:
            result["S"] = suffix
            break
    return result


# -- report ----------------------------------------------------------------------------------------------------

def verdicts(report: dict) -> dict:
    """Each target against what was measured (None where the measurement is missing)."""
    timed = tuple(map(int, report["config"]["timed_split"].split("/")))
    rows = {(r["P"], r["S"], r["offload"]): r for r in report["rows"]}
    out: dict[str, object] = {}
    on, off = rows.get((*timed, True)), rows.get((*timed, False))
    if on and on["baseline_peak_gib"] > 0:
        out["phase_b_reduction_at_timed_split"] = round(1 - on["phase_b_peak_gib"] / on["baseline_peak_gib"], 3)
        static = on["static_gib"]  # context: the same cut counting activations only, weights and gradients aside
        out["phase_b_reduction_above_static"] = round(
            1 - (on["phase_b_peak_gib"] - static) / (on["baseline_peak_gib"] - static), 3)
    offload_rows = [r for r in report["rows"] if r["offload"]]
    if offload_rows:
        out["phase_b_below_baseline_at_every_split"] = all(r["phase_b_peak_gib"] < r["baseline_peak_gib"]
                                                           for r in offload_rows)
    if on and off:  # paired repeat by repeat where the run has it (see `fixed_total`)
        paired = on.get("offload_cost_paired")
        out["offload_time_cost"] = round(on["time_s"] / off["time_s"] - 1, 4) if paired is None else paired
    search = report.get("frontier") or {}
    if search.get("baseline", {}).get("longest_trains") and "offload" in search:
        out["frontier_ratio"] = round(search["offload"]["longest_trains"] / search["baseline"]["longest_trains"], 3)
        out["frontier_ratio_prefixflow_no_offload"] = round(
            search["prefixflow"]["longest_trains"] / search["baseline"]["longest_trains"], 3)
    return out


def write(report: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["verdicts"] = verdicts(report)
    (out / "memory.json").write_text(json.dumps(report, indent=1))
    (out / "memory.md").write_text(markdown(report))
    plot(report, out / "memory.png")


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"`{c['command']}` on {c['device']}, torch {c['torch']}, transformers {c['transformers']}, {c['date']}",
             "", f"Model {c['model']} ({c['dtype']}, sdpa, {'' if c.get('checkpointing') else 'no '}checkpointing, "
             f"full-parameter, no optimizer step); weights + "
             f"gradients = {c['static_gib']} GiB in every peak. Step = one group (baseline: N rows [P||S_i] fwd+bwd; "
             f"PrefixFlow: Phase A + N suffix waves + Phase C), wave {c['wave']}. Offload recomputes "
             f"{c['prefix_recompute']:.0%} of the prefix layers in Phase C (their inputs wait on the host too). "
             "Timed steps run in rounds of one per mode; `offload_time_cost` is the median over rounds of the offload "
             "step over the PrefixFlow step beside it, minus one.", "",
             "| P / S | N | offload | baseline peak GiB | Phase B peak GiB | reduction | A / C peak GiB | "
             "baseline s | PrefixFlow s | host pool GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        cut = 1 - r["phase_b_peak_gib"] / r["baseline_peak_gib"] if r["baseline_peak_gib"] else float("nan")
        lines.append(f"| {r['P']} / {r['S']} | {r['N']} | {'yes' if r['offload'] else 'no'} | "
                     f"{r['baseline_peak_gib']:.1f} | {r['phase_b_peak_gib']:.1f} | {cut:.0%} | "
                     f"{r['phase_a_peak_gib']:.1f} / {r['phase_c_peak_gib']:.1f} | {r['baseline_time_s']:.3f} | "
                     f"{r['time_s']:.3f} | {r['host_pool_gib']:.1f} |")
    search = report.get("frontier")
    if search:
        lines += ["", f"Frontier at P/S proportions {c['frontier_split']}, N={c['frontier_n']}, device capped at "
                  f"{c['frontier_cap_gib']} GiB, host pool budget {c['host_budget_gib']} GiB:", "",
                  "| mode | longest total that trains | shortest that failed (why) | stopped by | trials |",
                  "| --- | --- | --- | --- | --- |"]
        for mode, s in search.items():
            why = next((t["reason"] for t in s["trials"] if t["total"] == s["shortest_fails"]), "")
            lines.append(f"| {mode} | {s['longest_trains']} | {s['shortest_fails']} ({why}) | {s['stop']} | "
                         f"{len(s['trials'])} |")
    if report.get("long_prefix"):
        lines += ["", f"Long prefix: `{json.dumps(report['long_prefix'])}`"]
    lines += ["", "| target | goal | measured |", "| --- | --- | --- |"]
    goals = {**{k: f">= {v}" if k != "offload_time_cost" else f"<= {v}" for k, v in TARGETS.items()},
             "phase_b_below_baseline_at_every_split": "true"}
    for key, value in report["verdicts"].items():
        lines.append(f"| {key} | {goals.get(key, '(context)')} | {value} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    splits = sorted({(r["P"], r["S"]) for r in report["rows"]}, reverse=True)
    rows = {(r["P"], r["S"], r["offload"]): r for r in report["rows"]}
    width = 0.27
    for i, (label, get) in enumerate([("baseline peak", lambda p, s: rows[p, s, False]["baseline_peak_gib"]),
                                      ("Phase B, no offload", lambda p, s: rows[p, s, False]["phase_b_peak_gib"]),
                                      ("Phase B, offload", lambda p, s: rows[p, s, True]["phase_b_peak_gib"])]):
        left.bar([x + (i - 1) * width for x in range(len(splits))], [get(p, s) for p, s in splits], width, label=label)
    left.set_xticks(range(len(splits)), [f"{p}/{s}" for p, s in splits])
    left.set_ylabel("peak allocated GiB")
    left.set_title(f"fixed total, N={report['config']['n']}")
    left.legend(fontsize=7)
    search = report.get("frontier") or {}
    right.bar(list(search), [s["longest_trains"] for s in search.values()], color=["gray", "tab:blue", "tab:green"])
    right.set_ylabel("longest total length that trains")
    right.set_title(f"frontier ({report['config']['frontier_cap_gib']} GiB cap)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--total", type=int, default=12288)
    parser.add_argument("--splits", default="10240/2048,8192/4096,6144/6144,4096/8192,2048/10240")
    parser.add_argument("--timed-split", default="10240/2048")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--wave", type=int, default=1, help="rows per forward, baseline and PrefixFlow alike")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds at --timed-split")
    parser.add_argument("--repeats-other", type=int, default=1, help="timed steps at the other splits")
    parser.add_argument("--frontier-split", default="10240/2048", help="the prefix ratio of the frontier search")
    parser.add_argument("--frontier-n", type=int, default=2)
    parser.add_argument("--frontier-cap-gib", type=float, default=24.0)
    parser.add_argument("--frontier-start", type=int, default=4096)
    parser.add_argument("--frontier-resolution", type=int, default=512)
    parser.add_argument("--frontier-max", type=int, default=131072)
    parser.add_argument("--frontier-mode-s", type=float, default=70.0, help="time cap per mode's search")
    parser.add_argument("--host-budget-gib", type=float, default=48.0, help="largest pinned pool a trial may need")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="no new step starts after this")
    parser.add_argument("--sections", default="fixed,frontier,long")
    parser.add_argument("--checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--prefix-recompute", type=float, default=RECOMPUTE_SHARE,
                        help="share of prefix layers Phase C recomputes instead of copying back (offload mode)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, tiny lengths, simulated OOM")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_memory")
    args = parser.parse_args()
    if args.tiny:
        args.model = "tiny"
        vars(args).update(TINY_ARGS)
    sections = set(args.sections.split(","))

    bench = Bench(args)
    out = pathlib.Path(args.out)
    device = "CPU (--tiny: no memory statistics)" if args.tiny else torch.cuda.get_device_name()
    report = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "command": "python benchmarks/memory.py "
                         + ("--tiny" if args.tiny else f"--sections {args.sections} --splits {args.splits} "
                            f"--prefix-recompute {args.prefix_recompute}" + " --compile" * args.compile),
                         "device": device,
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         "date": datetime.date.today().isoformat(), "static_gib": round(bench.static_gib(), 3),
                         "dtype": str(next(bench.model.parameters()).dtype).removeprefix("torch.")},
              "rows": [], "frontier": None, "long_prefix": None}
    bench.log(f"model {args.model} built on {device}, static {report['config']['static_gib']} GiB")
    if "fixed" in sections:
        report["rows"] = fixed_total(bench)
        write(report, out)
    if "frontier" in sections:
        if not args.tiny:
            torch.cuda.empty_cache()  # the cap limits what the allocator may hold, cached blocks included
            torch.cuda.set_per_process_memory_fraction(
                args.frontier_cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
        report["frontier"] = frontier(bench)
        write(report, out)
        if "long" in sections:
            report["long_prefix"] = long_prefix(bench, report["frontier"])
            write(report, out)
    if not args.tiny:
        report["config"]["pinned_peak_gib"] = round(torch.cuda.host_memory_stats()["allocated_bytes.peak"] / GIB, 2)
        write(report, out)
    bench.log(f"done: {json.dumps(report.get('verdicts'))}")


if __name__ == "__main__":
    main()
