"""The speed a TRL user sees: whole training steps of GRPOTrainer and PrefixFlowGRPOTrainer, side by side.

    python benchmarks/trainer_step.py --models qwen3-1.7b --ratios 0.95 --batches 4,16 --out $OUT
    python benchmarks/trainer_step.py --models qwen3-1.7b --ratios 0.95 --batches 4 --profile --out $OUT
    python benchmarks/trainer_step.py --tiny --out /tmp/trainer_step   # CPU, a tiny model, under a minute

Both trainers run in one process with a plain `GRPOConfig` (TRL's defaults but the grid's settings: bf16, beta 0,
one group of `--n` completions per optimizer step), on the same random-init model (shapes from `speed.py`, built
again with the same seed for each trainer), the same prompts of exactly P tokens, the same seed and rewards. A
step is timed from the trainer's `on_step_begin` to its `on_step_end` with `torch.cuda.synchronize()` on both sides
(`StepTimer`): generation (or fixed completions), TRL's scoring and bookkeeping, every microbatch, Phase C and the
optimizer step. Each row: the median of `--steps` steps after `--warmup`.

The grid is the product of `--models`, `--ratios` (P / (P + S) with S = `--completion`), `--batches`
(per_device_train_batch_size; gradient accumulation makes one optimizer step of each generation batch),
`--checkpointing` (on, off) and `--generation` ("fixed": `_generate_single_turn` returns fixed random completions
of S tokens; "generate": TRL's transformers generation). Per row: `flop_ratio` is `hf_prefixflow.planning.flops`'
FLOP ratio of the step's groups (Phase C included), `compute_ratio` the same with recomputation counted (the stock
trainer's checkpointed layers, PrefixFlow's recomputed prompt and, where it chose to, completions), `amdahl_cap` the
speedup if the step's non-generation part took its FLOP-ideal time (stock generation time measured around
`_generate_single_turn`). Rows go to `trainer_step.json`, `.md` and a generated `MANIFEST.md` in `--out` after each
one (`harness.RunFolder`). `--profile` runs the grid's first point once per trainer under the torch profiler
instead and writes `trainer_step_profile.json` and `.md`: per phase (record_function ranges) the wall time and the
time the GPU was busy within it (the union of kernels, copies and memsets; a low share is host-bound time), and the
operators with the most host and device time of their own.
`--memory-trace` runs the grid's first point once per trainer with the CUDA allocator's history recorded over the
step after the warm-up and writes `trainer_step_memory.json` and `.md`: each trainer's largest live set in that step
and the ten allocating frames that hold most of it (`memory_trace.peak_set`), beside the whole run's peak.
`--prefixflow-config KEY=VALUE,...` sets `PrefixFlowGRPOConfig` fields for the PrefixFlow trainer only, e.g.
`prefixflow_merge_microbatches=1` (a suffix wave per TRL microbatch) or `prefixflow_suffix_checkpointing=false`;
`--config` sets `GRPOConfig` fields for both (`torch_compile=true`: the like-for-like compiled comparison). Each row
also keeps the untimed warm-up steps' seconds (compilation shows there).

`--memory-grid`: both trainers with their default configs (a plain `GRPOConfig`, so PrefixFlow's default memory
rule, `hf_prefixflow/defaults.py`, picks how each run holds its prompt) over `MEMORY_GRID`: Qwen3-1.7B and Llama3-8B
shapes, 4,864/256 and 10,240/2,048 tokens (`--splits P/S,...`), batch 1, 4 and 16, checkpointing on and off. Each
row of `memory_grid.json` holds the memory columns (`peak_gib_stock`, `peak_gib_prefixflow`: the step's peak
allocated bytes, weights, gradients and optimizer state included; `peak_within_stock`), the speed columns (`stock_s`,
`prefixflow_s`, `speedup`), the settings each trainer ran with (`stock_settings`, `prefixflow_settings`: batch,
accumulation, checkpointing, the merge cap the rule left) and the rule's choices (`offload_modes`, `run_microbatches`,
`suffix_recomputed`); a side out of memory is listed in `out_of_memory`. The whole grid:

    python benchmarks/trainer_step.py --memory-grid --out $OUT

The grid flags narrow it, to fit a 10-minute device call (`--deadline-s` stops before a point past it):

    python benchmarks/trainer_step.py --memory-grid --models qwen3-1.7b --checkpointing on --out $OUT
    python benchmarks/trainer_step.py --memory-grid --models llama3-8b --splits 10240/2048 --checkpointing on \
        --steps 2 --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import pathlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hf_prefixflow import (PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer, PrefixFlowRLOOConfig,
                           PrefixFlowRLOOTrainer)
from hf_prefixflow import _compat
from hf_prefixflow.planning.flops import ModelShape
from hf_prefixflow.core.recompute import decoder_layers
from hf_prefixflow.core.scheduler import PrefixGroup
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import harness  # noqa: E402 - benchmarks/harness.py: the run folder, environment and peak memory
import memory_trace  # noqa: E402 - the allocator history's largest live set
import synthetic  # noqa: E402 - the examples' synthetic task and step timing
from step_timing import StepTimer, sync, timed_generation  # noqa: E402

# --family: each side's trainer class, its stock config class and its PrefixFlow config class
FAMILIES = {"grpo": {"stock": (GRPOTrainer, GRPOConfig, GRPOConfig),
                     "prefixflow": (PrefixFlowGRPOTrainer, GRPOConfig, PrefixFlowGRPOConfig)},
            "rloo": {"stock": (RLOOTrainer, RLOOConfig, RLOOConfig),
                     "prefixflow": (PrefixFlowRLOOTrainer, RLOOConfig, PrefixFlowRLOOConfig)}}
PLAIN_GRID = {"models": "qwen3-1.7b", "batches": "4,16", "checkpointing": "on", "tag": "trainer_step"}
# --memory-grid: the points where PrefixFlow's default peak must stay within GRPOTrainer's (hf_prefixflow/defaults.py)
MEMORY_GRID = {"models": "qwen3-1.7b,llama3-8b", "splits": "4864/256,10240/2048", "batches": "1,4,16",
               "checkpointing": "on,off", "tag": "memory_grid"}


@dataclass(frozen=True)
class Point:
    model: str
    ratio: float
    batch: int
    checkpointing: bool
    generation: str
    completion: int  # S


def build_model(name: str, tiny: bool, tokenizer) -> torch.nn.Module:
    if tiny:
        model = synthetic.make_model(tokenizer, hidden=64, layers=2)
    else:
        from speed import build  # benchmarks/speed.py: the GPU shapes, bf16 on CUDA, SDPA

        model = build(name, prefixflow=False)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return model


def prompts(count: int, length: int) -> Dataset:
    """`count` prompts of exactly `length` tokens of the synthetic word-level vocabulary, all different."""
    rng = random.Random(0)
    words = synthetic.TEMPLATE + synthetic.NUMBERS
    return Dataset.from_dict({"prompt": [" ".join(rng.choice(words) for _ in range(length)) for _ in range(count)]})


def fixed_completions(trainer, length: int, vocab: int) -> None:
    """Generation replaced by random completions of `length` tokens (no EOS), the same for every trainer."""
    rng = random.Random(0)
    with_logprobs = isinstance(trainer, GRPOTrainer)  # GRPOTrainer's returns (ids, logprobs), RLOOTrainer's ids

    def generate(prompt_ids, *args, **kwargs):
        ids = [[rng.randrange(3, vocab) for _ in range(length)] for _ in prompt_ids]
        return (ids, None) if with_logprobs else ids

    trainer._generate_single_turn = generate


def make_trainer(name: str, point: Point, args, steps: int):
    tokenizer = synthetic.make_tokenizer()
    prefix = prefix_length(point.ratio, point.completion)
    accumulation = args.n // math.gcd(args.n, point.batch)  # one generation batch per optimizer step
    groups = point.batch * accumulation // args.n
    extra = args.prefixflow_config if name == "prefixflow" else {}
    extra = {**args.config, **extra}
    trainer_class, stock_config, own_config = FAMILIES[args.family][name]
    config = (own_config if name == "prefixflow" and args.prefixflow_config else stock_config)(
        **extra, output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=point.batch,
        gradient_accumulation_steps=accumulation, num_generations=args.n, max_completion_length=point.completion,
        gradient_checkpointing=point.checkpointing, bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(), learning_rate=1e-6, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0)
    rewards = random.Random(1)
    trainer = trainer_class(
        model=build_model(point.model, args.tiny, tokenizer), args=config, processing_class=tokenizer,
        reward_funcs=lambda completions, **kwargs: [rewards.random() for _ in completions],
        train_dataset=prompts(groups * steps + 1, prefix))
    trainer.remove_callback(PrinterCallback)  # the logs are in the rows
    if name == "stock" and args.stock_compile_layers:
        compile_layers(trainer.model)
    if point.generation == "fixed":
        fixed_completions(trainer, point.completion, len(tokenizer))
    return trainer


def compile_layers(model: torch.nn.Module) -> None:
    """`--stock-compile-layers`: compile each decoder layer of the stock trainer's model in place, as PrefixFlow's
    `torch_compile=True` does with its own (TRL's `torch_compile` compiles the whole model instead)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    _compat.raise_recompile_limit(4 * len(layers))


def prefix_length(ratio: float, completion: int) -> int:
    return round(completion * ratio / (1 - ratio))


ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def is_hybrid(config) -> bool:
    """Whether recurrent layers replace attention in some of `config`'s (text) layers."""
    return any(kind not in ATTENTION_KINDS for kind in getattr(config, "layer_types", None) or ())


def step_flop_ratio(model: torch.nn.Module, completion: float, n: int):
    """The FLOP ratio of a group of `n` completions of `completion` tokens as a function of the prompt length:
    `planning.flops` for attention-only models, per-layer costs (`hybrid_group.flop_ratio`) where recurrent layers
    replace attention."""
    config = model.config.get_text_config()
    if is_hybrid(config):
        from hybrid_group import flop_ratio as hybrid_ratio  # benchmarks/hybrid_group.py

        layers_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        return lambda prefix: hybrid_ratio(layers_model, prefix, [round(completion)] * n)
    shape = ModelShape.from_config(config)
    return lambda prefix: shape.full_sequence(prefix, [completion] * n) / shape.prefixflow(prefix, [completion] * n)


def compute_ratio(config, prefix: int, completion: float, n: int, checkpointing: bool,
                  suffix_recomputed: bool) -> float | None:
    """The step's compute ratio with recomputation counted (attention-only models; None for hybrids): under
    checkpointing the stock trainer runs every layer's forward twice; PrefixFlow recomputes the prompt's layers in
    Phase C and its completions' only where `prefixflow_suffix_checkpointing` chose to (else it keeps them)."""
    text = config.get_text_config()
    if is_hybrid(text):
        return None
    shape, rows = ModelShape.from_config(text), [completion] * n
    stock = shape.full_sequence(prefix, rows) + (shape.full_sequence(prefix, rows, train=False) - sum(
        shape._head(s) for s in rows) / 3 if checkpointing else 0.0)
    prompt, waves = shape._tokens(prefix, 0), sum(shape._tokens(s, prefix) for s in rows)
    recomputed = (prompt + (waves if suffix_recomputed else 0.0)) / 3 if checkpointing else 0.0
    return stock / (shape.prefixflow(prefix, rows) + recomputed)


def train_measured(trainer, warmup: int) -> tuple[dict, list[dict]]:
    """Train `trainer`: whole-step and generation seconds after `warmup` steps, the peak device memory, the rows
    sent to the plain path; and TRL's logged steps."""
    timer, generation = StepTimer(), timed_generation(trainer)
    trainer.add_callback(timer)
    harness.reset_peak()
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"steps": timer.times[warmup:], "warmup_steps": timer.times[:warmup], "generation": generation[warmup:],
            "peak_gib": harness.peak_gib(),
            "fallback_rows": sum(getattr(trainer, "_fallbacks", {}).values())}, logs  # rows, warm-up included


