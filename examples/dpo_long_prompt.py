"""Long-prompt DPO: TRL's DPOTrainer and PrefixFlowDPOTrainer on the same job, side by side.

    python examples/dpo_long_prompt.py                        # both trainers, tiny model, synthetic documents
    python examples/dpo_long_prompt.py --trainer prefixflow   # one of them
    python examples/dpo_long_prompt.py --passages 400 --hidden 512 --layers 8   # longer documents, a wider model

The only difference between the two runs is the trainer class. The job needs no network: a random-init model built
from a config, a tokenizer made locally, and a synthetic long-document preference set: each prompt is a stack of
passages ("passage : the key of door 17 is 42 .") and a question about one door; both responses open with the
same words ("the key of door 17 is") and differ in the number, the chosen one being right. Each pair's common token
prefix (the document, the question and that opening) runs once in PrefixFlowDPOTrainer. The script prints each
trainer's median step time (the device synchronised, Phase C inside) and the largest difference between their
per-step losses.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile

from datasets import Dataset
from trl import DPOConfig, DPOTrainer

import synthetic  # beside this script
from step_timing import StepTimer
from hf_prefixflow import PrefixFlowDPOConfig, PrefixFlowDPOTrainer

TRAINERS = {"stock": (DPOTrainer, DPOConfig), "prefixflow": (PrefixFlowDPOTrainer, PrefixFlowDPOConfig)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["both", *TRAINERS], default="both")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--passages", type=int, default=40, help="passages per document (9 tokens each)")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per microbatch")
    parser.add_argument("--hidden", type=int, default=128, help="tiny model width")
    parser.add_argument("--layers", type=int, default=4, help="tiny model depth")
    parser.add_argument("--bf16", action="store_true")
    return parser.parse_args(argv)


def make_dataset(rows: int, passages: int, seed: int = 0) -> Dataset:
    """`rows` preference pairs over documents of `passages` passages; columns prompt, chosen, rejected."""
    rng = random.Random(seed)
    numbers = synthetic.NUMBERS
    data = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(rows):
        key = [rng.randrange(len(numbers)) for _ in numbers]  # each door has one key, however often it is named
        doors = [rng.randrange(len(numbers)) for _ in range(passages)]
        text = " ".join(f"passage : the key of door {d} is {key[d]} ." for d in doors)
        asked = rng.choice(doors)
        wrong = rng.choice([n for n in range(len(numbers)) if n != key[asked]])
        opening = f" the key of door {asked} is"
        data["prompt"].append(f"{text} question : what is the key of door {asked} ? answer :")
        data["chosen"].append(f"{opening} {key[asked]} . <eos>")
        data["rejected"].append(f"{opening} {wrong} . <eos>")
    return Dataset.from_dict(data)


def run(name: str, args, tokenizer, model, dataset) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:  # nothing is saved (save_strategy="no")
        return train(name, args, tokenizer, model, dataset, out)


def train(name: str, args, tokenizer, model, dataset, out: str) -> list[dict]:
    trainer_cls, config_cls = TRAINERS[name]
    config = config_cls(output_dir=out, max_steps=args.steps, learning_rate=1e-4,
                        per_device_train_batch_size=args.batch_size, logging_steps=1, report_to="none",
                        save_strategy="no", bf16=args.bf16, seed=0, disable_tqdm=True,
                        max_length=None)  # TRL's default, 1024, would drop the long documents
    # A random-init model has no checkpoint to load the reference from: pass a copy.
    trainer = trainer_cls(model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    for log, seconds in zip(logs, timer.times):
        log["step_s"] = seconds
    return logs


def summarize(results: dict[str, list[dict]], bf16: bool = False) -> None:
    print(f"\n{'trainer':<12}{'step s (median)':>17}{'loss (last)':>13}")
    for name, logs in results.items():
        steady = logs[1:] or logs  # the first step carries one-time warm-up
        print(f"{name:<12}{statistics.median(l['step_s'] for l in steady):>17.3f}{logs[-1]['loss']:>13.4f}")
    if len(results) == 2:
        stock, prefixflow = results["stock"], results["prefixflow"]
        speedup = statistics.median(l["step_s"] for l in stock[1:] or stock) / statistics.median(
            l["step_s"] for l in prefixflow[1:] or prefixflow)
        gaps = [abs(s["loss"] - p["loss"]) for s, p in zip(stock, prefixflow)]
        # bf16: the two trainers run different kernels (a pair's prefix once, its suffixes as a wave), whose
        # rounding differs from the first step on and drifts apart over the steps; fp32 stays within 1e-3.
        rtol = 2e-2 if bf16 else 1e-3
        agree = all(g <= 1e-4 + rtol * abs(s["loss"]) for g, s in zip(gaps, stock))
        print(f"step speedup: {speedup:.2f}x; losses {'agree' if agree else 'DIFFER'}: largest difference "
              f"{max(gaps):.2e} over {len(gaps)} steps")
        shared = [l.get("prefixflow/tokens_saved", 0.0) for l in prefixflow]
        print(f"prefix tokens run once per microbatch instead of twice: {statistics.mean(shared):.0f}")


def main(argv=None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    tokenizer = synthetic.make_tokenizer()
    model = synthetic.make_model(tokenizer, hidden=args.hidden, layers=args.layers)
    dataset = make_dataset(rows=args.steps * args.batch_size, passages=args.passages)
    names = list(TRAINERS) if args.trainer == "both" else [args.trainer]
    results = {name: run(name, args, tokenizer, copy.deepcopy(model), dataset) for name in names}
    summarize(results, args.bf16)
    return results


if __name__ == "__main__":
    main()
