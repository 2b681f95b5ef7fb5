"""bf16 equivalence of PrefixFlowDPOTrainer on a GPU: the primary criterion of `criterion.py` on whole DPO steps.

    python benchmarks/dpo_criterion.py --out $OUT                     # GPU: correct, LoRA, and broken variants
    python benchmarks/dpo_criterion.py --tiny --out /tmp/dpo_crit     # CPU smoke test, same checks

Three trainers train the same preference pairs: TRL's `DPOTrainer` in bf16 (the baseline), `PrefixFlowDPOTrainer`
in bf16 (the candidate), both with fp32 master weights under TRL's bf16 autocast, and `DPOTrainer` in fp64 without
autocast (the reference). Each step takes one collated microbatch through each trainer's own `training_step`
(forward, reference pass, loss, backward; Phase C for PrefixFlow), then plain SGD moves the baseline and the
candidate each by its own gradient. At the first and the last step the candidate first takes the baseline's weights,
so both gradients and their one fp64 reference are taken at the same weights (`gpu_equivalence.py` says why);
`drifted_apart` reports how far the two trajectories had gone apart by then. Passes when the worst parameter's
error ratio is at most `criterion.LIMIT`, a parameter's baseline error being the larger of two valid bf16
`DPOTrainer` computations at those weights: the whole microbatch and each pair alone (`criterion.judge`'s
`controls`, as the multi-GPU suite takes a stock engine). One bf16 run's error is a single draw: over the thousands
of parameters of a LoRA model, two valid runs fell 1.154 apart at the worst parameter on an H100 (its control row). The
ratio against the whole-microbatch baseline alone is kept in each row as `strict`.

Pairs: prompts of uneven length, uneven chosen and rejected responses, some opening identically (the shared prefix
reaches into the responses), `--pairs` pairs per microbatch. The reference model is a second copy of the initial
weights, or the PEFT adapter disabled under `--lora` (LoRA on every linear layer; its B matrices start non-zero
so the adapter's gradient reaches its A matrices at step 1). Broken variants (`--broken`, from `criterion.BROKEN`:
`phase-c-skipped`, `drop-layer-gk`) run on the candidate and must fail, judged the same way. A control row per case
judges the two valid bf16 computations against each other at the first step (each pair alone as the candidate, the
whole microbatch as the baseline): how far apart valid runs fall, deciding nothing.
Rows go to `dpo_criterion.json` and `.md` in `--out` after each case; exits with 1
unless every correct row passes and every broken row fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import random
import sys
import tempfile
import time

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

from hf_prefixflow import PrefixFlowDPOConfig, PrefixFlowDPOTrainer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import synthetic  # noqa: E402 - a local word-level tokenizer

import criterion  # noqa: E402 - benchmarks/criterion.py
import harness  # noqa: E402
from gpu_equivalence import SHAPES, copy_weights, drift, grads  # noqa: E402

WORDS = synthetic.TEMPLATE + synthetic.NUMBERS


def preference_pairs(count: int, prompt: int, response: int, seed: int) -> Dataset:
    """`count` pairs: prompts of `prompt/2 .. prompt` words, responses of `response/4 .. response` words, every
    third pair opening both responses with the same few words."""
    rng = random.Random(seed)
    words = lambda n: [rng.choice(WORDS) for _ in range(n)]  # noqa: E731
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(count):
        opening = words(rng.randint(2, 6)) if i % 3 == 2 else []
        chosen = opening + [rng.choice(synthetic.NUMBERS)] + words(rng.randint(response // 4, response))
        rejected = opening + [rng.choice(synthetic.NUMBERS)] + words(rng.randint(response // 4, response))
        if chosen == rejected:
            rejected.append(".")
        rows["prompt"].append(" ".join(words(rng.randint(prompt // 2, prompt))))
        rows["chosen"].append(" " + " ".join(chosen))  # a word boundary: the prompt's tokens stay a prefix
        rows["rejected"].append(" " + " ".join(rejected))
    return Dataset.from_dict(rows)


def build_model(tokenizer, args, dtype: torch.dtype) -> torch.nn.Module:
    shape = {**SHAPES["tiny" if args.tiny else "gpu"], "vocab_size": len(tokenizer)}
    config = LlamaConfig(**shape, head_dim=args.head_dim, max_position_embeddings=8192, attn_implementation="sdpa",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(args.device, dtype)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 (PEFT's start) would give the A matrices no gradient at the first step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def trainer(cls, config_cls, model, tokenizer, dataset, args, bf16: bool, extra: dict | None = None):
    ref_model = None if args.lora else copy.deepcopy(model).eval()
    if ref_model is not None:
        ref_model.requires_grad_(False)
    config = config_cls(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.pairs, max_length=None,
                        bf16=bf16, use_cpu=args.device == "cpu", gradient_checkpointing=args.checkpointing,
                        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, beta=args.beta,
                        **(extra or {}))
    built = cls(model=model, ref_model=ref_model, args=config, processing_class=tokenizer, train_dataset=dataset)
    # What `train()` does before its first `training_step`: the policy's forward under Accelerate's autocast.
    built.model = built.model_wrapped = built.accelerator.prepare_model(built.model)
    built.current_gradient_accumulation_steps = 1
    return built


def step_gradients(trainer, inputs) -> tuple[float, dict]:
    """One microbatch through the trainer's `training_step`; (loss, every parameter's gradient)."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, dict(inputs))
    return loss.item(), grads(trainer.model)


