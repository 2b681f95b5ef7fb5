"""bf16 equivalence on a GPU: PrefixFlow vs full-sequence training through SDPA's kernels and flex_attention.

    python benchmarks/gpu_equivalence.py   # writes to benchmarks/results/<today>_gpu_equivalence
    python benchmarks/gpu_equivalence.py --paths sdpa-cudnn --broken phase-c-skipped,drop-layer-gk,split-own-stats
    python benchmarks/gpu_equivalence.py --tiny --out /tmp/eq          # CPU smoke test: tiny model, same checks

For each attention path (SDPA restricted to flash, cuDNN or memory-efficient kernels; flex_attention) and each
layout it accepts, two copies of one random-init model (fp32 master weights, bf16 autocast) train the same
rollout groups with plain SGD, each from its own gradients: the baseline runs every `[P || S_i]` as a full
sequence, PrefixFlow runs the group's prefix once.

Primary criterion (`benchmarks/criterion.py`), at step 1 and at the last step (after `--steps - 1` SGD steps): per
parameter, PrefixFlow's gradient error against the fp64 full-sequence gradient (no autocast, SDPA's default kernel)
over the baseline's error against it, at most 1.2 for the worst parameter. Before a checked step PrefixFlow's model
takes the baseline's weights (plain SGD keeps no other state; PrefixFlow's own state, its pools and compiled graphs,
carries on), so both gradients and their one fp64 reference are taken at the same weights: judged each at its own
weights, errors would also differ by where the two trajectories' rounding had taken them. How far the trajectories
had drifted apart by then is reported beside it. SGD rather than AdamW since Adam moves each weight by about the
learning rate whatever the gradient. Secondary, reported and deciding nothing: the paper's element-wise tolerance
|x - y| <= 1e-3 + 1e-2 * max(|x|, |y|) on the loss, every gradient and the weights after each step, worst up to the
row's step.

`--broken` runs deliberately broken variants (`criterion.BROKEN`), each of which must fail the primary criterion:
`phase-c-skipped`, `drop-layer-gk`, `split-own-stats` (only padded `sdpa` waves use the split attention);
`--diagnostic concat-attention` runs padded waves over the concatenated K/V instead of the split attention (must
pass; see `criterion.variant`). A variant that never applied on a path is reported as an error. A control row judges
the baseline run as one padded batch (as TRL runs it) against per sequence: two valid bf16 computations.
Before the models, the split-attention kernels alone (CUDA; skipped with `--no-kernel-check`): output and every
gradient of `split_attention` in bf16 against fp64 attention over the concatenated K/V, at most
`KERNEL_ERROR_RATIO` times as far from it as bf16 SDPA over the concatenated K/V (the baseline's kernel).
`--bf16-weights` trains bf16 weights without autocast instead (gK/gV then sum in bf16, as `param.grad` does);
`--offload` runs PrefixFlow with prefix activation offload (its recomputed layers replay Phase A's attention);
`--offload-kv` with the prompt's K/V and gK/gV streamed from the host as well;
`--compile` compiles every decoder layer of both models; `--checkpointing` checkpoints every decoder layer of both
(non-reentrant, TRL's default); `--head-dim 128` gives the models and the kernel check Qwen3's and Llama3's head size
(64 by default). `--tiny` (CPU): a two-layer model as wide as the GPU one, short groups, `sdpa-default` unless
`--paths` says otherwise. Exits with 1 unless every correct and diagnostic row passes and every broken row fails.
Rows go to `<--tag>.json` and `.md` in `--out` after every case, with a generated `MANIFEST.md` (`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import criterion
import harness
import hf_prefixflow
from hf_prefixflow import _compat
from hf_prefixflow.core import split_attention as split

DEVICE = "cuda"
KERNEL_ERROR_RATIO = 2.0
PATHS = {  # name -> (attention, SDPA backends, layouts, whether the models' K/V heads are as many as the queries')
    "sdpa-default": ("sdpa", None, ("padded", "packed"), False),
    "sdpa-flash": ("sdpa", [SDPBackend.FLASH_ATTENTION], ("padded",), False),
    "sdpa-cudnn": ("sdpa", [SDPBackend.CUDNN_ATTENTION], ("padded",), False),
    # the memory-efficient kernel has no native GQA, which transformers' baseline asks for (`enable_gqa`)
    "sdpa-efficient": ("sdpa", [SDPBackend.EFFICIENT_ATTENTION], ("padded", "packed"), True),
    "flex_attention": ("flex_attention", None, ("padded", "packed"), False),
}
SHAPES = {
    "gpu": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4),
    # as wide as the GPU shape: the bf16 errors of a narrow model's norm weights (a few hundred elements, a few of
    # them carrying most of the error) scatter their ratio by 10-20% between groups
    "tiny": dict(vocab_size=128, hidden_size=1024, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=4),
}


def build_model(attn: str, dtype: torch.dtype, args, mha: bool = False) -> torch.nn.Module:
    shape = dict(SHAPES[args.shape])
    if mha:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    config = LlamaConfig(**shape, head_dim=args.head_dim, max_position_embeddings=8192, attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE, dtype).train()


def random_groups(steps: int, prefix: int, suffix: int, n: int, vocab: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(steps):
        prompt = torch.randint(0, vocab, (prefix,), generator=gen)
        lengths = torch.randint(suffix // 4, suffix + 1, (n,), generator=gen).tolist()
        completions = [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]
        advantages = torch.randn(n, generator=gen)
        groups.append((prompt, completions, advantages))
    return groups


def token_loss(logits, targets, advantage, total_tokens):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 log-probs, fp64 in the reference
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    return -(logp * advantage).sum() / total_tokens


def full_sequence_step(model, group):
    prompt, completions, advantages = group
    total = sum(len(c) for c in completions)
    loss_sum = 0.0
    for completion, advantage in zip(completions, advantages):
        ids = torch.cat([prompt, completion]).to(DEVICE)[None]
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
        loss = token_loss(logits, completion.to(DEVICE), advantage.item(), total)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def batched_full_sequence_step(model, group):
    """The same baseline as one right-padded batch (as TRL runs it): a control for bf16 reordering noise."""
    prompt, completions, advantages = group
    total = sum(len(c) for c in completions)
    width = len(prompt) + max(len(c) for c in completions)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, c in enumerate(completions):
        ids[r, : len(prompt) + len(c)] = torch.cat([prompt, c])
        mask[r, : len(prompt) + len(c)] = 1
    logits = model(ids.to(DEVICE), attention_mask=mask.to(DEVICE), use_cache=False).logits
    p = len(prompt)
    loss = sum(token_loss(logits[r, p - 1 : p - 1 + len(c)], c.to(DEVICE), advantages[r].item(), total)
               for r, c in enumerate(completions))
    loss.backward()
    return loss.item()


def prefixflow_step(model, group, layout: str, wave: int):
    prompt, completions, advantages = group
    total = sum(len(c) for c in completions)
    loss_sum = 0.0
    with hf_prefixflow.prefix_group(model, prompt.to(DEVICE)) as g:
        for start in range(0, len(completions), wave):
            rows = list(range(start, min(start + wave, len(completions))))
            suffixes = [completions[i].to(DEVICE) for i in rows]
            if layout == "packed":
                out = g.packed(suffixes)
                per_row = out.split(out.logits)
            else:
                width = max(len(s) for s in suffixes)
                ids = torch.zeros(len(rows), width, dtype=torch.long, device=DEVICE)
                mask = torch.zeros_like(ids)
                for r, s in enumerate(suffixes):
                    ids[r, : len(s)], mask[r, : len(s)] = s, 1
                logits = g(ids, attention_mask=mask).logits
                per_row = [logits[r, : len(s)] for r, s in enumerate(suffixes)]
            loss = sum(token_loss(lg, s, advantages[i].item(), total) for lg, s, i in zip(per_row, suffixes, rows))
            loss.backward()
            loss_sum += loss.item()
    return loss_sum


def grads(model):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_grads(reference, model, group) -> dict:
    """The fp64 full-sequence gradient at `model`'s current weights (call outside autocast and kernel limits)."""
    copy_weights(reference, model)
    reference.zero_grad(set_to_none=True)
    full_sequence_step(reference, group)
    return grads(reference)


