"""MoE under routing replay on a GPU: a bf16 trajectory, PrefixFlow vs full-sequence training.

    python benchmarks/gpu_moe_trajectory.py   # writes to benchmarks/results/<today>_moe_trajectory
    python benchmarks/gpu_moe_trajectory.py --tiny --out /tmp/moe       # CPU smoke test: tiny model, 3 steps

A random-init Qwen3-MoE (fp32 master weights, bf16 autocast) trains `--steps` rollout groups twice with plain SGD,
each side from its own gradients: full sequences and PrefixFlow. Routes come from an "inference engine" (a perturbed
copy of the baseline's weights, run in bf16 under no_grad), the prefix mask from the group's first rollout, and both
sides replay the same masks. Primary criterion (`benchmarks/criterion.py`) at the `--check-steps` (1, 10, 20): per
parameter, PrefixFlow's gradient error against the fp64 full-sequence gradient (no autocast, the same routes
replayed) over the baseline's error against it, at most 1.2 for the worst parameter. Before a checked step
PrefixFlow's model takes the baseline's weights (plain SGD keeps no other state), so both gradients and their one
fp64 reference are taken at the same weights; how far the trajectories had drifted apart by then is reported. SGD
rather than AdamW, which moves each weight by about the learning rate whatever the gradient. Secondary, reported
only, like the paper's Table 3: max |difference| of gradients / loss / after-update weights (G/L/W) and the worst
ratio to |x-y| <= 1e-3 + 1e-2 max(|x|,|y|). `--broken` runs broken variants (`criterion.BROKEN`; the one-row waves
here are padded, so they reach the split attention), each of which must fail; `--diagnostic concat-attention`
attends over the concatenated K/V instead of the split attention (must pass). Exits with 1 unless every correct and
diagnostic row passes and every broken row fails. Writes `<--tag>.json` (the config and the rows), `.md` and a
generated `MANIFEST.md` to `--out` (`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import criterion
import harness
import hf_prefixflow
from hf_prefixflow.core.moe import record_routing

SHAPES = {
    "gpu": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64),
    # as wide as a GPU model's norms get in gpu_equivalence --tiny: narrow ones scatter the ratio between groups
    "tiny": dict(vocab_size=128, hidden_size=1024, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=64),
}


def build(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen3MoeConfig(**SHAPES[shape], max_position_embeddings=4096, decoder_sparse_step=1)
    if dtype == torch.float64 and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(device, dtype).train()
    model.set_attn_implementation("sdpa")
    return hf_prefixflow.apply_prefixflow(model)  # both sides and the reference replay routes through it


def rollout(engine, prompt, completions, device):
    routes = []
    for completion in completions:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16), record_routing() as recorder:
            engine(torch.cat([prompt, completion])[None])
        routes.append(recorder.routes(1, engine.config.num_hidden_layers)[:, 0])
    p = len(prompt)
    return routes[0][:, :p], [r[:, p:] for r in routes]


def loss_of(logits, targets, advantage, total):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 log-probs, fp64 in the reference
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    return -(logp * advantage).sum() / total


def full_sequence(model, prompt, completions, advantages, prefix_routes, suffix_routes):
    total, p = sum(len(c) for c in completions), len(prompt)
    value = 0.0
    for completion, advantage, routes in zip(completions, advantages, suffix_routes):
        replay = torch.cat([prefix_routes, routes], dim=1)[:, None]
        logits = model(torch.cat([prompt, completion])[None], prefixflow_routes=replay).logits[0, p - 1 : -1]
        loss = loss_of(logits, completion, advantage, total)
        loss.backward()
        value += loss.item()
    return value


def prefixflow(model, prompt, completions, advantages, prefix_routes, suffix_routes):
    total = sum(len(c) for c in completions)
    value = 0.0
    with hf_prefixflow.prefix_group(model, prompt, routes=prefix_routes) as group:
        for completion, advantage, routes in zip(completions, advantages, suffix_routes):
            logits = group(completion[None], routes=routes[:, None]).logits[0]
            loss = loss_of(logits, completion, advantage, total)
            loss.backward()
            value += loss.item()
    return value


def grads(model) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def copy_weights(target, source) -> None:
    with torch.no_grad():
        weights = dict(source.named_parameters())
        for name, param in target.named_parameters():
            param.copy_(weights[name])


def reference_grads(reference, model, batch) -> dict:
    """The fp64 full-sequence gradient at `model`'s weights, the same routes replayed (outside autocast)."""
    copy_weights(reference, model)
    reference.zero_grad(set_to_none=True)
    full_sequence(reference, *batch)
    return grads(reference)


