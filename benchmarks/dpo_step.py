"""Whole DPO steps of TRL's DPOTrainer and PrefixFlowDPOTrainer, side by side, on long prompts and short responses.

    python benchmarks/dpo_step.py --model llama3-8b --splits 16384/64,4096/512 --lora --out $OUT
    python benchmarks/dpo_step.py --model qwen3-1.7b --splits 16384/64 --out $OUT      # full fine-tuning
    python benchmarks/dpo_step.py --tiny --out /tmp/dpo_step                          # CPU, a tiny model

Both trainers run in one process on the same random-init model (`speed.py`'s shapes, bf16 on CUDA, SDPA; rebuilt
with the same seed for each), a plain `DPOConfig` (TRL's defaults: sigmoid loss, beta 0.1, gradient checkpointing;
`max_length=None` so nothing is cut) and the same pairs: a prompt of exactly P tokens, and chosen and rejected
responses of S tokens that differ from their first token, so the shared prefix is the prompt. The reference is the
PEFT adapter disabled under `--lora`, a second copy of the model otherwise. A step is timed from `on_step_begin` to
`on_step_end` with the device synchronised (`examples/step_timing.py`): the reference pass, the policy pass, Phase
C and the optimizer step. Each row: the median of `--steps` steps after `--warmup`, each side's peak allocated
memory over its run, the pairs PrefixFlow sent to the plain path, and the FLOP ratio of the policy pass
(`planning.flops`, the two rows of a pair against the prompt once and the two responses). A side that runs out
of device memory is listed in `out_of_memory`. Only the first run in a process gives a clean peak: on the GPU a
run after another in the same process has read 30.6 GiB on the Llama3-8B LoRA shape whatever its own need, with
either trainer second (about two copies of the weights, held by something not identified;
`2026-12-05_dpo_trainer_order`). So each side records what was allocated before it built its model
(`*_resident_before_gib`), and `--order` picks which side runs first, or runs one alone. Rows go to `dpo_step.json`,
`.md` and a generated `MANIFEST.md` in `--out` after each point (`harness.RunFolder`). `--profile` instead runs one
step of each trainer after the warm-up under the torch profiler, at the first split, and writes
`dpo_step_profile.json` and `.md` (`trainer_step.py --profile`'s phases and operator tables; TRL runs the reference
pass inside `forward_and_loss`, and PrefixFlow's `phase_a` counts the policy's prompt and the reference's).
`--frontier-cap-gib C` caps the process at C GiB of device memory and runs one step of each trainer at each split
in increasing prompt length until one runs out of memory: `dpo_frontier.json` and `.md` name each trainer's longest
prompt that trained and their ratio (the frontier ratio; the next split bounds it from above).
`--prefixflow-config torch_compile=true` compiles each decoder layer on the PrefixFlow side (the trainer's own
`torch_compile`), and `--stock-compile-layers` does the same to DPOTrainer's models: compiled against compiled.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import random
import statistics
import sys
import tempfile

import torch
from datasets import Dataset
from transformers import PrinterCallback
from trl import DPOConfig, DPOTrainer

from hf_prefixflow import PrefixFlowDPOConfig, PrefixFlowDPOTrainer
from hf_prefixflow.planning.flops import ModelShape

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import synthetic  # noqa: E402 - a local word-level tokenizer
from step_timing import StepTimer  # noqa: E402

import harness  # noqa: E402 - benchmarks/harness.py
from trainer_step import (compile_layers, profile_markdown, profiled_step,  # noqa: E402 - benchmarks/trainer_step.py
                         release)

TRAINERS = {"stock": (DPOTrainer, DPOConfig), "prefixflow": (PrefixFlowDPOTrainer, PrefixFlowDPOConfig)}


def pairs(count: int, prompt: int, response: int, seed: int = 0) -> Dataset:
    """`count` pairs: a prompt of `prompt` words, chosen and rejected of `response` words, different from the first."""
    rng = random.Random(seed)
    words = synthetic.TEMPLATE + synthetic.NUMBERS

    def text(length: int) -> str:
        return " ".join(rng.choice(words) for _ in range(length))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(count):
        first = rng.sample(synthetic.NUMBERS, 2)
        rows["prompt"].append(text(prompt))
        rows["chosen"].append(" ".join([first[0], text(response - 1)]).strip())
        rows["rejected"].append(" ".join([first[1], text(response - 1)]).strip())
    return Dataset.from_dict(rows)


def build(args, tokenizer) -> torch.nn.Module:
    if args.tiny:
        model = synthetic.make_model(tokenizer, hidden=64, layers=2)
        if args.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    else:
        from speed import build as build_shape  # benchmarks/speed.py

        model = build_shape(args.model, prefixflow=False, lora=args.lora)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return model


def make_trainer(name: str, prompt: int, response: int, args, steps: int):
    """`name`'s trainer on a fresh model, set up for `steps` steps of `args.batch` pairs."""
    tokenizer = synthetic.make_tokenizer()
    trainer_class, config_class = TRAINERS[name]
    options = dict(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=args.batch,
                   max_length=None, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
                   learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    own = args.prefixflow_config if name == "prefixflow" else {}
    config = (config_class if name == "prefixflow" else DPOConfig)(**{**options, **args.config, **own})
    model = build(args, tokenizer)
    ref_model = None if args.lora else build(args, tokenizer)  # a random model has no checkpoint to reload
    trainer = trainer_class(model=model, ref_model=ref_model, args=config, processing_class=tokenizer,
                            train_dataset=pairs(args.batch * steps, prompt, response))
    trainer.remove_callback(PrinterCallback)
    if name == "stock" and args.stock_compile_layers:
        for compiled in (trainer.model, trainer.ref_model):
            if compiled is not None:
                compile_layers(compiled)
    return trainer


def run(name: str, prompt: int, response: int, args) -> dict | None:
    """One trainer at one split: step seconds, peak memory, logged metrics; None when out of device memory."""
    trainer = None
    resident = harness.allocated_gib()  # what an earlier run in this process left allocated
    try:
        trainer = make_trainer(name, prompt, response, args, args.warmup + args.steps)
        timer = StepTimer()
        trainer.add_callback(timer)
        harness.reset_peak()
        trainer.train()
    except torch.OutOfMemoryError:
        if trainer is not None:
            release(trainer)
        gc.collect()
        torch.cuda.empty_cache()
        return None
    logs = [log for log in trainer.state.log_history if "loss" in log]
    result = {"steps": timer.times[args.warmup:], "warmup_steps": timer.times[:args.warmup],
              "peak_gib": harness.peak_gib(), "resident_before_gib": resident,
              "fallback_pairs": sum(getattr(trainer, "_fallbacks", {}).values()),
              "losses": [log["loss"] for log in logs], "shape": ModelShape.from_config(trainer.model.config)}
    release(trainer)
    return result


def measure(prompt: int, response: int, args, environment: dict) -> dict:
    runs = {name: run(name, prompt, response, args) for name in args.order.split(",")}
    row = {"model": "tiny" if args.tiny else args.model, "lora": args.lora, "P": prompt, "S": response,
           "pairs_per_microbatch": args.batch, "out_of_memory": [n for n, r in runs.items() if r is None]}
    for name, result in runs.items():
        if result is not None:
            row[f"{name}_s"] = round(statistics.median(result["steps"]), 4)
            row[f"{name}_steps_s"] = [round(t, 4) for t in result["steps"]]
            row[f"{name}_warmup_steps_s"] = [round(t, 4) for t in result["warmup_steps"]]
            row[f"{name}_peak_gib"] = None if result["peak_gib"] is None else round(result["peak_gib"], 2)
            row[f"{name}_losses"] = result["losses"]
            row[f"{name}_resident_before_gib"] = result["resident_before_gib"]
            shape = result["shape"]
    stock, pf = runs.get("stock"), runs.get("prefixflow")
    if stock and pf:
        row["speedup"] = round(row["stock_s"] / row["prefixflow_s"], 3)
        if stock["peak_gib"] is not None:
            row["peak_ratio"] = round(pf["peak_gib"] / stock["peak_gib"], 3)
    if pf:
        row["fallback_pairs"] = pf["fallback_pairs"]
    if stock or pf:
        rows = [response] * 2
        row["flop_ratio"] = round(shape.full_sequence(prompt, rows) / shape.prefixflow(prompt, rows), 3)
    row.update(config=args.config, prefixflow_config=args.prefixflow_config,
               stock_compile_layers=args.stock_compile_layers, warmup=args.warmup, timed_steps=args.steps,
               **environment)
    return row


def profile(prompt: int, response: int, args, run: harness.RunFolder) -> None:
    """`--profile`: the step after `--warmup` of each trainer of `--order` under the torch profiler; per phase the
    wall and GPU-busy time, and the operators with the most host and device time."""
    rows, ops = [], {}
    for name in args.order.split(","):
        trainer = make_trainer(name, prompt, response, args, args.warmup + 1)
        phases, ops[name] = profiled_step(trainer, args.warmup)
        release(trainer)
        rows += [{"trainer": name, **r} for r in phases]
    meta = {"P": prompt, "S": response, "model": "tiny" if args.tiny else args.model, "lora": args.lora,
            "command": run.command, **run.environment}
    text = profile_markdown(f"One step after {args.warmup} (P={prompt}, S={response}, {meta['model']}, "
                            f"LoRA {args.lora}).", rows, ops)
    run.write({"meta": meta, "phases": rows, "top_ops": ops}, text.splitlines())
    print(text, flush=True)


def frontier(splits: list[tuple[int, int]], args, folder: harness.RunFolder) -> list[dict]:
    """`--frontier-cap-gib`: under that device cap, one step of each trainer of `--order` at each split in order of
    prompt length, until the first that runs out of memory; the row of each trainer names its longest prompt that
    trained, and `frontier_ratio` is PrefixFlow's over DPOTrainer's (a bracket: the next split failed)."""
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(args.frontier_cap_gib * 2**30 /
                                                   torch.cuda.get_device_properties(0).total_memory)
    args.warmup, args.steps = 0, 1
    trials, longest = [], {}
    for name in args.order.split(","):
        for prompt, response in sorted(splits):
            result = run(name, prompt, response, args)
            trials.append({"trainer": name, "P": prompt, "S": response, "trained": result is not None,
                           "peak_gib": None if result is None or result["peak_gib"] is None
                           else round(result["peak_gib"], 2)})
            print(json.dumps(trials[-1]), flush=True)
            if result is None:
                break
            longest[name] = prompt
    report = {"cap_gib": args.frontier_cap_gib, "longest_prompt": longest, "trials": trials,
              "model": "tiny" if args.tiny else args.model, "lora": args.lora, **folder.environment}
    if longest.get("stock") and longest.get("prefixflow"):
        report["frontier_ratio"] = round(longest["prefixflow"] / longest["stock"], 3)
    lines = [f"Under a {args.frontier_cap_gib} GiB device cap, one step per trial, prompts in increasing order until "
             "the first out of memory.", "", "| trainer | P | S | trained | peak GiB |", "| --- " * 5 + "|"]
    lines += [f"| {t['trainer']} | {t['P']} | {t['S']} | {'yes' if t['trained'] else 'out of memory'} | "
              f"{t['peak_gib']} |" for t in trials]
    lines += ["", f"Longest prompt that trained: {longest}; frontier ratio {report.get('frontier_ratio', '-')}."]
    folder.write(report, lines)
    return trials


def table(rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = [f"Median of {first['timed_steps']} steps after {first['warmup']}.", "",
             "| model | LoRA | P / S | pairs per microbatch | DPOTrainer s | PrefixFlow s | speedup | FLOP ratio "
             "| peak GiB stock / PF | out of memory |", "| --- " * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['lora']} | {r['P']} / {r['S']} | {r['pairs_per_microbatch']} | "
                     f"{r.get('stock_s', '-')} | {r.get('prefixflow_s', '-')} | {r.get('speedup', '-')}x | "
                     f"{r.get('flop_ratio', '-')}x | {r.get('stock_peak_gib')} / {r.get('prefixflow_peak_gib')} | "
                     f"{', '.join(r['out_of_memory']) or '-'} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a shape of benchmarks/speed.py")
    parser.add_argument("--splits", default="16384/64,4096/512", help="P/S,... prompt and response tokens")
    parser.add_argument("--batch", type=int, default=1, help="per_device_train_batch_size (pairs)")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA (r=16, all linear layers)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--config", default="", type=harness.options, help="KEY=VALUE,... DPOConfig fields for both")
    parser.add_argument("--prefixflow-config", default="", type=harness.options,
                        help="KEY=VALUE,... PrefixFlowDPOConfig fields for the PrefixFlow trainer only, e.g. "
                             "torch_compile=true (each decoder layer compiled)")
    parser.add_argument("--stock-compile-layers", action="store_true",
                        help="compile each decoder layer of DPOTrainer's models (the like-for-like baseline of "
                             "--prefixflow-config torch_compile=true; TRL's torch_compile compiles the whole model)")
    parser.add_argument("--order", default="stock,prefixflow",
                        choices=("stock,prefixflow", "prefixflow,stock", "stock", "prefixflow"),
                        help="the trainers this process runs, first to last (one alone: a clean peak)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one step of each trainer at the first split instead of timing")
    parser.add_argument("--frontier-cap-gib", type=float, default=None,
                        help="under this device cap, the longest prompt of --splits each trainer trains")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, short sequences")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<date>_dpo_step")
    args = parser.parse_args(argv)
    splits = [tuple(map(int, split.split("/"))) for split in args.splits.split(",")]
    if args.tiny:
        splits, args.steps = [(min(p, 96), min(s, 8)) for p, s in splits], min(args.steps, 2)
    if args.profile:
        profile(*splits[0], args, harness.RunFolder("dpo_step", args.out, tag="dpo_step_profile", argv=argv))
        return []
    if args.frontier_cap_gib is not None:
        return frontier(splits, args, harness.RunFolder("dpo_step", args.out, tag="dpo_frontier", argv=argv))
    run, rows = harness.RunFolder("dpo_step", args.out, argv=argv), []
    for prompt, response in splits:
        rows.append(measure(prompt, response, args, run.environment))
        print(json.dumps(rows[-1]), flush=True)
        run.write(rows, table(rows))
    return rows


if __name__ == "__main__":
    main()
