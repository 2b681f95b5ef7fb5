"""Pipeline parallelism on GPUs, one stage per GPU: bf16 equivalence with one-GPU training, and group time.

    torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --out $OUT          # 2 GPUs, NCCL
    torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --out /tmp/pp --tiny  # CPU, gloo, tiny shapes

Equivalence: a random-init Qwen3-architecture model (4 layers, hidden 512, head dim 128, untied; fp32 weights under
bf16 autocast, as Accelerate's bf16 mixed precision runs) split into one stage per rank trains `--steps` groups
(prompts of 1024-1536 tokens, N=4 completions up to 128 tokens, two 1F1B microbatches, plain SGD) with
`pipeline.train_group`; every rank trains the whole model on its own GPU on the same groups as full sequences (all
rows in one batch, the baseline). Primary criterion (`benchmarks/criterion.py`) at the first and the last step, on
each stage's own parameters: per parameter, the pipeline's gradient error against the fp64 full-sequence gradient
(no autocast) over the baseline's error against it, at most 1.2 for the worst parameter. Before a checked step each
stage takes the baseline's weights (plain SGD keeps no other state), so both gradients and their one fp64 reference
are taken at the same weights; how far the stage had drifted from them by then is reported. SGD rather than AdamW,
which moves each weight by about the learning rate whatever the gradient. Secondary, reported
only: the paper's |x-y| <= 1e-3 + 1e-2*max(|x|,|y|) on the loss (last stage), every gradient before the step and
every weight after, and each step's update relative to the baseline's (max |difference| / max |baseline update|).
`--broken` runs broken variants (`criterion.BROKEN`), each of which must fail. `--tiny` trains a two-layer model
as wide as a GPU one under CPU bf16 autocast (narrower norms scatter the ratio between groups).

Time (the Qwen3-1.7B shape, untied, bf16 weights, gradients only): one group of a P-token prompt and N completions
of S tokens, median of `--repeats` after a warm-up, three ways on the same stages: the baseline, `[P || S_i]` rows
through the same 1F1B schedule (`--baseline-rows` per microbatch); PrefixFlow with stage-local phase switching
(`train_group`) at each of `--waves` completions per microbatch; and each of those with a global barrier before and
after Phase B (the paper's Claim 1.3 contrast). The FLOP bound of `hf_prefixflow.planning.flops` goes beside them.
Writes `gpu_pipeline.json`, `.md` and a generated `MANIFEST.md` under --out (rank 0, `harness.RunFolder`); exits with
1 (rank 0) unless every correct row passes and every broken row fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers import Qwen3Config, Qwen3ForCausalLM

import criterion
import harness
import hf_prefixflow
from hf_prefixflow.distributed import pipeline
from hf_prefixflow.planning.flops import ModelShape

SHAPES = {  # name -> Qwen3Config overrides
    "equivalence": dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "tiny-equivalence": dict(vocab_size=128, hidden_size=1024, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=64),
}


def build(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model.train()


def random_group(step: int, vocab: int, prefix: tuple[int, int], n: int, suffix: int, device, ragged=True):
    """The same group on every rank: prompt, right-padded completions (all `suffix` long unless ragged), their mask
    and advantages."""
    gen = torch.Generator().manual_seed(step)
    length = int(torch.randint(prefix[0], prefix[1] + 1, (1,), generator=gen))
    prompt = torch.randint(0, vocab, (length,), generator=gen)
    completions = torch.randint(0, vocab, (n, suffix), generator=gen)
    lengths = torch.randint(max(1, suffix // 4), suffix + 1, (n,), generator=gen)
    lengths[0] = suffix
    if not ragged:
        lengths[:] = suffix
    mask = (torch.arange(suffix)[None] < lengths[:, None]).long()
    return [t.to(device) for t in (prompt, completions, mask, torch.randn(n, generator=gen))]


def group_loss(completions, mask, advantages):
    """`loss_fn(logits, rows)` of a GRPO-shaped loss, summed over microbatches: fp32 log-probs."""
    def loss_fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 in the reference
        logp = torch.log_softmax(logits, dim=-1).gather(-1, completions[rows][..., None])[..., 0]
        return -(logp * mask[rows] * advantages[rows, None]).sum() / mask.sum()
    return loss_fn


def full_sequence(model, prompt, completions, mask, loss_fn) -> torch.Tensor:
    """The baseline's loss: every row `[P || S_i]` in one right-padded batch, backpropagated."""
    ids = torch.cat([prompt.expand(len(completions), -1), completions], dim=1)
    full_mask = torch.cat([torch.ones_like(ids[:, : len(prompt)]), mask], dim=1)
    loss = loss_fn(model(ids, attention_mask=full_mask).logits[:, len(prompt) - 1 : -1],
                   torch.arange(len(completions), device=ids.device))
    loss.backward()
    return loss