def apart(candidate, baseline) -> float:
    """How far PrefixFlow's weights have drifted from the baseline's, relative to the baseline's norm."""
    pairs = list(zip(candidate.parameters(), baseline.parameters()))
    return (sum((p.double() - q.double()).pow(2).sum() for p, q in pairs).sqrt()
            / sum(q.double().pow(2).sum() for _, q in pairs).sqrt()).item()


def trajectory(args, device: str, variant: str | None) -> list[dict]:
    """`args.steps` SGD steps of both sides; a row per checked step."""
    baseline = build(args.shape, device, torch.float32)
    candidate = copy.deepcopy(baseline)
    reference = build(args.shape, device, torch.float64)
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (baseline, candidate)]
    vocab = baseline.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    with criterion.variant(variant, baseline.config.num_hidden_layers) as used:
        for step in range(1, args.steps + 1):
            engine = copy.deepcopy(baseline)
            with torch.no_grad():
                for param in engine.parameters():
                    param.add_(1e-3 * torch.randn_like(param))
            prompt = torch.randint(0, vocab, (args.prefix,), generator=gen).to(device)
            completions = [torch.randint(0, vocab, (int(torch.randint(args.suffix // 4, args.suffix + 1, (1,),
                                                                       generator=gen)),), generator=gen).to(device)
                           for _ in range(args.n)]
            advantages = torch.randn(args.n, generator=gen).tolist()
            batch = (prompt, completions, advantages, *rollout(engine, prompt, completions, device))
            del engine
            drifted = apart(candidate, baseline)
            if step in args.check_steps:
                copy_weights(candidate, baseline)  # judged at the baseline's weights (see the docstring)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                ref_loss = full_sequence(baseline, *batch)
                pf_loss = prefixflow(candidate, *batch)
            g_base, g_pf = grads(baseline), grads(candidate)
            pairs = [(g_base[n], g_pf[n]) for n in g_base if g_base[n] is not None]
            row = {"step": step, "G": max((x - y).abs().max().item() for x, y in pairs), "L": abs(pf_loss - ref_loss),
                   "G_ratio": max(criterion.paper_violation(y, x) for x, y in pairs),
                   "L_ratio": criterion.paper_violation(pf_loss, ref_loss)}
            if step in args.check_steps:
                truth = reference_grads(reference, baseline, batch)
                row.update(drifted_apart=drifted, **criterion.judge(g_pf, g_base, truth))
            for opt in optimizers:
                opt.step()
            weights = list(zip(baseline.parameters(), candidate.parameters()))
            row.update(W=max((x - y).abs().max().item() for x, y in weights),
                       W_ratio=max(criterion.paper_violation(y, x) for x, y in weights))
            if step in args.check_steps:
                row["variant"] = variant or "correct"
                row["verdict"] = criterion.verdict(row["passed"], variant in criterion.BROKEN)
                rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ratios"}), flush=True)
    if variant and not used["calls"]:
        return [{"variant": variant, "passed": False, "error": f"variant {variant} never applied",
                 "verdict": criterion.verdict(False, variant in criterion.BROKEN, "never applied")}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=None, help="default 1024 (--tiny: 64)")
    parser.add_argument("--suffix", type=int, default=None, help="default 256 (--tiny: 16)")
    parser.add_argument("--n", type=int, default=None, help="default 8 (--tiny: 4)")
    parser.add_argument("--steps", type=int, default=None, help="default 20 (--tiny: 3)")
    parser.add_argument("--check-steps", default=None, help="comma-separated; default 1,10,20 (--tiny: 1,3)")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.1; --tiny: 0.1)")
    parser.add_argument("--broken", default="", help="comma-separated broken variants, each must fail: "
                        + ", ".join(criterion.BROKEN))
    parser.add_argument("--diagnostic", default="", help="comma-separated correct variants, each must pass: "
                        + ", ".join(criterion.DIAGNOSTIC))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short groups, 3 steps")
    parser.add_argument("--tag", default="gpu_moe_trajectory")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_moe_trajectory")
    args = parser.parse_args()
    tiny = args.tiny
    defaults = dict(prefix=(1024, 64), suffix=(256, 16), n=(8, 4), steps=(20, 3), check_steps=("1,10,20", "1,3"),
                    lr=(0.1, 0.1))
    for key, (gpu, cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if tiny else gpu)
    args.check_steps = {int(s) for s in args.check_steps.split(",") if int(s) <= args.steps}
    args.shape = "tiny" if tiny else "gpu"
    device = "cpu" if tiny else "cuda"
    variants = [v for v in f"{args.broken},{args.diagnostic}".split(",") if v]
    if unknown := set(variants) - set(criterion.BROKEN + criterion.DIAGNOSTIC):
        parser.error(f"unknown variants {sorted(unknown)}")

    rows = []
    for variant in [None] + variants:
        try:
            rows += trajectory(args, device, variant)
        except Exception as exc:  # reported, not hidden
            error = f"{type(exc).__name__}: {exc}"[:400]
            rows.append({"variant": variant or "correct", "passed": False,
                         "verdict": criterion.verdict(False, variant in criterion.BROKEN, error), "error": error})
    good = all(criterion.as_expected(r, r["variant"] in criterion.BROKEN) for r in rows)
    run = harness.RunFolder("gpu_moe_trajectory", args.out, args.tag, gpu=None if device == "cuda" else "cpu")
    meta = {**run.environment, "lr": args.lr, "P": args.prefix, "S_max": args.suffix, "N": args.n,
            "steps": args.steps, "shape": args.shape, "as_required": good}
    ratio = criterion.format_ratio
    shape = SHAPES[args.shape]
    lines = [f"Qwen3-MoE ({args.shape} shape: {shape['num_hidden_layers']} layers, {shape['num_experts']} experts, "
             f"top-2), P={args.prefix}, suffixes up to {args.suffix}, N={args.n}, {args.steps} SGD steps at lr "
             f"{args.lr:g}, both sides replay the same masks. Primary: per parameter, PrefixFlow's gradient error "
             f"against the fp64 full-sequence gradient over the bf16 baseline's, at most {criterion.LIMIT} for the "
             "worst parameter, "
             "both at the baseline's weights. Secondary (reported only): max |difference| G / L / W and the worst "
             f"ratio to the paper's {criterion.PAPER}.", "",
             "| variant | step | worst ratio (parameter) | median ratio | median rel err baseline / PrefixFlow "
             "| drifted apart | G / L / W | paper ratio G / L / W | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | {r['error'][:100]} | - | - | - | - | - | {r['verdict']} |")
            continue
        lines.append(f"| {r['variant']} | {r['step']} | {ratio(r['worst_ratio'])} ({r['worst_param']}) | "
                     f"{ratio(r['median_ratio'])} | {r['median_err']['baseline']:.2e} / "
                     f"{r['median_err']['candidate']:.2e} | {r['drifted_apart']:.1e} | "
                     f"{r['G']:.1e} / {r['L']:.1e} / {r['W']:.1e} | "
                     f"{r['G_ratio']:.3f} / {r['L_ratio']:.3f} / {r['W_ratio']:.3f} | {r['verdict']} |")
    lines += ["", f"Every correct and diagnostic row passes and every broken row fails: {'yes' if good else 'NO'}"]
    run.write({"config": meta, "rows": rows}, lines, title=f"MoE routing replay, bf16 trajectory on {meta['gpu']}")
    print("\n".join(lines))
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