def each_pair_alone(trainer, inputs) -> dict:
    """The microbatch's gradient as each pair alone through `trainer`, the mean over pairs (as TRL's loss is): a
    second valid bf16 computation of the same gradient."""
    pairs = inputs["input_ids"].shape[0] // 2
    total = {}
    for i in range(pairs):
        rows = torch.tensor([i, pairs + i])
        part = {k: v[rows.to(v.device)] if torch.is_tensor(v) and v.shape[:1] == (2 * pairs,) else v
                for k, v in inputs.items()}
        for name, grad in step_gradients(trainer, part)[1].items():
            if grad is not None:
                total[name] = total.get(name, 0) + grad / pairs
    return total


def run_case(args, variant: str | None) -> list[dict]:
    tokenizer = synthetic.make_tokenizer()
    dataset = preference_pairs(args.pairs * args.steps, args.prompt, args.response, args.seed)
    model = build_model(tokenizer, args, torch.float32)
    if args.lora:
        model = with_lora(model)
    reference_model, candidate_model = copy.deepcopy(model).to(torch.float64), copy.deepcopy(model)  # before TRL
    baseline = trainer(DPOTrainer, DPOConfig, model, tokenizer, dataset, args, bf16=True)       # adds its adapters
    candidate = trainer(PrefixFlowDPOTrainer, PrefixFlowDPOConfig, candidate_model, tokenizer, dataset, args,
                        bf16=True, extra={"prefixflow_min_prefix_tokens": 2, "prefixflow_min_speedup": 0.0})
    reference = trainer(DPOTrainer, DPOConfig, reference_model, tokenizer, dataset, args, bf16=False)
    batches = iter(baseline.get_train_dataloader())
    start = [p.detach().clone() for p in baseline.model.parameters()]
    layers = baseline.model.config.num_hidden_layers
    base = {"case": ("LoRA" if args.lora else "full") + (f", {variant}" if variant else ""),
            "variant": variant or "correct", "pairs": args.pairs, "prompt_words": args.prompt,
            "response_words": args.response}
    rows = []
    with criterion.variant(variant, layers) as used:
        for step in range(1, args.steps + 1):
            inputs = next(batches)
            checked = step in (1, args.steps)
            row = {**base, "step": step, **drift(baseline.model, candidate.model, start)} if checked else None
            if checked:
                copy_weights(candidate.model, baseline.model)
            base_loss, g_base = step_gradients(baseline, inputs)
            pf_loss, g_pf = step_gradients(candidate, inputs)
            if checked:
                copy_weights(reference.model, baseline.model)
                with torch.autocast(args.device, enabled=False):
                    _, truth = step_gradients(reference, inputs)
                alone = each_pair_alone(baseline, inputs)
                strict = criterion.judge(g_pf, g_base, truth)
                fallbacks = sum(candidate._fallbacks.values())
                judged = criterion.judge(g_pf, g_base, truth, controls=((alone, truth),))
                rows.append({**row, "loss": [base_loss, pf_loss], "tokens": int(inputs["attention_mask"].sum()),
                             "fallback_rows": fallbacks, **judged,
                             "strict": {k: strict[k] for k in ("worst_ratio", "worst_param", "passed")}})
            with torch.no_grad():  # plain SGD: each side by its own gradient
                for model, g in ((baseline.model, g_base), (candidate.model, g_pf)):
                    for name, param in model.named_parameters():
                        if g.get(name) is not None:
                            param.add_(g[name], alpha=-args.lr)
    if variant and not used["calls"]:
        return [{**base, "passed": False, "error": f"variant {variant} never applied"}]
    return rows


