"""MoE under routing replay on a GPU: a 20-step bf16 trajectory, PrefixFlow vs full-sequence training.

    python benchmarks/gpu_moe_trajectory.py   # writes to benchmarks/results/<today>_moe_trajectory

A random-init Qwen3-MoE (fp32 master weights, bf16 autocast, AdamW) trains 20 rollout groups twice: full sequences
and PrefixFlow. Routes come from an "inference engine" (a perturbed copy of the weights, run in bf16 under no_grad),
the prefix mask from the group's first rollout, and both sides replay the same masks. Reported like the paper's
Table 3: max |difference| of gradients / loss / after-update weights (G/L/W) at steps 1, 10 and 20, and whether
every element stays within |x-y| <= 1e-3 + 1e-2 max(|x|,|y|).
"""

from __future__ import annotations

import argparse
import datetime
import copy
import json
import pathlib
import time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_prefixflow
from hf_prefixflow.moe import record_routing


def build() -> torch.nn.Module:
    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, decoder_sparse_step=1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).cuda().train()
    model.set_attn_implementation("sdpa")
    return hf_prefixflow.apply_prefixflow(model)


def rollout(engine, prompt, completions):
    routes = []
    for completion in completions:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), record_routing() as recorder:
            engine(torch.cat([prompt, completion])[None])
        routes.append(recorder.routes(1, engine.config.num_hidden_layers)[:, 0])
    p = len(prompt)
    return routes[0][:, :p], [r[:, p:] for r in routes]


def loss_of(logits, targets, advantage, total):
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
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


def violation(x, y) -> float:
    x, y = x.float(), y.float()
    return ((x - y).abs() / (1e-3 + 1e-2 * torch.maximum(x.abs(), y.abs()))).max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (RL runs use 1e-6..1e-5)")
    parser.add_argument("--tag", default="gpu_moe_trajectory")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_moe_trajectory")
    args = parser.parse_args()

    reference = build()
    candidate = copy.deepcopy(reference)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (reference, candidate)]
    gen = torch.Generator().manual_seed(1)
    report, worst = [], 0.0
    for step in range(1, args.steps + 1):
        engine = copy.deepcopy(reference)
        with torch.no_grad():
            for param in engine.parameters():
                param.add_(1e-3 * torch.randn_like(param))
        prompt = torch.randint(0, 4096, (args.prefix,), generator=gen).cuda()
        completions = [torch.randint(0, 4096, (int(torch.randint(args.suffix // 4, args.suffix + 1, (1,),
                                                                   generator=gen)),), generator=gen).cuda()
                       for _ in range(args.n)]
        advantages = torch.randn(args.n, generator=gen).tolist()
        prefix_routes, suffix_routes = rollout(engine, prompt, completions)
        del engine
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = full_sequence(reference, prompt, completions, advantages, prefix_routes, suffix_routes)
            pf_loss = prefixflow(candidate, prompt, completions, advantages, prefix_routes, suffix_routes)
        grads = [(a.grad, b.grad) for a, b in zip(reference.parameters(), candidate.parameters()) if a.grad is not None]
        g = max((x - y).abs().max().item() for x, y in grads)
        g_ratio = max(violation(y, x) for x, y in grads)
        for opt in optimizers:
            opt.step()
        weights = list(zip(reference.parameters(), candidate.parameters()))
        w = max((x - y).abs().max().item() for x, y in weights)
        w_ratio = max(violation(y, x) for x, y in weights)
        l_ratio = violation(torch.tensor(pf_loss), torch.tensor(ref_loss))
        worst = max(worst, g_ratio, w_ratio, l_ratio)
        row = {"step": step, "G": g, "L": abs(pf_loss - ref_loss), "W": w, "G_ratio": g_ratio, "L_ratio": l_ratio,
               "W_ratio": w_ratio}
        report.append(row)
        print(json.dumps(row), flush=True)

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "lr": args.lr, "P": args.prefix, "S_max": args.suffix, "N": args.n,
            "passed": worst <= 1.0, "worst_ratio_to_tolerance": worst}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps({"config": meta, "steps": report}, indent=1))
    pick = {r["step"]: r for r in report if r["step"] in (1, 10, 20)}
    cells = " | ".join(f"{pick[s]['G']:.1e} / {pick[s]['L']:.1e} / {pick[s]['W']:.1e}" for s in sorted(pick))
    lines = [f"# MoE routing replay, bf16 trajectory on {meta['gpu']} ({meta['date']})", "",
             f"`python benchmarks/gpu_moe_trajectory.py --lr {args.lr:g}` — Qwen3-MoE shape (4 layers, 8 experts, top-2), P="
             f"{args.prefix}, suffixes up to {args.suffix}, N={args.n}, AdamW lr {args.lr:g}, both sides replay the same "
             "masks.", "",
             "| model | step 1 G/L/W | step 10 G/L/W | step 20 G/L/W | worst ratio to tolerance | pass |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| Qwen3-MoE (tiny) | {cells} | {worst:.3f} | {'yes' if worst <= 1 else 'NO'} |"]
    (out / f"{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
