"""Image-text GRPO: the stock TRL trainer and PrefixFlowGRPOTrainer on the same job, side by side.

    python examples/grpo_vision.py                          # both trainers, tiny Qwen2-VL, synthetic shapes task
    python examples/grpo_vision.py --trainer prefixflow     # one of them
    python examples/grpo_vision.py --images 4 --image-size 112   # longer prompts: four larger images each

The only difference between the two runs is the trainer class. The job needs no network: a random-init Qwen2-VL
built from a config, its processor made locally (a word-level tokenizer and Qwen2-VL's image processor), and a
synthetic dataset of coloured shapes drawn with PIL and a question about the first one (the reward checks its colour
and shape words appear in the completion). With PrefixFlow each prompt's images go through the vision tower once per
group instead of once per completion. It prints step time, actor-update time (step minus generation) and reward for
each trainer and the largest difference between their losses, and writes `logs.json` and a PNG of the reward and
loss curves to `grpo_vision_out/<date-time>/` (or `--out`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import pathlib

from trl import GRPOConfig, GRPOTrainer

from grpo_long_prefix import remove_if_empty, summarize
import synthetic_vision  # beside this script
from step_timing import train_timed
from hf_prefixflow import PrefixFlowGRPOTrainer

TRAINERS = {"stock": GRPOTrainer, "prefixflow": PrefixFlowGRPOTrainer}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["both", *TRAINERS], default="both")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--images", type=int, default=2, help="images per prompt")
    parser.add_argument("--image-size", type=int, default=56, help="pixels per side: (size / 28)^2 tokens per image")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--max-completion-length", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=64, help="tiny model width (decoder and vision tower)")
    parser.add_argument("--layers", type=int, default=2, help="tiny model depth (decoder and vision tower)")
    parser.add_argument("--out", help="output folder (default: a new grpo_vision_out/<date-time>/)")
    return parser.parse_args(argv)


def output_folder(out: str | None) -> pathlib.Path:
    if out:
        path = pathlib.Path(out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = pathlib.Path("grpo_vision_out") / stamp, 1
        while path.exists():
            n += 1
            path = path.with_name(f"{stamp}-{n}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(name: str, args, processor, model, dataset) -> list[dict]:
    config = GRPOConfig(
        output_dir=str(pathlib.Path(args.out) / name), max_steps=args.steps, learning_rate=5e-4,
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, logging_steps=1, report_to="none", save_strategy="no",
        bf16=False, seed=0, temperature=1.0, beta=0.0,
        # A sampled image token would mismatch the image features: TRL 1.16 suppresses it itself, 1.14 and 1.15 not.
        generation_kwargs={"suppress_tokens": [model.config.image_token_id]},
    )
    trainer = TRAINERS[name](model=model, reward_funcs=synthetic_vision.shape_reward, args=config,
                             train_dataset=dataset, processing_class=processor)
    logs = train_timed(trainer)
    remove_if_empty(pathlib.Path(trainer.args.output_dir))
    return logs


def main(argv=None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    processor = synthetic_vision.make_processor(image_size=args.image_size)
    model = synthetic_vision.make_model(processor, hidden=args.hidden, layers=args.layers, vision_layers=args.layers)
    dataset = synthetic_vision.make_dataset(rows=args.steps * args.batch_size // args.num_generations + 8,
                                            images=args.images, image_size=args.image_size)
    out = output_folder(args.out)
    args.out = str(out)
    names = list(TRAINERS) if args.trainer == "both" else [args.trainer]
    results = {name: run(name, args, processor, copy.deepcopy(model), dataset) for name in names}
    summarize(results, out)
    return results


if __name__ == "__main__":
    main()
