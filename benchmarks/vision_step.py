"""Whole GRPO steps on image prompts: GRPOTrainer and PrefixFlowGRPOTrainer side by side on one GPU.

    python benchmarks/vision_step.py --out $OUT            # H200: Qwen2.5-VL-3B shape, bf16, the default grid
    python benchmarks/vision_step.py --tiny --out /tmp/vision_step   # CPU: a tiny Qwen2-VL, about a minute

Each prompt holds `--images` images of `--image-tokens` tokens each (square images of 28 * sqrt(tokens) pixels:
1,024 tokens, 4,096 patches at 896 pixels) and `--text` words; each of its `--n` completions is `--completion`
random tokens (generation replaced by fixed completions, the same for both trainers, so a step is the actor update:
TRL's scoring and bookkeeping, the forwards and backwards, Phase C, the optimizer step). Both trainers run in one
process on the same random-init model (built again with the same seed for each), the same prompts and rewards, with
a plain `GRPOConfig`: bf16, beta 0, one group per optimizer step (`per_device_train_batch_size` = N), activation
checkpointing as `--checkpointing` says. Steps are timed as `trainer_step.py` times them (`StepTimer`: from
`on_step_begin` to `on_step_end`, CUDA-synchronised on both sides); each row gives the median of `--steps` steps
after `--warmup`, the peak allocated memory, and the FLOP ratio of a group: N full sequences (the vision tower run
once per completion) over PrefixFlow's one prompt pass (the tower once) and N suffix passes.

Rows go to `vision_step.json`, `.md` and a generated `MANIFEST.md` in `--out` (default
`benchmarks/results/<today>_vision_step/`; `harness.RunFolder`); `--profile` profiles one step per trainer instead
(`vision_step_profile.json` / `.md`: trainer_step.py's phase ranges, GPU-busy time, the operators by host time);
`--tower` writes `vision_tower.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys
import random
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from trl import GRPOConfig, GRPOTrainer

from hf_prefixflow import PrefixFlowGRPOTrainer
from hf_prefixflow.planning.flops import ModelShape
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import synthetic_vision  # noqa: E402 - the examples' synthetic task

import harness  # noqa: E402 - benchmarks/harness.py
from trainer_step import profile_markdown, profiled_step, release, train_measured  # noqa: E402

TRAINERS = {"stock": GRPOTrainer, "prefixflow": PrefixFlowGRPOTrainer}
PATCH, MERGE = 14, 2  # Qwen2-VL's patch side and the 2x2 merge of patches into one token


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU: a tiny Qwen2-VL and small images")
    parser.add_argument("--images", type=int, default=4, help="images per prompt")
    parser.add_argument("--image-tokens", type=int, default=1024, help="tokens per image (a square number)")
    parser.add_argument("--text", type=int, default=500, help="text words per prompt")
    parser.add_argument("--completion", type=int, default=512, help="tokens per completion")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--checkpointing", choices=["on", "off", "both"], default="on")
    parser.add_argument("--trainers", default="stock,prefixflow")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="profile one step after --warmup per trainer instead of timing (trainer_step.py's ranges)")
    parser.add_argument("--tower", action="store_true",
                        help="time the vision tower's forward and backward on one prompt's images and on N prompts' "
                             "(checkpointed as TRL runs it) instead of whole steps: its share of the stock step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--commit", default=None, help="recorded commit (default: harness.git_commit)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results/<today>_vision_step)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.image_tokens, args.text, args.completion = min(args.image_tokens, 16), min(args.text, 40), 16
        args.n, args.steps = min(args.n, 4), min(args.steps, 2)
    if math.isqrt(args.image_tokens) ** 2 != args.image_tokens:
        parser.error("--image-tokens must be a square number (square images)")
    return args


def image_size(args) -> int:
    return PATCH * MERGE * math.isqrt(args.image_tokens)


def build_model(processor, tiny: bool) -> torch.nn.Module:
    """A random-init model with the processor's special-token ids: Qwen2.5-VL-3B's shape (bf16, SDPA), built on the
    GPU, the same seed for both trainers; a tiny Qwen2-VL with `--tiny`."""
    if tiny:
        return synthetic_vision.make_model(processor, hidden=64, layers=2)
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu"),
        tie_word_embeddings=True, **ids)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: minutes less
        return Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)


def dataset(args, rows: int) -> Dataset:
    """`rows` prompts of `--images` shape images and `--text` words."""
    rng = random.Random(0)
    words, size = synthetic_vision.WORDS, image_size(args)
    prompts, images = [], []
    for _ in range(rows):
        drawn = [synthetic_vision.draw(rng.choice(list(synthetic_vision.COLOURS)), rng.choice(synthetic_vision.SHAPES),
                                       size, rng) for _ in range(args.images)]
        text = " " + " ".join(rng.choice(words) for _ in range(args.text)) + " "
        prompts.append([{"role": "user", "content": [{"type": "image"} for _ in drawn] + [{"type": "text",
                                                                                          "text": text}]}])
        images.append(drawn)
    return Dataset.from_dict({"prompt": prompts, "images": images, "answer": ["red square"] * rows})


def fixed_completions(trainer, processor, length: int) -> None:
    """Generation replaced by random completions of `length` word tokens (no EOS, no special token)."""
    rng, words = random.Random(0), range(len(synthetic_vision.SPECIALS), len(processor.tokenizer))

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [[rng.choice(words) for _ in range(length)] for _ in prompt_ids], None

    trainer._generate_single_turn = generate


def make_trainer(name: str, args, checkpointing: bool):
    processor = synthetic_vision.make_processor(patch=PATCH, image_size=image_size(args))
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.warmup + args.steps, per_device_train_batch_size=args.n,
        num_generations=args.n, max_completion_length=args.completion, gradient_checkpointing=checkpointing,
        bf16=cuda, use_cpu=not cuda, learning_rate=1e-6, beta=0.0, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0)
    rewards = random.Random(1)
    trainer = TRAINERS[name](
        model=build_model(processor, args.tiny), args=config, processing_class=processor,
        reward_funcs=lambda completions, **kwargs: [rewards.random() for _ in completions],
        train_dataset=dataset(args, args.warmup + args.steps + 1))
    trainer.remove_callback(PrinterCallback)
    fixed_completions(trainer, processor, args.completion)
    return trainer


def timed_image_processing(trainer) -> list[float]:
    """Host seconds in the image processor, one entry per step (TRL runs it on every row's images, twice a step:
    tokenizing the prompts for generation and again for the forward's tensors)."""
    seconds, processor = [], trainer.processing_class.image_processor
    preprocess, spent = processor.preprocess, [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return preprocess(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    class PerStep(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            spent[0] = 0.0

        def on_step_end(self, *args, **kwargs):
            seconds.append(spent[0])

    processor.preprocess = timed
    trainer.add_callback(PerStep())
    return seconds


def run(name: str, args, checkpointing: bool) -> dict:
    trainer = make_trainer(name, args, checkpointing)
    processing = timed_image_processing(trainer)
    result, logs = train_measured(trainer, args.warmup)
    result.update(groups=sum(log.get("prefixflow/groups", 0) for log in logs), flops=group_flops(trainer.model, args),
                  processing=processing[args.warmup:])
    print(f"{name}: steps {result['warmup_steps']} + {result['steps']} s, image processor {processing} s", flush=True)
    release(trainer)
    return result


def group_flops(model, args) -> dict[str, float]:
    """Training FLOPs of one group: N full sequences, and PrefixFlow's prompt pass plus N suffix passes, vision
    tower included (once per completion in the first, once in the second)."""
    prompt = args.images * args.image_tokens + args.text + 6  # the chat template's tokens around the text
    shape = ModelShape.from_config(model.config)
    vision = args.images * tower_flops(model, args.image_tokens * MERGE * MERGE)
    suffixes = [args.completion] * args.n
    return {"stock": args.n * vision + shape.full_sequence(prompt, suffixes),
            "prefixflow": vision + shape.prefixflow(prompt, suffixes), "vision_share_stock": args.n * vision
            / (args.n * vision + shape.full_sequence(prompt, suffixes))}


def tower_flops(model, patches: int) -> float:
    """Training FLOPs (3x forward) of the vision tower on one image of `patches` patches: every block's matrix
    multiplies per patch, attention within windows (Qwen2.5-VL: `window_size` pixels square) or the whole image
    (`fullatt_block_indexes`; every block in Qwen2-VL), the patch embedding and the merger."""
    visual = model.model.visual
    config = visual.config
    window = getattr(config, "window_size", None)
    window_patches = (window // config.patch_size) ** 2 if window else patches
    full = set(getattr(config, "fullatt_block_indexes", range(len(visual.blocks))))
    width = config.embed_dim if hasattr(config, "embed_dim") else config.hidden_size
    flops = 6 * _matmul_weights(visual.patch_embed) * patches + 6 * _matmul_weights(visual.merger) * patches // 4
    for index, block in enumerate(visual.blocks):
        span = patches if index in full else min(window_patches, patches)
        flops += 6 * _matmul_weights(block) * patches + 12 * width * patches * span
    return flops


def _matmul_weights(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def measure(args, checkpointing: bool, environment: dict) -> dict:
    runs = {name: run(name, args, checkpointing) for name in args.trainers.split(",")}
    flops = next(iter(runs.values()))["flops"]
    row = {"model": "tiny-qwen2-vl" if args.tiny else "qwen2.5-vl-3b", "images": args.images,
           "image_tokens": args.image_tokens, "text_words": args.text, "S": args.completion, "N": args.n,
           "checkpointing": checkpointing, "flop_ratio": round(flops["stock"] / flops["prefixflow"], 3),
           "vision_flop_share_stock": round(flops["vision_share_stock"], 3)}
    for name, result in runs.items():
        row[f"{name}_s"] = round(statistics.median(result["steps"]), 4)
        row[f"{name}_steps_s"] = [round(t, 4) for t in result["steps"]]
        row[f"{name}_generation_s"] = round(statistics.median(result["generation"]), 4)
        row[f"{name}_image_processing_s"] = round(statistics.median(result["processing"]), 4)
        row[f"{name}_peak_gib"] = None if result["peak_gib"] is None else round(result["peak_gib"], 2)
    if "prefixflow" in runs:
        row["prefixflow_groups"] = runs["prefixflow"]["groups"]
        row["prefixflow_fallback_rows"] = runs["prefixflow"]["fallback_rows"]
    row["speedup"] = round(row["stock_s"] / row["prefixflow_s"], 3) if len(runs) == 2 else None
    if len(runs) == 2:  # per step pair: the timed steps ran the same prompts on both sides
        row["step_speedups"] = [round(a / b, 3) for a, b in zip(row["stock_steps_s"], row["prefixflow_steps_s"])]
    row.update(warmup=args.warmup, timed_steps=args.steps, **environment)
    return row


def table(rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = [f"Median of {first['timed_steps']} steps after {first['warmup']}.", "",
             "| model | images x tokens | text words | S | N | checkpointing | stock s | PrefixFlow s | speedup "
             "| FLOP ratio (vision share) | image processor s stock / PF | peak GiB stock / PF "
             "| shared groups / fallback rows |",
             "| --- " * 13 + "|"]
    for r in rows:
        peaks = f"{r.get('stock_peak_gib')} / {r.get('prefixflow_peak_gib')}"
        lines.append(f"| {r['model']} | {r['images']} x {r['image_tokens']} | {r['text_words']} | {r['S']} | "
                     f"{r['N']} | {'on' if r['checkpointing'] else 'off'} | {r.get('stock_s', '-')} | "
                     f"{r.get('prefixflow_s', '-')} | {r['speedup'] or '-'}x | {r['flop_ratio']}x "
                     f"({r['vision_flop_share_stock']:.0%}) | {r.get('stock_image_processing_s', '-')} / "
                     f"{r.get('prefixflow_image_processing_s', '-')} | {peaks} "
                     f"| {r.get('prefixflow_groups', '-')} / {r.get('prefixflow_fallback_rows', '-')} |")
    return lines


def profile(args, run: harness.RunFolder) -> None:
    """`--profile`: each trainer's step after `--warmup`, under the torch profiler (checkpointing off only when
    `--checkpointing off`)."""
    args.steps = 1
    checkpointing = args.checkpointing != "off"
    rows, ops = [], {}
    for name in args.trainers.split(","):
        trainer = make_trainer(name, args, checkpointing)
        phases, ops[name] = profiled_step(trainer, args.warmup)
        release(trainer)
        rows += [{"trainer": name, **r} for r in phases]
    meta = {"command": run.command, **run.environment}
    text = profile_markdown(f"One step after {args.warmup}.", rows, ops)
    run.write({"meta": meta, "phases": rows, "top_ops": ops}, text.splitlines())
    print(text, flush=True)


def tower(args, run: harness.RunFolder) -> dict:
    """`--tower`: seconds of the vision tower's forward and backward (TRL's checkpointing) on one prompt's images,
    as PrefixFlow's Phase A runs it, and on N prompts' images, as the stock microbatch does; median of 3 after one,
    each timing printed as it ends."""
    processor = synthetic_vision.make_processor(patch=PATCH, image_size=image_size(args))
    model = build_model(processor, args.tiny)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    images = dataset(args, 1)[0]["images"]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    device = next(model.parameters()).device
    pixels, grid = inputs["pixel_values"].to(device, torch.bfloat16 if device.type == "cuda" else None), \
        inputs["image_grid_thw"].to(device)
    row = {"images": args.images, "image_tokens": args.image_tokens, "N": args.n, "command": run.command,
           **run.environment}
    for copies in (1, args.n):
        times = []
        for _ in range(4):
            harness.sync()
            start = time.perf_counter()
            embedded = model.model.visual(pixels.repeat(copies, 1), grid_thw=grid.repeat(copies, 1))
            if not isinstance(embedded, torch.Tensor):  # transformers 5.x: the merged tokens are the pooler output
                embedded = embedded.pooler_output if embedded.pooler_output is not None else embedded[0]
            embedded.float().sum().backward()
            harness.sync()
            times.append(time.perf_counter() - start)
            print(f"vision tower, {copies} prompt(s) of images: {times[-1]:.3f} s", flush=True)  # kept if cut short
        model.zero_grad(set_to_none=True)
        row[f"tower_s_{copies}_prompts"] = round(statistics.median(times[1:]), 4)
    run.write(row)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = args.out or f"benchmarks/results/{datetime.date.today().isoformat()}_vision_step"
    tag = "vision_step_profile" if args.profile else "vision_tower" if args.tower else None
    run, rows = harness.RunFolder("vision_step", out, tag, argv), []
    if args.commit:
        run.environment["commit"] = args.commit
    if args.profile:
        profile(args, run)
        return rows
    if args.tower:
        return [tower(args, run)]
    for checkpointing in {"on": [True], "off": [False], "both": [True, False]}[args.checkpointing]:
        rows.append(measure(args, checkpointing, run.environment))
        run.write(rows, table(rows))
        print(json.dumps(rows[-1]))
    harness.sync()
    return rows


if __name__ == "__main__":
    main()