def run(name: str, point: Point, args) -> dict | None:
    """One trainer at one point: step times, generation times, peak memory, TRL's logged metrics; `None` when it
    runs out of device memory."""
    trainer = make_trainer(name, point, args, args.warmup + args.steps)
    try:
        result, logs = train_measured(trainer, args.warmup)
    except torch.OutOfMemoryError:
        release(trainer)
        return None
    completion = statistics.mean(log["completions/mean_length"] for log in logs[args.warmup:])
    result.update(completion_mean=completion, flop_ratio=step_flop_ratio(trainer.model, completion, args.n),
                  run_microbatches=max((log.get("prefixflow/run_microbatches", 0) for log in logs), default=0),
                  suffix_recomputed=max((log.get("prefixflow/suffix_checkpointing", 0) for log in logs), default=0),
                  offload_modes=offload_modes(logs), settings=ran_with(trainer), config=trainer.model.config)
    release(trainer)
    return result


RAN_WITH = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16",
            "num_generations", "max_completion_length", "torch_compile", "prefixflow_offload", "prefixflow_offload_kv",
            "prefixflow_offload_auto", "prefixflow_prefix_recompute", "prefixflow_suffix_checkpointing",
            "prefixflow_merge_microbatches", "prefixflow_wave_size")


def ran_with(trainer) -> dict:
    """The settings a trainer ran with: its config's (a plain GRPOConfig has no prefixflow_ fields: the trainer's
    defaults) and, for PrefixFlow, the merge cap the memory rule left for the last generation batch."""
    prefixflow = isinstance(trainer, (PrefixFlowGRPOTrainer, PrefixFlowRLOOTrainer))
    values = {k: getattr(trainer, k) if k.startswith("prefixflow_") else getattr(trainer.args, k)
              for k in RAN_WITH if prefixflow or not k.startswith("prefixflow_")}
    if hasattr(trainer, "_merge_cap"):
        values["merge_cap"] = trainer._merge_cap
    return values


