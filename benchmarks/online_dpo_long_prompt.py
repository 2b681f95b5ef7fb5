"""Long-prompt Online DPO: TRL's OnlineDPOTrainer and PrefixFlowOnlineDPOTrainer, whole-step times.

    python benchmarks/online_dpo_long_prompt.py --passages 700 --hidden 2048 --layers 16 --bf16   # GPU

Generation is replaced in both trainers by the same frozen completions (random tokens, `--completion` long, half of
them ending early on EOS), so the steps time what the trainers differ in: the two scoring passes, the loss, the
backward and Phase C. The model is random-init from a config; the prompts are synthetic documents of `--passages`
passages (about 10 tokens each). With `--out`, the row (medians over the steps after the first, each step's seconds
and losses, PrefixFlow's logged metrics) also goes to `online_dpo_long_prompt.json`, `.md` and a generated
`MANIFEST.md` there (`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile

import torch
from datasets import Dataset
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.experimental.utils import truncate_right

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import synthetic  # noqa: E402
from step_timing import StepTimer  # noqa: E402

import harness  # noqa: E402 - benchmarks/harness.py
from hf_prefixflow import PrefixFlowOnlineDPOTrainer  # noqa: E402

TRAINERS = {"stock": OnlineDPOTrainer, "prefixflow": PrefixFlowOnlineDPOTrainer}


def make_dataset(rows: int, passages: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    numbers = synthetic.NUMBERS
    prompts = []
    for _ in range(rows):
        text = " ".join(f"passage : the key of door {rng.randrange(len(numbers))} is {rng.randrange(len(numbers))} ."
                        for _ in range(passages))
        prompts.append(f"{text} question : what is the key of door {rng.randrange(len(numbers))} ? answer :")
    return Dataset.from_dict({"prompt": prompts})


def reward(completions, **kwargs) -> list[float]:
    return [float(len(c.split()) % 5) for c in completions]


def freeze_generation(trainer, length: int) -> None:
    tokenizer, calls = trainer.processing_class, {"n": 0}
    vocab = len(tokenizer)

    def generate(model, prompts, images=None):
        calls["n"] += 1
        device = next(model.parameters()).device
        batch = tokenizer(text=list(prompts), return_tensors="pt", padding=True, padding_side="left",
                          add_special_tokens=False)
        rng = random.Random(calls["n"])
        rows = []
        for index in range(2 * len(prompts)):
            tokens = [rng.randrange(3, vocab) for _ in range(length)]
            if index % 2:
                tokens[rng.randrange(length // 2, length)] = tokenizer.eos_token_id
            rows.append(tokens)
        ids, mask = truncate_right(torch.tensor(rows), tokenizer.eos_token_id, tokenizer.pad_token_id)
        return (batch["input_ids"].repeat(2, 1).to(device), batch["attention_mask"].repeat(2, 1).to(device),
                ids.to(device), mask.to(device), None)

    trainer._generate = generate


def run(name: str, args, tokenizer, model, dataset) -> tuple[list[float], list[dict]]:
    with tempfile.TemporaryDirectory() as out:
        config = OnlineDPOConfig(output_dir=out, max_steps=args.steps, learning_rate=1e-6, logging_steps=1,
                                 per_device_train_batch_size=args.batch_size, report_to="none", save_strategy="no",
                                 bf16=args.bf16, seed=0, disable_tqdm=True, max_new_tokens=args.completion,
                                 max_length=args.completion + 12 * args.passages + 64)
        trainer = TRAINERS[name](model=model, ref_model=copy.deepcopy(model), reward_funcs=reward, args=config,
                                 train_dataset=dataset, processing_class=tokenizer)
        freeze_generation(trainer, args.completion)
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
        return timer.times, [log for log in trainer.state.log_history if "loss" in log]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--passages", type=int, default=40)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2, help="prompts per microbatch (two completions each)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", default=None, help="a run folder for the row (default: print only)")
    args = parser.parse_args(argv)
    tokenizer = synthetic.make_tokenizer()
    model = synthetic.make_model(tokenizer, hidden=args.hidden, layers=args.layers)
    model.config.max_position_embeddings = 32768
    if torch.cuda.is_available():
        model = model.to("cuda")
    dataset = make_dataset(args.steps * args.batch_size, args.passages)
    results = {name: run(name, args, tokenizer, copy.deepcopy(model), dataset) for name in TRAINERS}
    for name, (times, logs) in results.items():
        steady = times[1:] or times
        extra = {k: round(v, 4) for k, v in logs[-1].items() if k.startswith("prefixflow/")}
        print(f"{name:<11} step s (median) {statistics.median(steady):.3f}  loss {[round(l['loss'], 4) for l in logs]}"
              f"  {extra}")
    stock, pf = (statistics.median(results[n][0][1:] or results[n][0]) for n in TRAINERS)
    print(f"speedup {stock / pf:.2f}x")
    if args.out:
        folder = harness.RunFolder("online_dpo_long_prompt", args.out, argv=argv)
        row = {k: getattr(args, k)
               for k in ("passages", "completion", "batch_size", "hidden", "layers", "bf16", "steps")}
        for name, (times, logs) in results.items():
            row.update({f"{name}_s": round(statistics.median(times[1:] or times), 4),
                        f"{name}_steps_s": [round(t, 4) for t in times],
                        f"{name}_losses": [log["loss"] for log in logs]})
        row.update(speedup=round(stock / pf, 3), prefixflow_metrics={
            k: v for k, v in results["prefixflow"][1][-1].items() if k.startswith("prefixflow/")}, **folder.environment)
        folder.write([row], ["Median of the steps after the first.", "",
                          "| passages | completion | batch | hidden x layers | stock s | PrefixFlow s | speedup |",
                          "| --- " * 7 + "|",
                          f"| {row['passages']} | {row['completion']} | {row['batch_size']} | {row['hidden']} x "
                          f"{row['layers']} | {row['stock_s']} | {row['prefixflow_s']} | {row['speedup']}x |"])


if __name__ == "__main__":
    main()