def copy_weights(target, source) -> None:
    with torch.no_grad():
        weights = dict(source.named_parameters())
        for name, param in target.named_parameters():
            param.copy_(weights[name])


def drift(baseline, candidate, start: list[torch.Tensor]) -> dict:
    """How far SGD has moved the baseline's weights from `start` (relative to their norm), and how far PrefixFlow's
    had drifted from them, relative to that move."""
    def norm(tensors):
        return sum(x.double().pow(2).sum() for x in tensors).sqrt().item()

    weights = [p.detach() for p in baseline.parameters()]
    moved = norm(w - s for w, s in zip(weights, start))
    apart = norm(c.detach() - w for c, w in zip(candidate.parameters(), weights))
    return {"weights_moved": moved / norm(start), "drifted_apart": apart / moved if moved else 0.0}


# -- the cases --------------------------------------------------------------------------------------------------

def precision(args):
    """The trained models' weight dtype and the autocast context the bf16 sides run in."""
    if args.bf16_weights:
        return torch.bfloat16, contextlib.nullcontext
    return torch.float32, lambda: torch.autocast(DEVICE, dtype=torch.bfloat16)


def control_row(args) -> dict:
    """Two valid bf16 baselines (per sequence vs one padded batch) under both criteria, at step 1."""
    dtype, autocast = precision(args)
    model = build_model("sdpa", dtype, args)
    reference = build_model("sdpa", torch.float64, args)
    group = random_groups(1, args.prefix, args.suffix, args.n, model.config.vocab_size, args.seed)[0]
    truth = reference_grads(reference, model, group)
    with autocast():
        losses = [full_sequence_step(model, group)]
        per_sequence = grads(model)
        model.zero_grad(set_to_none=True)
        losses.append(batched_full_sequence_step(model, group))
        batched = grads(model)
    row = {"path": "control: baseline as one padded batch vs per sequence", "layout": "-", "variant": "control",
           "step": 1, "weights_moved": 0.0, "drifted_apart": 0.0, **criterion.judge(batched, per_sequence, truth)}
    row["paper"] = {"loss": criterion.paper_violation(losses[1], losses[0]),
                    "grads": max(criterion.paper_violation(batched[n], per_sequence[n]) for n in per_sequence),
                    "weights": 0.0}
    row["passed"] = None  # informative: how far two valid computations are apart
    return row


