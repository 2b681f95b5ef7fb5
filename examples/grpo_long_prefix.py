"""Long-prefix GRPO: the stock TRL trainer and PrefixFlowGRPOTrainer on the same job, side by side.

    python examples/grpo_long_prefix.py                         # both trainers, tiny model, synthetic RAG task
    python examples/grpo_long_prefix.py --trainer prefixflow    # one of them
    accelerate launch --config_file examples/accelerate/single_gpu.yaml examples/grpo_long_prefix.py --trainer prefixflow
    python examples/grpo_long_prefix.py --model PATH --dataset data.jsonl   # a real checkpoint and dataset

The only difference between the two runs is the trainer class. The default job needs no network: a random-init
model built from a config, a tokenizer made locally, and a synthetic RAG dataset (passages + a question; the reward
checks the answer appears in the completion). It prints step time, actor-update time (step minus generation) and
reward for each trainer, the largest difference between their losses, and writes `logs.json` and a PNG of the reward
and loss curves to a folder of its own per run (`grpo_long_prefix_out/<date-time>/`, or `--out`).

`--dataset` takes a hub dataset name, a local folder, or a `.json`, `.jsonl`, `.csv` or `.parquet` file; it needs
`prompt` and `answer` columns (the reward reads `answer`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import synthetic  # beside this script
from step_timing import train_timed
from hf_prefixflow import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer

TRAINERS = {"stock": GRPOTrainer, "prefixflow": PrefixFlowGRPOTrainer}
DATA_FILES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
STYLES = {"stock": {"linestyle": "-", "marker": "o", "linewidth": 3.0, "markersize": 7, "alpha": 0.5},
          "prefixflow": {"linestyle": "--", "marker": "x", "linewidth": 1.5, "markersize": 6}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["both", *TRAINERS], default="both")
    parser.add_argument("--model", help="checkpoint for from_pretrained (default: a tiny random-init model)")
    parser.add_argument("--dataset", help="hub name, folder, or .json/.jsonl/.csv/.parquet file with 'prompt' and "
                                          "'answer' columns")
    parser.add_argument("--split", default="train")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--passages", type=int, default=40, help="synthetic task: passages per prompt")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128, help="tiny model width")
    parser.add_argument("--layers", type=int, default=4, help="tiny model depth")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--sp", type=int, default=1,
                        help="PrefixFlow: Ulysses sequence parallelism over groups of this many processes")
    parser.add_argument("--out", help="output folder (default: a new grpo_long_prefix_out/<date-time>/)")
    return parser.parse_args(argv)


def load(args):
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                                     attn_implementation="sdpa")
    else:
        tokenizer = synthetic.make_tokenizer()
        model = synthetic.make_model(tokenizer, hidden=args.hidden, layers=args.layers)
    if args.dataset:
        dataset = load_data(args.dataset, args.split)
    else:
        dataset = synthetic.make_dataset(rows=args.steps * args.batch_size // args.num_generations + 8,
                                         passages=args.passages)
    return tokenizer, model, dataset


def load_data(name: str, split: str):
    """A hub dataset, a folder, or one data file (read by the `datasets` builder its suffix names)."""
    from datasets import load_dataset

    path = pathlib.Path(name)
    builder = DATA_FILES.get(path.suffix.lower())
    if path.is_file():
        if builder is None:
            raise SystemExit(f"--dataset {name}: a file must end in one of {', '.join(DATA_FILES)}")
        dataset = load_dataset(builder, data_files={split: str(path)}, split=split)
    else:
        dataset = load_dataset(name, split=split)
    missing = {"prompt", "answer"} - set(dataset.column_names)
    if missing:
        raise SystemExit(f"--dataset {name}: needs 'prompt' and 'answer' columns; it has {dataset.column_names}")
    return dataset


def output_folder(out: str | None) -> pathlib.Path:
    """`--out` as given, else a new `grpo_long_prefix_out/<date-time>/` so that runs do not overwrite each other (the
    main process names it; every process of a launch gets the same)."""
    if out:
        path = pathlib.Path(out)
    else:
        from accelerate import PartialState
        from accelerate.utils import broadcast_object_list

        state, name = PartialState(), [None]
        if state.is_main_process:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            path, n = pathlib.Path("grpo_long_prefix_out") / stamp, 1
            while path.exists():
                n += 1
                path = path.with_name(f"{stamp}-{n}")
            name[0] = str(path)
        if state.num_processes > 1:
            broadcast_object_list(name)
        path = pathlib.Path(name[0])
    path.mkdir(parents=True, exist_ok=True)
    return path


def config(args, name: str) -> GRPOConfig:
    sp = {"prefixflow_sp_size": args.sp} if name == "prefixflow" and args.sp > 1 else {}
    return (PrefixFlowGRPOConfig if sp else GRPOConfig)(
        output_dir=str(pathlib.Path(args.out) / name), max_steps=args.steps, learning_rate=5e-4,
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, logging_steps=1, report_to="none", save_strategy="no",
        bf16=args.bf16, seed=0, temperature=1.0, beta=0.0, **sp,
    )


def run(name: str, args, tokenizer, model, dataset) -> list[dict]:
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    trainer = TRAINERS[name](model=model, reward_funcs=synthetic.answer_reward, args=config(args, name),
                             train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
    logs = train_timed(trainer)
    remove_if_empty(pathlib.Path(trainer.args.output_dir))  # save_strategy="no": TRL leaves it empty
    return logs


def remove_if_empty(path: pathlib.Path) -> None:
    try:
        path.rmdir()
    except OSError:  # missing, or holds files
        pass


def summarize(results: dict[str, list[dict]], out: pathlib.Path) -> None:
    rows = []
    for name, logs in results.items():
        steady = logs[1:] or logs  # the first step carries one-time warm-up
        rows.append((name, statistics.median(l["step_s"] for l in steady),
                     statistics.median(l["update_s"] for l in steady),
                     statistics.mean(l["reward"] for l in logs[-4:])))
    # Whole steps (Phase C and TRL's bookkeeping inside); "without generation" leaves out generation alone.
    print(f"\n{'trainer':<12}{'step s':>10}{'without generation s':>22}{'reward (last 4)':>17}")
    for name, step, update, reward in rows:
        print(f"{name:<12}{step:>10.3f}{update:>22.3f}{reward:>17.3f}")
    if len(rows) == 2:
        print(f"whole-step speedup: {rows[0][1] / rows[1][1]:.2f}x; without generation: {rows[0][2] / rows[1][2]:.2f}x")
        saved = [log["prefixflow/flops_saved"] for log in results["prefixflow"] if "prefixflow/flops_saved" in log]
        if saved:  # the speedup a GPU-bound actor update could reach; small or host-bound steps stay below it
            print(f"FLOP ratio of the shared groups (the bound for a GPU-bound step): "
                  f"{1 / (1 - statistics.mean(saved)):.2f}x")
        stock, prefixflow = results["stock"], results["prefixflow"]
        same_rewards = all(s["reward"] == p["reward"] for s, p in zip(stock, prefixflow))
        rewards = f"rewards {'identical' if same_rewards else 'differ'} (curves.png: stock solid, prefixflow dashed)"
        # A step whose every group has equal rewards has zero advantages: both losses are 0 whatever the gradients.
        compared = [(s, p) for s, p in zip(stock, prefixflow) if s.get("frac_reward_zero_std", 0.0) < 1]
        if not compared:
            zero = all(s["reward"] == 0 for s in stock)
            print(f"{'all rewards 0' if zero else 'every group rewarded its completions alike'}: losses not compared "
                  f"(every advantage was 0); {rewards}")
        else:
            gaps = [abs(s["loss"] - p["loss"]) for s, p in compared]
            agree = all(g <= 1e-4 + 1e-3 * abs(s["loss"]) for g, (s, _) in zip(gaps, compared))
            print(f"losses {'agree' if agree else 'DIFFER'}: largest difference {max(gaps):.2e} over {len(gaps)} of "
                  f"{len(stock)} steps (those where a group's rewards differed); {rewards}")
    (out / "logs.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "curves.png")
    print(f"curves: {out / 'curves.png'}")


def plot(results: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, logs in results.items():
        steps = [l["step"] for l in logs]
        style = STYLES.get(name, {})
        axes[0].plot(steps, [l["reward"] for l in logs], label=name, **style)
        axes[1].plot(steps, [l["loss"] for l in logs], label=name, **style)
    titles = ["reward", "loss"]
    if len(results) == 2:
        stock, prefixflow = results["stock"], results["prefixflow"]
        gap = max(abs(s["loss"] - p["loss"]) for s, p in zip(stock, prefixflow))
        titles[1] = f"loss (largest difference {gap:.1e})"
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    tokenizer, model, dataset = load(args)
    out = output_folder(args.out)
    args.out = str(out)
    names = list(TRAINERS) if args.trainer == "both" else [args.trainer]
    results = {name: run(name, args, tokenizer, copy.deepcopy(model), dataset) for name in names}
    summarize(results, out)
    return results


if __name__ == "__main__":
    main()
