"""Memory like for like on one GPU: full-sequence training (the baseline) against PrefixFlow under the same
activation-checkpointing policy and the same rows per microbatch, each measured peak beside `hf_prefixflow.plan`'s
estimate, and the capacity frontier both ways under a device cap.

    PYTHONPATH=benchmarks:. python benchmarks/memory.py --out benchmarks/results/<date>_memory_like_for_like
    PYTHONPATH=benchmarks:. python benchmarks/memory.py --tiny --out /tmp/mem      # CPU, every code path, seconds

Setup: one model object per shape (speed.py's `build`: random weights from the shape's config, bf16 weights and
gradients, SDPA, full-parameter) and speed.py's loss on suffix tokens; the logits are not held past the loss. Both
sides run under the same policy (`--policies`):
  none       no activation checkpointing;
  full       every decoder layer checkpointed, non-reentrant (TRL's default);
  selective  every decoder layer under torch's selective checkpointing, matrix multiplies' outputs kept.
PrefixFlow may add offload (`--offload off,on,kv`: `on` the prompt's activations, `kv` its K/V and gK/gV too,
streamed per layer). Recompute beyond the policy is named in each row (`extra_recompute`): under `none`, offload
checkpoints `--prefix-recompute` of the prompt's layers for Phase C to recompute. `--scoring` is how both sides score
completion tokens: `fused` through TRL's fused LM head, as GRPOTrainer trains (log-probabilities in tiles, no
logits tensor), or `logits` through the model's logits and a cross-entropy (12 bytes per logit at the loss).
A *step* is one group, no optimizer step, the gradients allocated and zeroed before it (as inside an accumulation
window): the baseline trains N rows [P || S_i], `--rows` per forward; PrefixFlow runs Phase A, N/rows waves of
`--rows` completions and Phase C. Peaks are torch.cuda.max_memory_allocated, weights and gradients included; the
Phase-B peak is the statistic reset when Phase A returns and read before Phase C.

 1. fixed: the splits of `--splits` at N=`--n`; per split and policy a warm-up step per side on `--warmup-rows`
    completions, then `--repeats` interleaved rounds (`--repeats-other` away from `--timed-split`) of one step per
    side (time: median; peaks: the highest). Every row has the planner's estimates and their error.
 2. frontier: under a device cap of `--frontier-cap-gib` (set_per_process_memory_fraction), per policy and side the
    longest trainable P + S at the proportions of `--frontier-proportions` and the longest P with S =
    `--frontier-suffix`: a bracket seeded at the planner's prediction (steps of an eighth of it, doubling, until one
    length trains and one fails), then bisection to `--frontier-resolution` (the baseline's: `--frontier-baseline-
    resolution`, finer where its frontier is short). A trial allocates the gradients and runs
    one microbatch of `--rows` rows (the baseline: each further one repeats its peak) or two waves (PrefixFlow: the
    second holds gK/gV); out-of-memory fails it. An offload trial whose pinned pool would exceed `--host-budget-gib`
    fails without running. `--frontier-search-s` caps each search.
No new step starts after `--deadline-s`; memory_like_for_like.json and .md (and a generated `MANIFEST.md`,
`harness.RunFolder`) are rewritten after every row, search and frontier trial (`trials` lists each trial as it ends).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import pathlib
import statistics
import time
from typing import Callable

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM

import harness
import hf_prefixflow
from hf_prefixflow.planning import planner
from hf_prefixflow.core.access import config_of, unwrap
from hf_prefixflow.config import RECOMPUTE_SHARE
from hf_prefixflow.core.scheduler import host_pool
from speed import SHAPES, build, suffix_loss

GIB = 2**30
POLICIES = ("none", "full", "selective")
# Device bytes per scored position and vocabulary entry at the loss: TRL's fused head keeps no logits tensor (its
# tile is a constant); a cross-entropy on fp32 logits keeps 12.
LOSS_BYTES = {"fused": 0.0, "logits": planner.LOSS_BYTES_PER_LOGIT}
SAVED_OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
TARGETS = {"phase_b_reduction_none": 0.59, "frontier_ratio_none": 1.66, "frontier_ratio_full": 1.66,
           "plan_phase_b_error": 0.10}
TINY_SHAPE = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)
TINY_ARGS = dict(models="tiny", splits="80/16,64/32,48/48,32/64,16/80", timed_split="80/16", n=4, warmup_rows=2,
                 policies="none,full,selective", frontier_proportions="80/16", frontier_suffix=16,
                 frontier_resolution=16, frontier_max=1024, frontier_cap_gib=0.0035, tiny_oom_tokens=200)


class Bench:
    """The model under test, its device, the arguments, and the wall-clock deadline."""

    def __init__(self, args: argparse.Namespace, run: harness.RunFolder):
        self.args, self.run = args, run
        self.device = torch.device("cpu" if args.tiny else "cuda")
        missing = [name for name, owner in (("host_memory_stats", torch.cuda), ("_host_emptyCache", torch._C))
                   if not args.tiny and not hasattr(owner, name)]
        if missing:
            raise SystemExit(f"this torch lacks {missing}, which bound the pinned host pool between steps")
        self.started = time.monotonic()
        self.deadline = self.started + args.deadline_s
        self.model: torch.nn.Module | None = None
        self.name = ""
        self.trial_total = 0  # --tiny: the length the next step runs at, for the simulated out-of-memory
        self.phase_ms: dict[str, float] = {}  # the last step's milliseconds per phase (CUDA only)
        self.host_bytes_per_token = 0.0  # offload: pool bytes per cached prompt token, measured by the steps
        self.host_peak_bytes = 0  # the most any offload pool held
        self.report: dict = {}  # what `write` puts on file

    def load(self, name: str) -> None:
        """Build the model of shape `name` (dropping the previous one)."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.name = name
        self.model = build_tiny() if self.args.tiny else build(name)
        if self.args.scoring == "fused":
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(unwrap(self.model))
            unwrap(self.model)._memory_fused_head = True
        self.host_bytes_per_token = 0.0
        if self.args.tiny:
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
        vocab = self.model.config.vocab_size
        prompt = torch.randint(0, vocab, (prefix,), device=self.device, generator=gen)
        return prompt, list(torch.randint(0, vocab, (n, suffix), device=self.device, generator=gen))

    def static_gib(self) -> float:
        """Weights plus their gradients."""
        return 2 * sum(p.numel() * p.element_size() for p in self.model.parameters()) / GIB

    def configure(self, policy: str, offload: str) -> float:
        """Set the checkpointing policy (both sides) and PrefixFlow's offload mode ("off", "on" or "kv"); returns
        the prompt's recompute share beyond the policy (0 when there is none)."""
        set_policy(self.model, policy)
        share = self.args.prefix_recompute if offload != "off" and policy == "none" else 0.0
        hf_prefixflow.apply_prefixflow(self.model, hf_prefixflow.PrefixFlowConfig(
            offload=offload != "off", offload_kv=offload == "kv", prefix_recompute=share))
        return share

    def estimate(self, policy: str, offload: str, share: float, prefix: int, suffix: int,
                 n: int) -> planner.MemoryPlan:
        """The planner's estimate for exactly what runs (no knob left to choose)."""
        rows = self.args.rows
        return planner.plan(self.model, prefix, suffix, n, float("inf"), policy, rows_per_microbatch=rows,
                            wave_size=rows, offload=offload != "off", offload_kv=offload == "kv",
                            suffix_checkpointing=True, prefix_recompute=share,
                            loss_bytes_per_logit=LOSS_BYTES[self.args.scoring])