def run_case(name: str, layout: str, args, variant: str | None) -> list[dict]:
    """One path and layout trained `args.steps` steps; a row per checked step."""
    attn, backends, _, mha = PATHS[name]
    kernels = (lambda: sdpa_kernel(backends)) if backends else contextlib.nullcontext
    dtype, autocast = precision(args)
    baseline = build_model(attn, dtype, args, mha)
    candidate = copy.deepcopy(baseline)
    for model in (baseline, candidate) if args.checkpointing else ():
        _compat.enable_checkpointing(model)
    candidate = hf_prefixflow.apply_prefixflow(candidate, offload=args.offload, offload_kv=args.offload_kv)
    for layer in (layer for model in (baseline, candidate) for layer in model.model.layers) if args.compile else ():
        layer.compile()
    reference = build_model("sdpa", torch.float64, args, mha)
    groups = random_groups(args.steps, args.prefix, args.suffix, args.n, baseline.config.vocab_size, args.seed)
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (baseline, candidate)]
    checked = {1, args.steps}
    start = [p.detach().clone() for p in baseline.parameters()]
    base = {"path": name, "layout": layout, "variant": variant or "correct", "P": args.prefix, "S_max": args.suffix,
            "N": args.n, "wave": args.wave}
    paper, rows = {"loss": 0.0, "grads": 0.0, "weights": 0.0}, []
    with criterion.variant(variant, baseline.config.num_hidden_layers) as used:
        for step, group in enumerate(groups, 1):
            if step in checked:
                row = {**base, "step": step, **drift(baseline, candidate, start)}
                copy_weights(candidate, baseline)  # judged at the baseline's weights (see the docstring)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            with kernels(), autocast():
                base_loss = full_sequence_step(baseline, group)
                pf_loss = prefixflow_step(candidate, group, layout, args.wave)
            g_base, g_pf = grads(baseline), grads(candidate)
            if step in checked:
                row.update(loss=[base_loss, pf_loss],
                           **criterion.judge(g_pf, g_base, reference_grads(reference, baseline, group)))
            for opt in optimizers:
                opt.step()
            paper["loss"] = max(paper["loss"], criterion.paper_violation(pf_loss, base_loss))
            paper["grads"] = max(paper["grads"], max(
                criterion.paper_violation(g_pf[n], g_base[n]) for n in g_base if g_base[n] is not None))
            paper["weights"] = max(paper["weights"], max(
                criterion.paper_violation(p, q) for p, q in zip(candidate.parameters(), baseline.parameters())))
            if step in checked:
                rows.append({**row, "paper": dict(paper)})
    if variant and not used["calls"]:
        return [{**base, "passed": False, "error": f"variant {variant} never applied on this path"}]
    return rows