def reference_grads(reference, weights: dict, batch) -> dict:
    """The fp64 full-sequence gradient at `weights` (call outside autocast)."""
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(weights[name])
    reference.zero_grad(set_to_none=True)
    full_sequence(reference, *batch)
    return {n: p.grad for n, p in reference.named_parameters()}


def equivalence(args, rank: int, stages: int, device, variant: str | None) -> list[dict]:
    whole = build(args.shape_equivalence, device, torch.float32)
    stage = hf_prefixflow.apply_prefixflow(
        pipeline.split_model(build(args.shape_equivalence, device, torch.float32), rank, stages))
    truth_model = build(args.shape_equivalence, device, torch.float64)
    mine = dict(stage.named_parameters())
    baseline = {n: p for n, p in whole.named_parameters() if n in mine}
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (whole, stage)]
    paper = criterion.paper_violation
    rows = []
    with criterion.variant(variant, whole.config.num_hidden_layers) as used:
        for step in range(1, args.steps + 1):
            prompt, completions, mask, advantages = random_group(
                step - 1, whole.config.vocab_size, args.eq_prefix, 4, args.eq_suffix, device)
            loss_fn = group_loss(completions, mask, advantages)
            batch = (prompt, completions, mask, loss_fn)
            row = {"step": step, "stage": rank, "prefix": len(prompt), "variant": variant or "correct"}
            if step in (1, args.steps):
                with torch.no_grad():
                    row["drifted_apart"] = (sum((p - baseline[n]).double().pow(2).sum() for n, p in mine.items())
                                            / sum(p.double().pow(2).sum() for p in baseline.values())).sqrt().item()
                    for name, param in mine.items():  # judged at the baseline's weights (see the docstring)
                        param.copy_(baseline[name])
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                ref_loss = full_sequence(whole, *batch)
                loss = pipeline.train_group(stage, prompt, completions if rank == 0 else None, mask, loss_fn, 2)
            g_pf = {n: p.grad for n, p in mine.items()}
            g_base = {n: p.grad for n, p in baseline.items()}
            if step in (1, args.steps):
                truth = reference_grads(truth_model, dict(whole.named_parameters()), batch)
                row.update(criterion.judge(g_pf, g_base, {n: truth[n] for n in mine}))
            grads = max((paper(g_pf[n], g_base[n]), n) for n in mine)
            before = {n: (p.detach().clone(), baseline[n].detach().clone()) for n, p in mine.items()}
            for opt in opts:
                opt.step()
            weights = max((paper(p, baseline[n]), n) for n, p in mine.items())
            updates = [(p.detach() - before[n][0], baseline[n].detach() - before[n][1]) for n, p in mine.items()]
            update_rel = max((a - b).abs().max().item() for a, b in updates) / max(
                b.abs().max().item() for _, b in updates)
            row.update(grad_violation=grads[0], grad_worst=grads[1], weight_violation=weights[0],
                       weight_worst=weights[1], update_rel=update_rel)
            if loss is not None:
                row.update(loss=loss.item(), ref_loss=ref_loss.item(), loss_violation=paper(loss, ref_loss))
            rows.append(row)
    calls = torch.tensor([used["calls"]], device=device)
    dist.all_reduce(calls)
    if variant and not calls.item():
        return [{"step": 0, "stage": rank, "variant": variant, "passed": False, "error": "the variant never applied"}]
    return rows