def build_tiny() -> torch.nn.Module:
    spec = dict(TINY_SHAPE)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=4096, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return hf_prefixflow.apply_prefixflow(model.train())


def set_policy(model: torch.nn.Module, policy: str) -> None:
    """transformers' per-layer checkpointing for `policy` (`activation_checkpointing_*` from 5.24 on,
    `gradient_checkpointing_*` before); selective: torch's selective checkpoint contexts keeping `SAVED_OPS`."""
    inner = unwrap(model)
    new_names = hasattr(inner, "activation_checkpointing_enable")
    if policy == "none":
        (inner.activation_checkpointing_disable if new_names else inner.gradient_checkpointing_disable)()
        return
    kwargs: dict[str, object] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, SAVED_OPS)
    if new_names:
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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


def fused(model: torch.nn.Module) -> bool:
    """Whether `model` scores through TRL's fused LM head (`--scoring fused`)."""
    return getattr(unwrap(model), "_memory_fused_head", False)


def mode_of(row: dict) -> str:
    """A row's offload mode: off, on (the prompt's activations) or kv (its K/V and gK/gV too)."""
    return "kv" if row.get("offload_kv") else "on" if row["offload"] else "off"


def baseline_step(model, prompt, suffixes, rows: int, mark: Callable[[str | None], None]) -> None:
    for start in range(0, len(suffixes), rows):
        batch = torch.stack(suffixes[start : start + rows])
        ids = torch.cat([prompt.expand(len(batch), -1), batch], dim=1)
        if fused(model):  # position t scores token t + 1: the completion's tokens only
            labels = torch.full_like(ids, -100)
            labels[:, len(prompt) - 1 : -1] = batch
            loss = model(input_ids=ids, shift_labels=labels, fused_lm_head=True).loss
        else:  # the logits live only inside the loss, as in PrefixFlow's waves
            loss = suffix_loss(model(ids, logits_to_keep=batch.shape[1] + 1, use_cache=False).logits[:, :-1], batch)
        loss.backward()
    mark("step")


def prefixflow_step(model, prompt, suffixes, rows: int, mark: Callable[[str | None], None]) -> None:
    with hf_prefixflow.prefix_group(model, prompt) as group:
        mark("A")
        for start in range(0, len(suffixes), rows):
            batch = torch.stack(suffixes[start : start + rows])
            if fused(model):
                group(batch, shift_labels=batch, fused_lm_head=True).loss.backward()
            else:
                suffix_loss(group(batch).logits, batch).backward()
        mark("B")
    mark("C")