def kernel_rows(dim: int) -> list[dict]:
    """`split_attention` alone in bf16 (transformers' q/k/v layout, one and three rows) against fp64 attention over
    the concatenated K/V, next to bf16 SDPA over the concatenated K/V, for every kernel this GPU runs."""
    from torch.nn.attention.bias import causal_lower_right

    def concatenated(q, pk, pv, k, v):
        batch = q.shape[0]
        kk, vv = (torch.cat([p.expand(batch, -1, -1, -1), x], 2) for p, x in ((pk, k), (pv, v)))
        return torch.nn.functional.scaled_dot_product_attention(
            q, kk, vv, attn_mask=causal_lower_right(q.shape[2], kk.shape[2]), enable_gqa=True)

    def run(fn, inputs, grad, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach()] + [x.grad for x in leaves]

    def errors(got, want):
        return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]

    gen = torch.Generator(DEVICE).manual_seed(0)
    rows = []
    for batch in (1, 3):
        heads, kv_heads, length, prefix = 16, 4, 384, 1536
        make = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE)  # noqa: E731
        # as transformers lays them out: [B, H, L, D] views of [B, L, H, D]
        q, k, v, grad = (make(batch, length, h, dim).transpose(1, 2) for h in (heads, kv_heads, kv_heads, heads))
        pk, pv = (make(1, prefix, kv_heads, dim).transpose(1, 2) for _ in range(2))
        inputs = (q, pk, pv, k, v)
        truth = run(concatenated, inputs, grad, torch.float64)
        baseline = errors(run(concatenated, inputs, grad, torch.bfloat16), truth)
        for kernel in (split.CUDNN, split.FLASH):
            try:
                got = errors(run(lambda *x: split.split_attention(*x, None, kernel), inputs, grad, torch.bfloat16),
                             truth)
            except RuntimeError as exc:  # a kernel this GPU or build lacks is reported, not hidden
                rows.append({"kernel": kernel.name, "rows": batch, "passed": False, "error": str(exc)[:200]})
                continue
            ratio = max(s / b for s, b in zip(got, baseline))
            rows.append({"kernel": kernel.name, "rows": batch, "split_rel_err": got, "sdpa_rel_err": baseline,
                         "worst_ratio": ratio, "passed": ratio <= KERNEL_ERROR_RATIO})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(header: list[str], rows: list[dict], cells, failed_cells) -> list[str]:
    """A markdown table: `cells(row)` for each row, `failed_cells(row)` for a row that holds an error instead."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(failed_cells(r) if "error" in r else cells(r)) + " |" for r in rows]


def model_cells(r: dict) -> list[str]:
    ratio = criterion.format_ratio
    paper = r["paper"]
    return [r["path"], r["layout"], r["variant"], str(r["step"]), f"{ratio(r['worst_ratio'])} ({r['worst_param']})",
            ratio(r["median_ratio"]), f"{r['median_err']['baseline']:.2e} / {r['median_err']['candidate']:.2e}",
            f"{r['weights_moved']:.1e} / {r['drifted_apart']:.1e}",
            f"{paper['loss']:.3f} / {paper['grads']:.3f} / {paper['weights']:.3f}", r["verdict"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_gpu_equivalence")
    parser.add_argument("--prefix", type=int, default=None, help="default 1536 (--tiny: 64)")
    parser.add_argument("--suffix", type=int, default=None, help="default 384 (--tiny: 16)")
    parser.add_argument("--n", type=int, default=None, help="default 8 (--tiny: 4)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 64; 128: Qwen3's, Llama3's")
    parser.add_argument("--wave", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="groups trained, checked at the first and the last (default 4; --tiny: 3)")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.3; --tiny: 0.1)")
    parser.add_argument("--seed", type=int, default=1, help="of the rollout groups")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short groups")
    parser.add_argument("--bf16-weights", action="store_true", help="bf16 weights, no autocast")
    parser.add_argument("--offload", action="store_true", help="PrefixFlow with prefix activation offload")
    parser.add_argument("--offload-kv", action="store_true",
                        help="PrefixFlow with the prompt's K/V and gK/gV on the host too (offload_kv)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer, both sides")
    parser.add_argument("--checkpointing", action="store_true",
                        help="non-reentrant activation checkpointing on both sides (TRL's default)")
    parser.add_argument("--broken", default="", help="comma-separated broken variants, each must fail: "
                        + ", ".join(criterion.BROKEN))
    parser.add_argument("--diagnostic", default="", help="comma-separated correct variants, each must pass: "
                        + ", ".join(criterion.DIAGNOSTIC))
    parser.add_argument("--no-correct", dest="correct", action="store_false", help="only the variants")
    parser.add_argument("--tag", default="gpu_equivalence", help="output file name")
    parser.add_argument("--paths", default=None, help="comma-separated subset of " + ", ".join(PATHS))
    parser.add_argument("--no-kernel-check", dest="kernel_check", action="store_false")
    parser.add_argument("--no-control", dest="control", action="store_false")
    args = parser.parse_args()
    tiny = args.tiny
    defaults = dict(prefix=(1536, 64), suffix=(384, 16), n=(8, 4), head_dim=(64, 64), lr=(0.3, 0.1), steps=(4, 3))
    for key, (gpu, cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if tiny else gpu)
    args.shape = "tiny" if tiny else "gpu"
    args.paths = args.paths or ("sdpa-default" if tiny else ",".join(PATHS))
    variants = [v for v in f"{args.broken},{args.diagnostic}".split(",") if v]
    if unknown := set(variants) - set(criterion.BROKEN + criterion.DIAGNOSTIC):
        parser.error(f"unknown variants {sorted(unknown)}")
    global DEVICE
    DEVICE = "cpu" if tiny else args.device
    torch.set_float32_matmul_precision("highest")  # no TF32 in the references' fp32 parts
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # with --compile: never a silently eager layer

    run = harness.RunFolder("gpu_equivalence", args.out, args.tag, gpu=None if DEVICE == "cuda" else "cpu")
    env = run.environment
    kernels = kernel_rows(args.head_dim) if args.kernel_check and DEVICE == "cuda" else []
    rows = []
    good = write(run, args, rows, kernels)
    cases = [(name, layout, variant) for variant in ([None] if args.correct else []) + variants
             for name in args.paths.split(",") for layout in PATHS[name][2]
             if criterion.applies(variant, PATHS[name][0], layout)]
    for name, layout, variant in [("control", "-", None)] * args.control + cases:
        start = time.perf_counter()
        try:
            case = [control_row(args)] if name == "control" else run_case(name, layout, args, variant)
        except Exception as exc:  # a kernel a backend cannot run is reported, not hidden
            case = [{"path": name, "layout": layout, "variant": variant or "correct", "passed": False,
                     "error": f"{type(exc).__name__}: {exc}"[:400]}]
        for row in case:
            row.update(verdict=criterion.verdict(row["passed"], variant in criterion.BROKEN, row.get("error")),
                       seconds=round(time.perf_counter() - start, 1), **env)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ratios"}), flush=True)
        good = write(run, args, rows, kernels)  # after every case: a run cut short keeps what finished
    print((run.path / f"{args.tag}.md").read_text())
    sys.exit(0 if good else 1)


def write(run: harness.RunFolder, args, rows: list[dict], kernels: list[dict]) -> bool:
    """`TAG.json` and `TAG.md` under --out; whether every row came out as it must."""
    good = all(criterion.as_expected(r, r["variant"] in criterion.BROKEN) for r in rows) and \
        all(r["passed"] for r in kernels)
    lines = [f"P={args.prefix}, head dim {args.head_dim}, suffixes up to {args.suffix}, N={args.n}, wave {args.wave}, "
             f"{args.steps} groups, SGD lr {args.lr:g}. Primary: per parameter, PrefixFlow's gradient error against "
             f"the fp64 full-sequence gradient over the bf16 baseline's (relative norms), at most {criterion.LIMIT} "
             "for the worst parameter; checked at the first and last step, both at the baseline's weights. Secondary "
             f"(reported only): the paper's {criterion.PAPER}, worst over loss / gradients / weights up to the "
             "step.", ""]
    lines += table(
        ["path", "layout", "variant", "step", "worst ratio (parameter)", "median ratio",
         "median rel err baseline / PrefixFlow", "weights moved / drifted apart", "paper: loss / grads / weights",
         "verdict"], rows, model_cells,
        lambda r: [r["path"], r["layout"], r["variant"], "-", r["error"][:100], "-", "-", "-", "-", r["verdict"]])
    if kernels:
        errors = lambda values: " ".join(f"{e:.1e}" for e in values)  # noqa: E731
        lines += ["", "Split attention alone, bf16, against fp64 (max relative error: out, dq, prefix dk, prefix dv, "
                  f"dk, dv); passes at most {KERNEL_ERROR_RATIO}x bf16 SDPA's:", ""]
        verdict = {True: "yes", False: "NO"}
        lines += table(
            ["kernel", "rows", "split attention", "bf16 SDPA, concatenated", "worst ratio", "pass"], kernels,
            lambda r: [r["kernel"], str(r["rows"]), errors(r["split_rel_err"]), errors(r["sdpa_rel_err"]),
                       f"{r['worst_ratio']:.2f}", verdict[r["passed"]]],
            lambda r: [r["kernel"], str(r["rows"]), r["error"][:80], "-", "-", "no"])
    lines += ["", f"Every correct and diagnostic row passes and every broken row fails: {'yes' if good else 'NO'}"]
    run.write(rows + [{**r, **run.environment} for r in kernels], lines,
              title=f"bf16 equivalence on {run.environment['gpu']}")
    return good


if __name__ == "__main__":
    main()