def offload_modes(logs: list[dict]) -> list[str]:
    """The default memory rule's settings the logged steps ran (`prefixflow/offload_mode`, a step's mean when it
    opened groups under several)."""
    from hf_prefixflow.planning.defaults import SETTING_NAMES

    codes = sorted({log["prefixflow/offload_mode"] for log in logs if "prefixflow/offload_mode" in log})
    return [SETTING_NAMES[int(c)] if float(c).is_integer() else f"mean {c:.2f}" for c in codes]


def release(trainer) -> None:
    """Drop every reference to the model, its gradients and the optimizer state before the next trainer builds."""
    trainer.accelerator.free_memory()
    for holder in (trainer, trainer.callback_handler):
        holder.model = holder.optimizer = holder.lr_scheduler = None
    trainer.model_wrapped = trainer._buffered_inputs = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(point: Point, args, environment: dict) -> dict:
    runs = {name: run(name, point, args) for name in args.trainers}
    out_of_memory = [name for name, result in runs.items() if result is None]
    runs = {name: result for name, result in runs.items() if result is not None}
    stock, pf = runs.get("stock"), runs.get("prefixflow")
    if not runs:
        return {**vars(point), "out_of_memory": out_of_memory}
    any_run = stock or pf
    prefix, completion = prefix_length(point.ratio, point.completion), any_run["completion_mean"]
    accumulation = args.n // math.gcd(args.n, point.batch)
    groups = point.batch * accumulation // args.n
    flop_ratio = any_run["flop_ratio"](prefix)
    row = {"family": args.family, "model": point.model, "P": prefix, "S": point.completion,
           "S_mean": round(completion, 1), "N": args.n, "batch": point.batch, "groups_per_step": groups,
           "checkpointing": point.checkpointing, "generation": point.generation, "out_of_memory": out_of_memory}
    for name, result in runs.items():
        row[f"{name}_settings"] = result["settings"]
        row[f"{name}_s"] = round(statistics.median(result["steps"]), 4)
        row[f"{name}_steps_s"] = [round(t, 4) for t in result["steps"]]
        row[f"{name}_warmup_steps_s"] = [round(t, 4) for t in result["warmup_steps"]]
        row[f"{name}_generation_s"] = round(statistics.median(result["generation"]), 4)
        row[f"{name}_peak_gib"] = None if result["peak_gib"] is None else round(result["peak_gib"], 2)
    row["speedup"] = round(row["stock_s"] / row["prefixflow_s"], 3) if stock and pf else None
    # the memory columns under benchmarks/results/trainer_step.json's names, and the memory rule's verdict
    row["peak_gib_stock"], row["peak_gib_prefixflow"] = row.get("stock_peak_gib"), row.get("prefixflow_peak_gib")
    if stock and pf and stock["peak_gib"] is not None:
        row["peak_within_stock"] = pf["peak_gib"] <= stock["peak_gib"]
    row["flop_ratio"] = round(flop_ratio, 3)
    if stock:
        generation = row["stock_generation_s"]
        row["amdahl_cap"] = round(row["stock_s"] / (generation + (row["stock_s"] - generation) / flop_ratio), 3)
    if pf:
        row["run_microbatches"], row["fallback_rows"] = pf["run_microbatches"], pf["fallback_rows"]
        row["suffix_recomputed"] = pf["suffix_recomputed"]  # prefixflow_suffix_checkpointing's choice (1: recomputed)
        row["offload_modes"] = pf["offload_modes"]  # the default memory rule's settings (hf_prefixflow/defaults.py)
        ratio = compute_ratio(any_run["config"], prefix, completion, args.n, point.checkpointing,
                              bool(pf["suffix_recomputed"]))
        row["compute_ratio"] = None if ratio is None else round(ratio, 3)  # flop_ratio with recomputation counted
    row.update(config=args.config, prefixflow_config=args.prefixflow_config, warmup=args.warmup, timed_steps=args.steps,
               stock_compile_layers=args.stock_compile_layers, **environment)
    return row