class _FullRows(torch.nn.Module):
    """The baseline's stage: `[P || S_i]` rows as ordinary sequences through this stage's layers."""

    def __init__(self, model: torch.nn.Module, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        if self.last:
            return self.model(attention_mask=attention_mask, **kwargs).logits
        return self.model.model(attention_mask=attention_mask, **kwargs)[0]


def baseline_group(stage, rank, stages, prompt, completions, mask, loss_fn, microbatches, device) -> None:
    rows, width = len(completions), len(prompt) + completions.shape[1]
    ids = torch.cat([prompt.expand(rows, -1), completions], dim=1)
    full_mask = torch.cat([torch.ones_like(ids[:, : len(prompt)]), mask], dim=1)
    batch, hidden = rows // microbatches, stage.config.hidden_size
    boundary = torch.empty(batch, width, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    first, last = rank == 0, rank == stages - 1
    inputs = torch.empty(batch, width, dtype=torch.long, device="meta") if first else boundary
    outputs = torch.empty(batch, width, stage.config.vocab_size, dtype=torch.bfloat16, device="meta") if last \
        else boundary
    pipe = PipelineStage(_FullRows(stage, first, last), rank, stages, device, input_args=(inputs,),
                         output_args=(outputs,))
    schedule = Schedule1F1B(pipe, microbatches, loss_fn=lambda logits, r: loss_fn(
        logits[:, len(prompt) - 1 : -1], r), scale_grads=False)
    target = {"target": torch.arange(rows, device=device), "losses": []} if last else {}
    schedule.step(*((ids,) if first else ()), attention_mask=full_mask, **target, **pipeline._NO_OUTPUTS)


def timed(run, repeats: int, device) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]


def speed(args, rank: int, stages: int, device) -> dict:
    model = build(args.shape_speed, device, torch.bfloat16)
    stage = hf_prefixflow.apply_prefixflow(pipeline.split_model(model, rank, stages))
    prompt, completions, mask, advantages = random_group(
        0, stage.config.vocab_size, (args.prefix, args.prefix), args.n, args.suffix, device, ragged=False)
    loss_fn = group_loss(completions, mask, advantages)
    ids = completions if rank == 0 else None
    phase_b = pipeline._phase_b

    def barriered(*a, **k):  # Phase B between two global barriers: every stage waits for the slowest
        dist.barrier()
        out = phase_b(*a, **k)
        dist.barrier()
        return out

    def run_prefixflow(wave: int, barrier: bool):
        pipeline._phase_b = barriered if barrier else phase_b
        try:
            pipeline.train_group(stage, prompt, ids, mask, loss_fn, args.n // wave)
        finally:
            pipeline._phase_b = phase_b
        stage.zero_grad(set_to_none=True)

    def run_baseline():
        baseline_group(stage, rank, stages, prompt, completions, mask, loss_fn, args.n // args.baseline_rows, device)
        stage.zero_grad(set_to_none=True)

    runs = [("baseline", run_baseline)] + [
        (f"prefixflow_wave{wave}{'_barrier' * barrier}", functools.partial(run_prefixflow, wave, barrier))
        for wave in args.waves for barrier in (False, True)]
    result = {}
    for name, run in runs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = timed(run, args.repeats, device)
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                            device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result[name] = {"times_s": times, "median_s": statistics.median(times), "peak_gib_max_stage": peak.item()}
    return result


def report(run: harness.RunFolder, meta: dict, rows: list[dict], timing: dict) -> bool:
    """Write the json and md; whether every correct row passed and every broken one failed."""
    ratio = criterion.format_ratio
    lines = [f"Equivalence ({meta['precision']}, SGD lr {meta['lr']:g}). Primary, at the first and last step: per "
             "parameter of the stage, the pipeline's gradient error against the fp64 full-sequence gradient over the "
             f"one-GPU bf16 baseline's, at most {criterion.LIMIT} for the worst parameter, both at the baseline's "
             "weights (how far the stage had drifted from them: relative distance). Secondary (reported only): the "
             f"paper's {criterion.PAPER}, violation <= 1 within it.", "",
             "| variant | step | stage | P | worst ratio (parameter) | median ratio | drifted apart | loss violation | "
             "grad violation (worst) | weight violation (worst) | update rel | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        r["verdict"] = criterion.verdict(r.get("passed"), r["variant"] in criterion.BROKEN, r.get("error"))
        if "error" in r:
            lines.append(f"| {r['variant']} | - | {r['stage']} | - | {r['error'][:100]} | - | - | - | - | - | - | "
                         f"{r['verdict']} |")
            continue
        primary = f"{ratio(r['worst_ratio'])} ({r['worst_param']}) | {ratio(r['median_ratio'])} | " \
            f"{r['drifted_apart']:.1e}" if "worst_ratio" in r else "- | - | -"
        loss = f"{r['loss_violation']:.3f}" if "loss_violation" in r else "-"
        lines.append(f"| {r['variant']} | {r['step']} | {r['stage']} | {r['prefix']} | {primary} | {loss} | "
                     f"{r['grad_violation']:.3f} ({r['grad_worst']}) | {r['weight_violation']:.3f} "
                     f"({r['weight_worst']}) | {r['update_rel']:.2e} | {r['verdict']} |")
    good = all(criterion.as_expected(r, r["variant"] in criterion.BROKEN) for r in rows)
    lines += ["", f"Every correct row passes and every broken row fails: {'yes' if good else 'NO'}", "",
              f"Time ({meta['speed_setting']}):", "",
              "| schedule | median s per group | times | peak GiB (max over stages) |", "| --- | --- | --- | --- |"]
    for name, t in timing.items():
        lines.append(f"| {name} | {t['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in t['times_s'])} "
                     f"| {t['peak_gib_max_stage']:.1f} |")
    base = timing["baseline"]["median_s"]
    lines += ["", f"FLOP bound {meta['flop_bound']:.2f}x. Speedups over the baseline: " + ", ".join(
        f"{name} {base / t['median_s']:.2f}x" for name, t in timing.items() if name != "baseline")]
    run.write({**meta, "equivalence": rows, "speed": timing}, lines,
              title=f"Pipeline parallelism, {meta['stages']} stages ({meta['gpu']})")
    print("\n".join(lines), flush=True)
    return good


def flop_bound(args) -> float:
    """Full-sequence FLOPs over PrefixFlow's for the timed group (`hf_prefixflow.planning.flops`)."""
    shape = ModelShape.from_config(Qwen3Config(**SHAPES[args.shape_speed], tie_word_embeddings=False))
    suffixes = [args.suffix] * args.n
    return shape.full_sequence(args.prefix, suffixes) / shape.prefixflow(args.prefix, suffixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, few steps")
    parser.add_argument("--steps", type=int, default=10, help="equivalence groups, checked at the first and last")
    parser.add_argument("--lr", type=float, default=0.3, help="equivalence SGD learning rate")
    parser.add_argument("--broken", default="", help="comma-separated broken variants, each must fail: "
                        + ", ".join(criterion.BROKEN))
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--waves", type=lambda v: [int(w) for w in v.split(",")], default=[1, 2, 4],
                        help="completions per PrefixFlow microbatch, each size timed")
    parser.add_argument("--baseline-rows", type=int, default=1, help="[P || S_i] rows per baseline microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.shape_equivalence, args.shape_speed = ("tiny-equivalence", "tiny") if args.tiny \
        else ("equivalence", "qwen3-1.7b")
    args.eq_prefix, args.eq_suffix = ((48, 64), 12) if args.tiny else ((1024, 1536), 128)
    if args.tiny:
        args.steps, args.prefix, args.suffix, args.n, args.repeats = min(args.steps, 3), 96, 16, 8, 1
    variants = [v for v in args.broken.split(",") if v]
    if unknown := set(variants) - set(criterion.BROKEN):
        parser.error(f"unknown broken variants {sorted(unknown)}")

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = [row for variant in [None] + variants for row in equivalence(args, rank, stages, device, variant)]
    timing = speed(args, rank, stages, device)
    gathered = [None] * stages
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        run = harness.RunFolder("gpu_pipeline", args.out, gpu=torch.cuda.get_device_name(device) if cuda else "CPU",
                                command=f"torchrun --nproc_per_node {stages} benchmarks/gpu_pipeline.py "
                                        + " ".join(sys.argv[1:]))
        meta = {"stages": stages, **run.environment, "precision": "fp32 weights, bf16 autocast", "lr": args.lr,
                "speed_setting": f"{args.shape_speed}, P={args.prefix}, S={args.suffix}, "
                f"N={args.n}, baseline {args.baseline_rows} row(s) per microbatch, median of {args.repeats}",
                "flop_bound": flop_bound(args)}
        rows = sorted(sum(gathered, []), key=lambda r: (r["variant"] != "correct", r["variant"], r["step"],
                                                        r["stage"]))
        good = report(run, meta, rows, timing)
    dist.destroy_process_group()
    if rank == 0 and not good:
        sys.exit(1)


if __name__ == "__main__":
    main()