def control_row(args) -> dict:
    """Two valid bf16 computations of one step of DPOTrainer, judged like a candidate: the microbatch as each pair
    alone (its gradient the mean over pairs, as TRL's loss is) against the whole microbatch. How far apart valid
    runs fall under the criterion; decides nothing (`passed` None)."""
    tokenizer = synthetic.make_tokenizer()
    dataset = preference_pairs(args.pairs, args.prompt, args.response, args.seed)
    model = build_model(tokenizer, args, torch.float32)
    if args.lora:
        model = with_lora(model)
    reference_model = copy.deepcopy(model).to(torch.float64)
    baseline = trainer(DPOTrainer, DPOConfig, model, tokenizer, dataset, args, bf16=True)
    reference = trainer(DPOTrainer, DPOConfig, reference_model, tokenizer, dataset, args, bf16=False)
    inputs = next(iter(baseline.get_train_dataloader()))
    _, whole = step_gradients(baseline, inputs)
    split = each_pair_alone(baseline, inputs)
    with torch.autocast(args.device, enabled=False):
        _, truth = step_gradients(reference, inputs)
    row = {"case": ("LoRA" if args.lora else "full") + ", control: each pair alone vs the microbatch",
           "variant": "control", "step": 1, "tokens": int(inputs["attention_mask"].sum()), "drifted_apart": 0.0,
           "fallback_rows": 0, **criterion.judge(split, whole, truth)}
    row["passed"] = None
    return row


def write(run: harness.RunFolder, args, rows: list[dict]) -> bool:
    good = all(criterion.as_expected(r, r["variant"] in criterion.BROKEN) for r in rows)
    lines = [f"Pairs of prompts up to {args.prompt} words and responses up to {args.response}, {args.pairs} per "
             f"microbatch, head dim {args.head_dim}, checkpointing {args.checkpointing}, SGD lr {args.lr:g}, "
             f"{args.steps} steps. Primary: per parameter, PrefixFlowDPOTrainer's gradient error against the fp64 "
             f"DPOTrainer gradient over the larger of two bf16 DPOTrainer computations' (the microbatch, each pair "
             f"alone), at most {criterion.LIMIT} for the worst parameter, at the baseline's weights; `strict`: over "
             "the microbatch's alone.", "",
             "| case | step | tokens | worst ratio (parameter) | median ratio | median rel err baseline / PrefixFlow "
             "| strict worst ratio | drifted apart | fallback rows | verdict |", "| --- " * 10 + "|"]
    for r in rows:
        strict = criterion.format_ratio(r["strict"]["worst_ratio"]) if "strict" in r else "-"
        cells = ([r["case"], "-", "-", r["error"][:100], "-", "-", "-", "-", "-"] if "error" in r else
                 [r["case"], str(r["step"]), str(r["tokens"]), *criterion.judged_cells(r), strict,
                  f"{r['drifted_apart']:.3f}", str(r["fallback_rows"])])
        lines.append("| " + " | ".join(cells + [r["verdict"]]) + " |")
    lines += ["", f"Every correct row passes and every broken row fails: {'yes' if good else 'NO'}"]
    run.write(rows, lines, title=f"DPO bf16 equivalence on {run.environment['gpu']}")
    return good


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=None, help="longest prompt in words (default 1536; --tiny 48)")
    parser.add_argument("--response", type=int, default=None, help="longest response (default 256; --tiny 12)")
    parser.add_argument("--pairs", type=int, default=2, help="pairs per microbatch")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps, checked at the first and the last")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.03; --tiny 0.1)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="TRL's default gradient checkpointing off on all three trainers")
    parser.add_argument("--cases", default="full,lora", help="full, lora or full,lora")
    parser.add_argument("--broken", default=",".join(criterion.BROKEN[:2]),
                        help="broken variants run on the full case, each must fail")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="leave out the control rows (each pair alone vs the microbatch, stock bf16)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    for key, (gpu, cpu) in dict(prompt=(1536, 48), response=(256, 12), lr=(0.03, 0.1)).items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if args.tiny else gpu)
    torch.set_float32_matmul_precision("highest")  # no TF32 in the reference
    run = harness.RunFolder("dpo_criterion", args.out, argv=argv, gpu=None if args.device == "cuda" else "cpu")
    cases = [(case == "lora", "control") for case in args.cases.split(",")] if args.control else []
    cases += [(case == "lora", None) for case in args.cases.split(",")]
    cases += [(False, v) for v in args.broken.split(",") if v]
    rows, good = [], True
    for lora, variant in cases:
        args.lora = lora
        start = time.perf_counter()
        try:
            case = [control_row(args)] if variant == "control" else run_case(args, variant)
        except Exception as exc:  # reported, not hidden
            case = [{"case": "LoRA" if lora else "full", "variant": variant or "correct", "passed": False,
                     "error": f"{type(exc).__name__}: {exc}"[:400]}]
        for row in case:
            broken = variant not in (None, "control")
            row.update(verdict=criterion.verdict(row["passed"], broken, row.get("error")),
                       seconds=round(time.perf_counter() - start, 1), **run.environment)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ratios"}), flush=True)
        good = write(run, args, rows)
    return good


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