def allocate_gradients(model: torch.nn.Module) -> None:
    """Every trainable parameter's gradient allocated and zero, as inside an accumulation window."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def run_step(bench: Bench, side: str, prompt, suffixes, rows: int) -> tuple[float, dict[str, float]]:
    """One step of `side` ("baseline" or "prefixflow"; configured beforehand); its seconds (synchronised at both
    ends only) and its peaks per phase."""
    model = bench.model
    allocate_gradients(model)
    bench.trial_total = len(prompt) + len(suffixes[0])
    peaks = PhasePeaks(bench.device)
    bench.sync()
    peaks.mark(None)
    start = time.perf_counter()
    (baseline_step if side == "baseline" else prefixflow_step)(model, prompt, suffixes, rows, peaks.mark)
    bench.sync()
    seconds = time.perf_counter() - start
    bench.phase_ms = peaks.ms()
    if side == "prefixflow" and config_of(model).offload:
        bench.host_bytes_per_token = max(bench.host_bytes_per_token, host_pool_bytes(bench) / (len(prompt) - 1))
    return seconds, peaks.gib


def host_pool_bytes(bench: Bench) -> int:
    """Host bytes behind the model's offload pool (also recorded in the run's host peak)."""
    pool = host_pool(bench.model)
    if pool is None:
        return 0
    bench.host_peak_bytes = max(bench.host_peak_bytes, pool.peak_bytes)
    return pool.allocated_bytes


def fresh_host_pool(bench: Bench) -> None:
    """Free the model's offload pool: its buffers go back to the host."""
    if host_pool(bench.model) is not None:
        host_pool_bytes(bench)
        host_pool(bench.model).close()
    if bench.device.type == "cuda":
        gc.collect()  # buffers a reference cycle still holds