def table(rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = [f"Median of {first['timed_steps']} steps after {first['warmup']}.", "",
             "| model | P / S | N | batch | checkpointing | generation | stock s | PrefixFlow s | speedup | FLOP ratio "
             "| compute ratio | Amdahl cap | microbatches per run | peak GiB stock / PF | settings |",
             "| --- " * 15 + "|"]
    for r in rows:
        peaks = f"{r.get('stock_peak_gib')} / {r.get('prefixflow_peak_gib')}"
        lines.append(f"| {r['model']} | {r['P']} / {r['S_mean']} | {r['N']} | {r['batch']} | "
                     f"{'on' if r['checkpointing'] else 'off'} | {r['generation']} | {r.get('stock_s', '-')} | "
                     f"{r.get('prefixflow_s', '-')} | {r['speedup'] or '-'}x | {r['flop_ratio']}x | "
                     f"{r.get('compute_ratio') or '-'}x | {r.get('amdahl_cap', '-')}x | "
                     f"{r.get('run_microbatches', '-')} | {peaks} | {settings(r)} |")
    return lines


def settings(row: dict) -> str:
    """A row's non-default settings: `--config` for both trainers, `--prefixflow-config` for PrefixFlow's."""
    both = [f"{k}={v}" for k, v in row.get("config", {}).items()]
    own = [f"PF {k}={v}" for k, v in row.get("prefixflow_config", {}).items()]
    stock = ["stock layers compiled"] if row.get("stock_compile_layers") else []
    return ", ".join(both + own + stock) or "defaults"


# -- --memory-trace: where one step's peak memory goes --------------------------------------------------------------


class TracedStep(TrainerCallback):
    """Records the CUDA allocator's history over the step after `skip` steps; `split` then holds its largest live set
    by allocating frame (`memory_trace.peak_set`). `memory` is `torch.cuda.memory` (a stand-in in tests)."""

    def __init__(self, skip: int, memory=None):
        self.skip, self.memory, self.start = skip, memory or torch.cuda.memory, None
        self.peak_bytes, self.split = 0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.skip:
            sync()
            self.memory._record_memory_history(max_entries=4_000_000)
            self.start = len(self.memory._snapshot()["device_traces"][0])

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            sync()
            trace = self.memory._snapshot()["device_traces"][0]
            self.memory._record_memory_history(enabled=None)
            self.peak_bytes, self.split = memory_trace.peak_set(trace, start=self.start)
            self.start = None


def memory_traced(name: str, point: Point, args) -> dict:
    """One trainer's traced step (after `args.warmup` steps): `memory_trace.report`'s row and the run's peak."""
    trainer = make_trainer(name, point, args, args.warmup + 1)
    step = TracedStep(args.warmup)
    trainer.add_callback(step)
    harness.reset_peak()
    trainer.train()
    row = memory_trace.report(f"{name}: {point.model}, batch {point.batch}, traced step {args.warmup + 1}",
                              harness.peak_gib(), step.peak_bytes, step.split)
    release(trainer)
    return row


def trace_memory(point: Point, args, run: harness.RunFolder) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--memory-trace records the CUDA allocator's history: it needs a GPU")
    rows = [{**memory_traced(name, point, args), **run.environment} for name in args.trainers]
    lines = ["| trainer | whole run's peak GiB | traced step's live peak GiB | largest frames (GiB) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['title']} | {r['max_allocated_gib']} | {r['traced_peak_gib']} | "
              + "; ".join(f"{t['gib']} `{t['where']}`" for t in r["top"][:5]) + " |" for r in rows]
    run.write(rows, lines)


# -- --profile: where one step's time goes -----------------------------------------------------------------------

PHASES = {"_generate_single_turn": "generation", "_generate_and_score_completions": "generate_and_score",
          "training_step": "microbatch", "compute_loss": "forward_and_loss", "_end_boundary": "phase_c",
          "_close_groups_not_in": "phase_c", "_end_session": "phase_c"}
GROUP_PHASES = {"_prefix_forward": "phase_a", "run_wave": "wave_forward"}  # PrefixGroup's methods
ORDER = ["step", "generate_and_score", "generation", "microbatch", "forward_and_loss", "phase_a", "wave_forward",
         "backward", "phase_c", "optimizer"]


class ProfiledStep(TrainerCallback):
    """Profiles the step after `skip` steps, with `step` and `optimizer` ranges."""

    def __init__(self, skip: int, trace: pathlib.Path):
        self.skip, self.trace, self.profiler, self.ranges, self.ops = skip, trace, None, {}, []

    def _enter(self, name: str):
        if self.profiler is not None:
            self.ranges[name] = torch.profiler.record_function(name)
            self.ranges[name].__enter__()

    def _exit(self, name: str):
        if name in self.ranges:
            self.ranges.pop(name).__exit__(None, None, None)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.skip:
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self._enter("step")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._exit("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            sync()
            self._exit("step")
            self.profiler.__exit__(None, None, None)
            self.profiler.export_chrome_trace(str(self.trace))
            self.ops = top_ops(self.profiler)
            self.profiler = None


def _ranged(inner, phase: str):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(phase):
            return inner(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def annotated(trainer):
    """Wrap the trainer methods named in PHASES, PrefixGroup's in GROUP_PHASES and the backward in record_function
    ranges (the group's methods restored on exit)."""
    for method, phase in PHASES.items():
        if hasattr(trainer, method):
            setattr(trainer, method, _ranged(getattr(trainer, method), phase))
    trainer.accelerator.backward = _ranged(trainer.accelerator.backward, "backward")
    saved = {method: getattr(PrefixGroup, method) for method in GROUP_PHASES}
    try:
        for method, phase in GROUP_PHASES.items():
            setattr(PrefixGroup, method, _ranged(saved[method], phase))
        yield
    finally:
        for method, inner in saved.items():
            setattr(PrefixGroup, method, inner)


def busy_time(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals` clipped to [start, end]."""
    total, reach = 0.0, start
    for a, b in intervals:
        if a >= end:
            break
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def summarise(trace: pathlib.Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    ranges: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in ORDER:
            ranges.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    rows = []
    for name, spans in ranges.items():
        wall = sum(b - a for a, b in spans)
        busy = sum(busy_time(device, a, b) for a, b in spans)
        rows.append({"phase": name, "calls": len(spans), "wall_ms": round(wall / 1e3, 2),
                     "gpu_busy_ms": round(busy / 1e3, 2) if device else None,
                     "gpu_busy_share": round(busy / wall, 3) if device and wall else None})
    return sorted(rows, key=lambda r: ORDER.index(r["phase"]))


def top_ops(profiler, count: int = 12) -> list[dict]:
    """The operators with the most host time of their own in the profiled step, then (on a GPU) those with the
    most device time of their own (kernels, where the time of a host-bound step is not)."""
    events = [e for e in profiler.key_averages() if not e.key.startswith("ProfilerStep")]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    rows = [{"op": e.key, "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in host]
    device = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: e.self_device_time_total,
                    reverse=True)[:count]
    return rows + [{"op": e.key, "calls": e.count, "self_device_ms": round(e.self_device_time_total / 1e3, 2)}
                   for e in device]


def profiled_step(trainer, warmup: int) -> tuple[list[dict], list[dict]]:
    """Train `trainer` (set up for `warmup` + 1 steps) with its last step under the profiler: that step's phases
    (wall time and GPU-busy time per range) and its operators by host time."""
    trace = pathlib.Path(tempfile.mkdtemp()) / "trace.json"
    step = ProfiledStep(warmup, trace)
    trainer.add_callback(step)
    with annotated(trainer):
        trainer.train()
    return summarise(trace), step.ops


def profile_markdown(heading: str, rows: list[dict], ops: dict[str, list[dict]]) -> str:
    """The phases of each trainer's profiled step, then each one's operators by host time."""
    lines = [heading + " Ranges nest: microbatch holds forward_and_loss and, for PrefixFlow, phase_c; the profiler's "
             "own overhead inflates host-bound ranges.", "",
             "| trainer | phase | calls | wall ms | GPU busy ms | GPU busy share |", "| --- " * 6 + "|"]
    lines += [f"| {r['trainer']} | {r['phase']} | {r['calls']} | {r['wall_ms']} | {r['gpu_busy_ms']} | "
              f"{r['gpu_busy_share']} |" for r in rows]
    for name, table in ops.items():
        for key, what in (("self_host_ms", "host"), ("self_device_ms", "device")):
            picked = [o for o in table if key in o]
            if picked:
                lines += ["", f"{name}: operators by {what} time of their own", "",
                          f"| op | calls | self {what} ms |", "| --- | --- | --- |"]
                lines += [f"| `{o['op']}` | {o['calls']} | {o[key]} |" for o in picked]
    return "\n".join(lines) + "\n"


def profile(point: Point, args, out: pathlib.Path, environment: dict) -> None:
    rows, ops = [], {}
    for name in args.trainers:
        trainer = make_trainer(name, point, args, args.warmup + 1)
        phases, ops[name] = profiled_step(trainer, args.warmup)
        release(trainer)
        rows += [{"trainer": name, **r} for r in phases]
    meta = {"point": vars(point), "P": prefix_length(point.ratio, point.completion), "S": point.completion, "N": args.n,
            "prefixflow_config": args.prefixflow_config, **environment}
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_step_profile.json").write_text(json.dumps({"meta": meta, "phases": rows, "top_ops": ops},
                                                              indent=1))
    text = profile_markdown(f"One profiled step after {args.warmup} ({meta['point']}, P={meta['P']}, S={meta['S']}, "
                            f"N={meta['N']}) on {meta['gpu']}, commit {meta['commit']}.", rows, ops)
    (out / "trainer_step_profile.md").write_text(text)
    print(text, flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated shapes of benchmarks/speed.py")
    parser.add_argument("--ratios", default="0.95", help="prefix ratios P / (P + S), comma-separated")
    parser.add_argument("--splits", default=None, help="P/S,... instead of --ratios and --completion")
    parser.add_argument("--batches", default=None, help="per_device_train_batch_size values, comma-separated")
    parser.add_argument("--checkpointing", default=None, help="on, off or on,off")
    parser.add_argument("--memory-grid", action="store_true",
                        help="default configs on both trainers over MEMORY_GRID (the other grid flags narrow it)")
    parser.add_argument("--generation", default="fixed", help="fixed, generate or fixed,generate")
    parser.add_argument("--completion", type=int, default=256, help="completion tokens S (max_completion_length)")
    parser.add_argument("--n", type=int, default=16, help="num_generations")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--family", default="grpo", choices=sorted(FAMILIES),
                        help="grpo: GRPOTrainer and PrefixFlowGRPOTrainer; rloo: RLOOTrainer and PrefixFlowRLOOTrainer")
    parser.add_argument("--trainers", default="stock,prefixflow")
    parser.add_argument("--prefixflow-config", default="", type=harness.options,
                        help="KEY=VALUE,... PrefixFlowGRPOConfig fields for the PrefixFlow trainer only, e.g. "
                             "prefixflow_merge_microbatches=1 or torch_compile=true (default: a plain GRPOConfig)")
    parser.add_argument("--config", default="", type=harness.options,
                        help="KEY=VALUE,... GRPOConfig fields for both trainers, e.g. torch_compile=true")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no grid point after this many seconds")
    parser.add_argument("--profile", action="store_true", help="profile the first grid point instead of timing")
    parser.add_argument("--memory-trace", action="store_true",
                        help="trace the first grid point's peak memory per trainer instead of timing (GPU)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, short prompts")
    parser.add_argument("--one-config", action="store_true",
                        help="narrow Triton autotuning to one configuration per kernel (harness.one_triton_config)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<date>_<tag>")
    parser.add_argument("--stock-compile-layers", action="store_true",
                        help="compile each decoder layer of the stock trainer's model (the like-for-like baseline of "
                             "--prefixflow-config torch_compile=true)")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    autotuning = harness.one_triton_config() if args.one_config else None
    grid = MEMORY_GRID if args.memory_grid else PLAIN_GRID
    for key, value in grid.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny:  # a few seconds a point on a laptop CPU
        args.completion, args.n, args.steps = min(args.completion, 8), min(args.n, 4), min(args.steps, 2)
        args.models = "tiny"
        args.batches = ",".join(b for b in args.batches.split(",") if int(b) <= args.n) or "2"
    args.trainers = args.trainers.split(",")
    run = harness.RunFolder("trainer_step", args.out, args.tag, argv)
    if autotuning:
        run.environment["autotuning"] = autotuning
    out = run.path
    if args.splits:  # (P / (P + S), S) per split
        splits = [(p / (p + s), s) for p, s in (map(int, split.split("/")) for split in args.splits.split(","))]
    else:
        splits = [(float(r), args.completion) for r in args.ratios.split(",")]
    if args.tiny:
        splits = [(r, min(s, 8)) for r, s in splits]
    points = [Point(m, r, int(b), c == "on", g, s) for m, (r, s), b, c, g in itertools.product(
        args.models.split(","), splits, args.batches.split(","), args.checkpointing.split(","),
        args.generation.split(","))]
    if args.profile:
        profile(points[0], args, out, run.environment)
        return []
    if args.memory_trace:
        trace_memory(points[0], args, harness.RunFolder("trainer_step_memory", args.out, args.tag, argv))
        return []
    start, rows = time.perf_counter(), []
    for point in points:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            print(f"deadline: {len(points) - len(rows)} points not run", flush=True)
            break
        row = measure(point, args, run.environment)
        print(json.dumps(row), flush=True)
        if "P" in row:  # a point where every trainer ran out of memory has no row
            rows.append(row)
            run.write(rows, table(rows))
    return rows


if __name__ == "__main__":
    main()
