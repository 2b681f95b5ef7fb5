"""Trainer-level speed: PrefixFlowGRPOTrainer vs GRPOTrainer actor update (a training step without generation).

    python benchmarks/trainer_speed.py --model qwen3-1.7b --prefix 3840 --completion 200 --n 16 --out benchmarks/results

Both trainers get the same random-init model (shapes from `benchmarks/speed.py`), the same `GRPOConfig` and the same
rollouts: generation is replaced by fixed random completions, so the timed step is the actor update plus TRL's
bookkeeping. The actor update time is TRL's `step_time` minus the time spent in `_generate_and_score_completions`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import statistics
import tempfile
import time

import torch
import transformers
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hf_prefixflow import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer, synthetic
from speed import SHAPES, build


def fake_rollouts(trainer, length: int, vocab: int) -> None:
    rng = random.Random(0)

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in prompt_ids], None

    trainer._generate_single_turn = generate


def run(trainer_cls, args, model, dataset, tokenizer) -> list[float]:
    keep = trainer_cls is PrefixFlowGRPOTrainer and args.keep_suffix_activations
    extra = {"prefixflow_suffix_checkpointing": False} if keep else {}
    config = (PrefixFlowGRPOConfig if keep else GRPOConfig)(
        **extra, output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.n // args.batch, num_generations=args.n,
        max_completion_length=args.completion, logging_steps=1, report_to="none", save_strategy="no",
        bf16=True, learning_rate=1e-6, gradient_checkpointing=args.checkpointing, disable_tqdm=True)
    trainer = trainer_cls(model=model, reward_funcs=lambda completions, **kw: [random.random() for _ in completions],
                          args=config, train_dataset=dataset, processing_class=tokenizer)
    fake_rollouts(trainer, args.completion, len(tokenizer))
    generation = []
    generate = trainer._generate_and_score_completions

    def timed(batch):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(batch)
        torch.cuda.synchronize()
        generation.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    return [s - g for s, g in zip(steps, generation)][1:], torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--prefix", type=int, default=3840, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--n", type=int, default=16, help="num_generations")
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size (a divisor of n)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--keep-suffix-activations", action="store_true",
                        help="PrefixFlow only: prefixflow_suffix_checkpointing=False (with --checkpointing)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="trainer_speed")
    args = parser.parse_args()

    tokenizer = synthetic.make_tokenizer()
    rng = random.Random(0)
    words = synthetic.TEMPLATE + synthetic.NUMBERS
    prompts = [" ".join(rng.choice(words) for _ in range(args.prefix)) for _ in range(args.steps + 2)]
    dataset = Dataset.from_dict({"prompt": prompts})
    prefix_tokens = statistics.mean(len(tokenizer(p)["input_ids"]) for p in prompts)
    times, peaks = {}, {}
    for name, cls in (("stock", GRPOTrainer), ("prefixflow", PrefixFlowGRPOTrainer)):
        model = build(args.model, prefixflow=False)  # the same weights for each trainer
        model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        times[name], peaks[name] = run(cls, args, model, dataset, tokenizer)
        del model
        torch.cuda.empty_cache()
    stock, pf = statistics.median(times["stock"]), statistics.median(times["prefixflow"])
    row = {"model": args.model, "P": round(prefix_tokens), "S": args.completion, "N": args.n, "batch": args.batch,
           "prefix_ratio": round(prefix_tokens / (prefix_tokens + args.completion), 3),
           "checkpointing": args.checkpointing, "keep_suffix_activations": args.keep_suffix_activations,
           "stock_actor_update_s": round(stock, 3),
           "prefixflow_actor_update_s": round(pf, 3), "speedup": round(stock / pf, 2),
           "stock_peak_gib": round(peaks["stock"], 1), "prefixflow_peak_gib": round(peaks["prefixflow"], 1),
           "steps_timed": len(times["stock"]), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "date": datetime.date.today().isoformat()}
    print(json.dumps(row))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()