def pinned_bytes() -> int:
    """Pinned host bytes torch's host allocator owns, cached blocks included (the pool's fallback)."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def make_room_on_host(bench: Bench, need: float) -> None:
    """Return cached pinned blocks to the driver when they and the next offload step would exceed the host
    budget (keeping them otherwise saves pinning again for nearby lengths)."""
    if bench.device.type == "cuda" and pinned_bytes() + need > bench.args.host_budget_gib * GIB:
        torch._C._host_emptyCache()


def cleanup(bench: Bench) -> None:
    fresh_host_pool(bench)
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def gib(value: float) -> float:
    return round(value / GIB, 3)


# -- 1. fixed shapes -------------------------------------------------------------------------------------------

def fixed(bench: Bench, report: dict) -> None:
    args = bench.args
    offloads = args.offload.split(",")
    for split in args.splits.split(","):
        prefix, suffix = map(int, split.split("/"))
        prompt, suffixes = bench.group(prefix, suffix, args.n)
        warm = suffixes[:max(args.warmup_rows, args.rows)]
        repeats = args.repeats if split == args.timed_split else args.repeats_other
        for policy in args.policies.split(","):
            if bench.past_deadline():
                bench.log(f"deadline: fixed section stops before {split} {policy}")
                return
            cleanup(bench)
            make_room_on_host(bench, bench.host_bytes_per_token * 1.1 * prefix)
            sides = [("baseline", "off")] + [("prefixflow", off) for off in offloads]
            errors: dict[tuple[str, str], str] = {}
            for side, off in sides:  # warm-up
                bench.configure(policy, off)
                try:
                    run_step(bench, side, prompt, warm, args.rows)
                except Exception as error:  # recorded in the row (out of memory, a policy the library refuses)
                    errors[side, off] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                    bench.log(f"{bench.name} {split} {policy} {side} offload={off}: {errors[side, off]}")
                if (side, off) in errors:  # outside the handler, whose traceback holds the failed step's tensors
                    cleanup(bench)
            steps: dict[tuple[str, str], list] = {key: [] for key in sides if key not in errors}
            phases: dict[tuple[str, str], list] = {key: [] for key in steps}
            pools: dict[str, float] = {}
            for _ in range(repeats):  # interleaved, so that a drift in the machine's speed meets every side alike
                for side, off in steps:
                    bench.configure(policy, off)
                    steps[side, off].append(run_step(bench, side, prompt, suffixes, args.rows))
                    phases[side, off].append(bench.phase_ms)
                    if side == "prefixflow":
                        pools[off] = host_pool_bytes(bench)
            rows = fixed_rows(bench, policy, prefix, suffix, steps, phases, pools, errors)
            report["rows"] += rows
            for row in rows:
                keys = ("model", "P", "S", "policy", "offload", "baseline_peak_gib", "prefixflow_phase_b_peak_gib",
                        "plan_phase_b_peak_gib", "baseline_time_s", "prefixflow_time_s", "error")
                bench.log(json.dumps({k: row.get(k) for k in keys}))
            write(report, bench.run)


def fixed_rows(bench: Bench, policy: str, prefix: int, suffix: int, steps: dict, phases: dict, pools: dict,
               errors: dict) -> list[dict]:
    args = bench.args
    base = steps.get(("baseline", "off"))
    base_s = statistics.median(s for s, _ in base) if base else None
    base_peak = max(p["step"] for _, p in base) if base else None
    rows = []
    for off in args.offload.split(","):
        share = bench.configure(policy, off)
        estimate = bench.estimate(policy, off, share, prefix, suffix, args.n)
        runs = steps.get(("prefixflow", off))
        row = {"model": bench.name, "P": prefix, "S": suffix, "N": args.n, "rows": args.rows, "policy": policy,
               "offload": off != "off", "offload_kv": off == "kv", "scoring": args.scoring,
               "extra_recompute": estimate.extra_recompute,
               "baseline_peak_gib": None if base_peak is None else round(base_peak, 3),
               "plan_baseline_peak_gib": gib(estimate.baseline_peak_bytes),
               "plan_phase_a_peak_gib": gib(estimate.phase_a_peak_bytes),
               "plan_phase_b_peak_gib": gib(estimate.phase_b_peak_bytes),
               "plan_phase_c_peak_gib": gib(estimate.phase_c_peak_bytes),
               "plan_breakdown_gib": {k: gib(v) for k, v in estimate.breakdown.items()},
               "plan_host_gib": gib(estimate.host_bytes),
               "baseline_time_s": None if base_s is None else round(base_s, 4),
               "baseline_times_s": [round(s, 4) for s, _ in base or []],
               "baseline_phase_ms": median_phases(phases.get(("baseline", "off"))),
               "static_gib": round(bench.static_gib(), 3), "repeats": len(runs or []),
               "error": errors.get(("prefixflow", off)) or errors.get(("baseline", "off")),
               "gpu": bench.args.gpu, "commit": bench.args.commit}
        if runs:
            seconds = statistics.median(s for s, _ in runs)
            peak = {phase: max(p[phase] for _, p in runs) for phase in ("A", "B", "C")}
            row.update({
                "prefixflow_phase_a_peak_gib": round(peak["A"], 3), "prefixflow_phase_b_peak_gib": round(peak["B"], 3),
                "prefixflow_phase_c_peak_gib": round(peak["C"], 3), "prefixflow_time_s": round(seconds, 4),
                "prefixflow_times_s": [round(s, 4) for s, _ in runs],
                "prefixflow_phase_ms": median_phases(phases[("prefixflow", off)]),
                "time_ratio": round(seconds / base_s, 4) if base_s else None,
                "host_pool_gib": gib(pools.get(off, 0))})
            if bench.device.type == "cuda":
                row["plan_phase_b_error"] = round(peak["B"] / row["plan_phase_b_peak_gib"] - 1, 4)
                if base_peak is not None:
                    row["plan_baseline_error"] = round(base_peak / row["plan_baseline_peak_gib"] - 1, 4)
                    row["phase_b_reduction"] = round(1 - peak["B"] / base_peak, 4)
        if args.tiny and not row["error"]:
            row["max_gradient_difference"] = gradient_difference(bench, policy, off, prefix, suffix)
        if (args.tiny or args.check_gradients) and off == "kv" and not row["error"]:
            # the arithmetic of offload "on", only the K/V's home differs: equal bit for bit where the kernels are
            # deterministic; on a GPU the attention backwards accumulate with atomics, so "on" against itself is
            # the floor to read it against
            row["kv_vs_on_max_difference"] = gradient_difference(bench, policy, off, prefix, suffix, "on")
            row["on_vs_on_max_difference"] = gradient_difference(bench, policy, "on", prefix, suffix, "on")
        rows.append(row)
    return rows


def median_phases(runs: list[dict] | None) -> dict[str, float]:
    if not runs or not runs[0]:
        return {}
    return {phase: round(statistics.median(r[phase] for r in runs), 1) for phase in runs[0]}


def gradient_difference(bench: Bench, policy: str, offload: str, prefix: int, suffix: int,
                        against: str | None = None) -> float:
    """The largest gradient difference of PrefixFlow (offload mode `offload`) against the baseline, or against
    PrefixFlow in mode `against`, relative to each parameter's largest gradient (--tiny: fp32, so about 1e-6 when
    both train the same; on the GPU against the baseline, bf16 rounding of two schedules)."""
    prompt, suffixes = bench.group(prefix, suffix, bench.args.n, seed=1)
    grads = {}
    for side, mode in (("baseline" if against is None else "prefixflow", against or offload),
                       ("prefixflow", offload)):
        bench.configure(policy, mode)
        bench.trial_total = 0
        bench.model.zero_grad(set_to_none=True)
        (baseline_step if side == "baseline" else prefixflow_step)(bench.model, prompt, suffixes, bench.args.rows,
                                                                    lambda phase: None)
        grads[len(grads)] = [p.grad.clone() for p in bench.model.parameters()]
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(grads[1], grads[0]))


# -- 2. capacity frontier ----------------------------------------------------------------------------------------

def bracket(trains: Callable[[int], tuple[bool, str]], seed: int, resolution: int, maximum: int, stop_at: float,
            log: Callable[[str], None]) -> dict:
    """Longest length (a multiple of `resolution`) that trains: from `seed`, steps of an eighth of it that double
    until one length trains and a longer one fails, then bisection down to `resolution`."""
    trials: list[dict] = []
    longest, failed, stop = 0, None, "resolution"

    def attempt(total: int) -> bool:
        began = time.monotonic()
        ok, reason = trains(total)
        trials.append({"total": total, "trains": ok, "reason": reason, "seconds": round(time.monotonic() - began, 2)})
        log(f"  {total}: {reason} ({trials[-1]['seconds']} s)")
        return ok

    total = min(max(seed // resolution * resolution, resolution), maximum // resolution * resolution)
    step = max(resolution, seed // 8 // resolution * resolution)
    if attempt(total):
        longest = total
        while failed is None:
            total = min(longest + step, maximum // resolution * resolution)
            if total <= longest or time.monotonic() > stop_at:
                stop = "maximum" if total <= longest else "time cap"
                break
            if attempt(total):
                longest, step = total, step * 2
            else:
                failed = total
    else:
        failed = total
        while not longest:
            if failed <= resolution or time.monotonic() > stop_at:
                stop = "nothing trains" if failed <= resolution else "time cap"
                break
            total = max(resolution, failed - step)
            if attempt(total):
                longest = total
            else:
                failed, step = total, step * 2
    while failed is not None and longest and failed - longest > resolution:
        if time.monotonic() > stop_at:
            stop = "time cap"
            break
        middle = longest + (failed - longest) // resolution // 2 * resolution
        if attempt(middle):
            longest = middle
        else:
            failed = middle
    return {"longest_trains": longest, "shortest_fails": failed, "stop": stop, "trials": trials}


def trial(bench: Bench, side: str, policy: str, offload: str, prefix: int, suffix: int) -> tuple[bool, str]:
    """Does one step of `side` train at this size? Out-of-memory is caught and everything it held is freed; another
    error fails the trial with its message."""
    args = bench.args
    if prefix < 2 or suffix < 1:
        return False, "too short"
    share = bench.configure(policy, offload if side == "prefixflow" else "off")
    if side == "prefixflow" and offload != "off":
        # the pool: as measured per token by earlier steps, else the planner's
        need = 1.1 * (bench.host_bytes_per_token * prefix if bench.host_bytes_per_token
                      else bench.estimate(policy, offload, share, prefix, suffix, 2).host_bytes)
        if need > args.host_budget_gib * GIB:
            return False, f"host budget (pinned pool predicted > {args.host_budget_gib} GiB)"
        make_room_on_host(bench, need)
    count = args.rows * (2 if side == "prefixflow" else 1)
    prompt, suffixes = bench.group(prefix, suffix, count)
    try:
        run_step(bench, side, prompt, suffixes, args.rows)
        outcome = (True, "trains")
    except torch.cuda.OutOfMemoryError:
        outcome = (False, "out of memory")
    except RuntimeError as error:  # e.g. a kernel refusing a length: the search stops below it, and says why
        outcome = (False, f"error: {str(error).splitlines()[0][:200]}")
    cleanup(bench)  # outside the handlers: the traceback, and the tensors its frames hold, are gone by now
    return outcome


def search_shape(search: dict, total: int) -> tuple[int, int]:
    """(P, S) of a trial of `search` at length `total` (P + S, or P with the suffix fixed)."""
    if search["kind"] == "prompt":
        return total, search["S"]
    prefix = round(total * search["P"] / (search["P"] + search["S"]))
    return prefix, total - prefix


def frontier(bench: Bench, report: dict) -> None:
    args = bench.args
    cap = args.frontier_cap_gib * GIB
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()  # the cap limits what the allocator may hold, cached blocks included
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    searches = [{"kind": "proportional", "P": p, "S": s}
                for p, s in (map(int, x.split("/")) for x in args.frontier_proportions.split(",") if x)]
    if args.frontier_suffix:
        searches.append({"kind": "prompt", "P": 10 * args.frontier_suffix, "S": args.frontier_suffix})
    offloads = args.offload.split(",")
    for search in searches:
        for policy in args.policies.split(","):
            baseline = None
            for off in offloads:
                if bench.past_deadline():
                    bench.log("deadline: frontier section stops")
                    return
                share = bench.configure(policy, off)
                proportions = f"S={search['S']}" if search["kind"] == "prompt" else f"{search['P']}/{search['S']}"
                row = {"model": bench.name, "search": search["kind"], "proportions": proportions,
                       "fixed_S": search["S"] if search["kind"] == "prompt" else None, "policy": policy,
                       "offload": off != "off", "offload_kv": off == "kv", "scoring": args.scoring,
                       "extra_recompute": bench.estimate(policy, off, share, 16, 16, 2).extra_recompute,
                       "rows": args.rows, "cap_gib": args.frontier_cap_gib, "resolution": args.frontier_resolution,
                       "baseline_resolution": resolution(args, "baseline"), "gpu": args.gpu, "commit": args.commit}
                if baseline is None:
                    baseline = run_search(bench, search, policy, "off", "baseline", cap)
                result = run_search(bench, search, policy, off, "prefixflow", cap)
                errors = [t["reason"] for s in (baseline, result) for t in s["trials"]
                          if t["reason"].startswith("error") and s["longest_trains"] == 0]
                measured = baseline["longest_trains"] and result["longest_trains"] or not errors
                row.update({"baseline_frontier_tokens": baseline["longest_trains"],
                            "prefixflow_frontier_tokens": result["longest_trains"],
                            "frontier_ratio": round(result["longest_trains"] / baseline["longest_trains"], 3)
                            if baseline["longest_trains"] and measured else None,
                            "error": errors[0] if errors else None,
                            "plan_baseline_frontier_tokens": baseline["predicted"],
                            "plan_prefixflow_frontier_tokens": result["predicted"],
                            "baseline_search": baseline, "prefixflow_search": result})
                report["frontier"].append(row)
                bench.log(f"frontier {search['kind']} {policy} offload={off}: baseline {baseline['longest_trains']} "
                          f"(plan {baseline['predicted']}), PrefixFlow {result['longest_trains']} "
                          f"(plan {result['predicted']})")
                write(report, bench.run)


def resolution(args: argparse.Namespace, side: str) -> int:
    """Tokens the search of `side` resolves."""
    return args.frontier_baseline_resolution if side == "baseline" and args.frontier_baseline_resolution \
        else args.frontier_resolution


def run_search(bench: Bench, search: dict, policy: str, offload: str, side: str, cap: float) -> dict:
    args = bench.args
    step = resolution(args, side)
    share = bench.configure(policy, offload)
    rows = args.rows
    knobs = dict(rows_per_microbatch=rows, wave_size=rows, offload=offload != "off", offload_kv=offload == "kv",
                 suffix_checkpointing=True, prefix_recompute=share, loss_bytes_per_logit=LOSS_BYTES[args.scoring])
    predicted = planner.longest(bench.model, search["P"], search["S"], 2 * rows, cap, policy,
                                vary="prompt" if search["kind"] == "prompt" else "both", side=side,
                                resolution=step, maximum=args.frontier_max, **knobs)
    bench.log(f"frontier {search['kind']} {policy} {side} offload={offload}: planner predicts {predicted}")
    stop_at = min(bench.deadline, time.monotonic() + args.frontier_search_s)

    def trains(total: int) -> tuple[bool, str]:
        outcome = trial(bench, side, policy, offload, *search_shape(search, total))
        # every trial on file at once: a run cut short (its command's time limit) keeps what it measured
        bench.report.setdefault("trials", []).append(
            {"model": bench.name, "search": search["kind"], "P": search["P"], "S": search["S"], "policy": policy,
             "side": side, "offload": offload, "total": total, "trains": outcome[0], "reason": outcome[1]})
        write(bench.report, bench.run)
        return outcome

    result = bracket(trains, predicted or step, step, args.frontier_max, stop_at, bench.log)
    result["predicted"] = predicted
    return result


# -- report ------------------------------------------------------------------------------------------------------

def verdicts(report: dict) -> dict:
    """Each target against what was measured (absent where the measurement is missing)."""
    out: dict[str, object] = {}
    timed = tuple(map(int, report["config"]["timed_split"].split("/")))
    for row in report["rows"]:
        if (row["P"], row["S"]) == timed and row["policy"] == "none" and row["offload"] and \
                row.get("phase_b_reduction") is not None:
            out[f"phase_b_reduction_none[{row['model']}]"] = row["phase_b_reduction"]
    pairs: dict[str, bool] = {}
    for row in report["rows"]:
        if row.get("prefixflow_phase_b_peak_gib") is not None and row["baseline_peak_gib"]:
            key = f"never_above_baseline[{row['model']},{row['policy']},offload={mode_of(row)}]"
            pairs[key] = pairs.get(key, True) and row["prefixflow_phase_b_peak_gib"] <= row["baseline_peak_gib"]
    out.update(pairs)
    streamed = [r["kv_vs_on_max_difference"] for r in report["rows"] if r.get("kv_vs_on_max_difference") is not None]
    if streamed:
        out["kv_vs_on_max_difference"] = max(streamed)
        out["on_vs_on_max_difference"] = max(r["on_vs_on_max_difference"] for r in report["rows"]
                                             if r.get("on_vs_on_max_difference") is not None)
    errors = [abs(r["plan_phase_b_error"]) for r in report["rows"] if r.get("plan_phase_b_error") is not None]
    if errors:
        out["plan_phase_b_error"] = round(max(errors), 4)
    for row in report["frontier"]:
        if row["frontier_ratio"] is not None:
            kind = "frontier_ratio" if row["search"] == "proportional" else "prompt_frontier_ratio"
            key = f"{kind}_{row['policy']}[{row['model']},{row['proportions']},offload={mode_of(row)}]"
            out[key] = row["frontier_ratio"]
    return out


def write(report: dict, run: harness.RunFolder) -> None:
    report["verdicts"] = verdicts(report)
    run.write(report, markdown(report))


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> list[str]:
    """The report's tables (the run folder's header line names the command and the environment)."""
    c = report["config"]
    measured = [f"Measured by `{c['command'].split('; replanned')[0]}` on {c['gpu']}, torch {c['torch']}, "
                f"transformers {c['transformers']}, {c['date']}, commit {c['commit']}; the plan replanned here.", ""]
    lines = measured * ("; replanned" in c["command"]) + [
             "Like for like: each row pairs PrefixFlow with the baseline under the same checkpointing policy and the "
             f"same rows per microbatch ({c['rows']}); {c['dtype']} weights and gradients, no optimizer step, "
             "gradients allocated before each step. `extra_recompute` is recompute beyond the policy. Peaks in GiB, "
             "weights and gradients included; `plan` is `hf_prefixflow.plan`'s estimate, err = measured / plan - 1. "
             "time ratio = PrefixFlow step / baseline step (median of the timed rounds).", "",
             "| model | P / S | N | policy | offload | extra recompute | baseline (plan) | Phase B (plan, err) | "
             "A / C (plan) | reduction | baseline s | PrefixFlow s | time ratio |",
             "| --- " * 13 + "|"]
    for r in report["rows"]:
        if r.get("error") and r.get("prefixflow_phase_b_peak_gib") is None:
            lines.append(f"| {r['model']} | {r['P']} / {r['S']} | {r['N']} | {r['policy']} | "
                         f"{mode_of(r)} | {r['extra_recompute']} | error: {r['error'][:120]} |"
                         + " |" * 6)
            continue
        err = r.get("plan_phase_b_error")
        lines.append(
            f"| {r['model']} | {r['P']} / {r['S']} | {r['N']} | {r['policy']} | {mode_of(r)} | "
            f"{r['extra_recompute']} | {_num(r['baseline_peak_gib'])} ({_num(r['plan_baseline_peak_gib'])}) | "
            f"{_num(r['prefixflow_phase_b_peak_gib'])} ({_num(r['plan_phase_b_peak_gib'])}, "
            f"{'-' if err is None else f'{err:+.1%}'}) | {_num(r['prefixflow_phase_a_peak_gib'])} / "
            f"{_num(r['prefixflow_phase_c_peak_gib'])} ({_num(r['plan_phase_a_peak_gib'])} / "
            f"{_num(r['plan_phase_c_peak_gib'])}) | "
            f"{'-' if r.get('phase_b_reduction') is None else format(r['phase_b_reduction'], '.0%')} | "
            f"{_num(r['baseline_time_s'], 3)} | {_num(r['prefixflow_time_s'], 3)} | {_num(r['time_ratio'], 3)} |")
    if report["frontier"]:
        lines += ["", f"Frontier under a {c['frontier_cap_gib']} GiB device cap, {c['rows']} row(s) per microbatch, "
                  f"resolution {c['frontier_resolution']} tokens"
                  + (f" ({c['frontier_baseline_resolution']} for the baseline)" if c.get("frontier_baseline_resolution")
                     else "") + ": `proportional` is the longest P + S at the given "
                  "proportions, `prompt` the longest P with S fixed; in brackets the planner's prediction.", "",
                  "| model | search | policy | offload | extra recompute | baseline tokens | PrefixFlow tokens | "
                  "frontier ratio | stopped by (baseline / PrefixFlow) |", "| --- " * 9 + "|"]
        for r in report["frontier"]:
            kind = (f"prompt, S = {r['fixed_S']}" if r["search"] == "prompt" else
                    f"proportional {r['proportions']}")
            lines.append(
                f"| {r['model']} | {kind} | {r['policy']} | {mode_of(r)} | "
                f"{r['extra_recompute']} | {r['baseline_frontier_tokens']} ({r['plan_baseline_frontier_tokens']}) | "
                f"{r['prefixflow_frontier_tokens']} ({r['plan_prefixflow_frontier_tokens']}) | "
                f"{_num(r['frontier_ratio'], 2)} | {r['baseline_search']['stop']} / {r['prefixflow_search']['stop']}"
                + (f"; {r['error'][:120]}" if r.get("error") else "") + " |")
    lines += ["", "| target | goal | measured |", "| --- | --- | --- |"]
    for key, value in report["verdicts"].items():
        name = key.split("[")[0]
        goal = {"plan_phase_b_error": f"<= {TARGETS['plan_phase_b_error']}", "never_above_baseline": "true",
                "kv_vs_on_max_difference": "0 (CPU); the on_vs_on floor (GPU)"}.get(
            name, f">= {TARGETS[name]}" if name in TARGETS else "(context)")
        lines.append(f"| {key} | {goal} | {value} |")
    return lines


def replan(path: pathlib.Path) -> None:
    """`--replan RUN.json`: the planner's estimates at this commit for a run's fixed rows, beside the peaks measured
    there (`plan_*` and `*_error` fields replaced), written to RUN_replanned.json and .md."""
    report = json.loads(path.read_text())
    for row in report["rows"]:
        spec = dict(SHAPES[row["model"]])
        config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=32768, **spec)
        share = RECOMPUTE_SHARE if row["offload"] and row["policy"] == "none" else 0.0
        estimate = planner.plan(config, row["P"], row["S"], row["N"], float("inf"), row["policy"],
                                rows_per_microbatch=row["rows"], wave_size=row["rows"], offload=row["offload"],
                                offload_kv=row.get("offload_kv", False), suffix_checkpointing=True,
                                prefix_recompute=share, dtype=torch.bfloat16,
                                loss_bytes_per_logit=LOSS_BYTES[row.get("scoring", "logits")],
                                scoring="logits" if row.get("scoring", "logits") == "logits" else "fused")
        row.update({"plan_baseline_peak_gib": gib(estimate.baseline_peak_bytes),
                    "plan_phase_a_peak_gib": gib(estimate.phase_a_peak_bytes),
                    "plan_phase_b_peak_gib": gib(estimate.phase_b_peak_bytes),
                    "plan_phase_c_peak_gib": gib(estimate.phase_c_peak_bytes),
                    "plan_host_gib": gib(estimate.host_bytes), "replanned_at": harness.git_commit()})
        if row.get("prefixflow_phase_b_peak_gib") is not None:
            row["plan_phase_b_error"] = round(row["prefixflow_phase_b_peak_gib"] / row["plan_phase_b_peak_gib"] - 1, 4)
        if row.get("baseline_peak_gib") is not None:
            row["plan_baseline_error"] = round(row["baseline_peak_gib"] / row["plan_baseline_peak_gib"] - 1, 4)
    run = harness.RunFolder("memory", path.parent, tag=path.stem + "_replanned")
    report["config"]["command"] += f"; replanned: {run.command}"
    write(report, run)


def split_arg(text: str) -> str:
    """A "P/S" argument, checked when parsed rather than when the report is written."""
    prefix, suffix = map(int, text.split("/"))
    return text

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-1.7b,llama3-8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--splits", default="10240/2048,8192/4096,6144/6144,4096/8192,2048/10240")
    parser.add_argument("--timed-split", default="10240/2048", type=split_arg,
                        help="P/S timed --repeats times (the others --repeats-other)")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="rows per microbatch: baseline rows and PrefixFlow wave")
    parser.add_argument("--policies", default="none,full,selective", help=f"comma-separated, of {POLICIES}")
    parser.add_argument("--offload", default="off,on,kv",
                        help="PrefixFlow's offload modes to pair with each baseline: off, on (activations), kv (and "
                             "the K/V with gK/gV)")
    parser.add_argument("--scoring", default="fused", choices=sorted(LOSS_BYTES),
                        help="fused: TRL's fused LM head (GRPOTrainer's); logits: logits and a cross-entropy")
    parser.add_argument("--check-gradients", action="store_true",
                        help="each fixed row with offload kv also compares its gradients with offload on's, and on's "
                             "with a second run of on's (the GPU's run-to-run floor)")
    parser.add_argument("--prefix-recompute", type=float, default=RECOMPUTE_SHARE,
                        help="share of prompt layers offload recomputes under the `none` policy")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds at --timed-split")
    parser.add_argument("--repeats-other", type=int, default=1, help="timed rounds at the other splits")
    parser.add_argument("--warmup-rows", type=int, default=2, help="completions of each warm-up step")
    parser.add_argument("--frontier-proportions", default="10240/2048",
                        help="P/S proportions of the total search ('': none)")
    parser.add_argument("--frontier-suffix", type=int, default=2048, help="S of the longest-prompt search (0: no such search)")
    parser.add_argument("--frontier-cap-gib", type=float, default=24.0)
    parser.add_argument("--frontier-resolution", type=int, default=512)
    parser.add_argument("--frontier-baseline-resolution", type=int, default=0,
                        help="the baseline search's resolution (0: --frontier-resolution)")
    parser.add_argument("--frontier-max", type=int, default=131072)
    parser.add_argument("--frontier-search-s", type=float, default=60.0, help="time cap of each search")
    parser.add_argument("--host-budget-gib", type=float, default=48.0, help="largest pinned pool a trial may need")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="no new step starts after this")
    parser.add_argument("--sections", default="fixed,frontier")
    parser.add_argument("--commit", default=None, help="the code's commit (default: git's, where there is a .git)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, tiny lengths, simulated OOM")
    parser.add_argument("--replan", type=pathlib.Path, default=None,
                        help="only recompute the planner's estimates for this run file's fixed rows (no GPU)")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_memory_like_for_like")
    args = parser.parse_args()
    if args.replan is not None:
        return replan(args.replan)
    run = harness.RunFolder("memory", args.out, tag="memory_like_for_like",
                            gpu="CPU (--tiny: no memory statistics)" if args.tiny else None)
    if args.tiny:
        vars(args).update(TINY_ARGS)
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and loses much on a shared CPU
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    args.commit = run.environment["commit"] = args.commit or run.environment["commit"]
    args.gpu = run.environment["gpu"]
    sections = set(args.sections.split(","))
    bench = Bench(args, run)
    report = {"config": {**run.environment, **{k: v for k, v in vars(args).items() if k != "out"},
                         "command": run.command},
              "rows": [], "frontier": []}
    bench.report = report
    for name in args.models.split(","):
        bench.load(name)
        report["config"].setdefault("static_gib", {})[name] = round(bench.static_gib(), 3)
        report["config"]["dtype"] = str(next(bench.model.parameters()).dtype).removeprefix("torch.")
        bench.log(f"model {name} built on {args.gpu}, weights + gradients {bench.static_gib():.2f} GiB")
        if "fixed" in sections:
            fixed(bench, report)
        if "frontier" in sections:
            frontier(bench, report)
            if bench.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
    if bench.device.type == "cuda":
        report["config"]["host_pool_peak_gib"] = round(bench.host_peak_bytes / GIB, 2)
        report["config"]["torch_pinned_peak_gib"] = round(
            torch.cuda.host_memory_stats()["allocated_bytes.peak"] / GIB, 2)
    write(report, run)
    bench.log(f"done: {json.dumps(report['verdicts'])}")


if __name__ == "__main__":
    main()
