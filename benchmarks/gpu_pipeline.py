"""Pipeline parallelism on GPUs, one stage per GPU: bf16 equivalence with one-GPU training, and group time.

    torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --out $OUT          # 2 GPUs, NCCL
    torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --out /tmp/pp --tiny  # CPU, gloo, tiny shapes, fp32

Equivalence: a random-init Qwen3-architecture model (4 layers, hidden 512, head dim 128, untied; fp32 weights under
bf16 autocast, as Accelerate's bf16 mixed precision runs) split into one stage per rank trains `--steps` groups
(prompts of 1024-1536 tokens, N=4 completions up to 128 tokens, two 1F1B microbatches, SGD lr 1e-2: AdamW at a
small rate moves every weight by about the rate whatever its gradient, which would hide gradient errors) with
`pipeline.train_group`; every rank trains the whole model on its own GPU on the same groups as full sequences (all
rows in one batch) and compares its own parameters element-wise with the paper's |x-y| <= 1e-3 + 1e-2*max(|x|,|y|):
the loss (last stage), every gradient before the step, every weight after; and each step's update relative to the
reference's (max |difference| / max |reference update| over the stage's parameters).

Time (the Qwen3-1.7B shape, untied, bf16 weights, gradients only): one group of a P-token prompt and N completions
of S tokens, median of `--repeats` after a warm-up, three ways on the same stages: the baseline, `[P || S_i]` rows
through the same 1F1B schedule (`--baseline-rows` per microbatch); PrefixFlow with stage-local phase switching
(`train_group`) at each of `--waves` completions per microbatch; and each of those with a global barrier before and
after Phase B (the paper's Claim 1.3 contrast). The FLOP bound of `hf_prefixflow.flops` goes beside them.
Writes `gpu_pipeline.json` and `.md` under --out (rank 0).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_prefixflow
from hf_prefixflow.distributed import pipeline
from hf_prefixflow.flops import ModelShape

TOLERANCE = "|x-y| <= 1e-3 + 1e-2*max(|x|,|y|)"
SHAPES = {  # name -> Qwen3Config overrides
    "equivalence": dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
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
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, completions[rows][..., None])[..., 0]
        return -(logp * mask[rows] * advantages[rows, None]).sum() / mask.sum()
    return loss_fn


def violation(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x-y| / (1e-3 + 1e-2 max(|x|,|y|)): at most 1 within tolerance."""
    x, y = x.double(), y.double()
    return ((x - y).abs() / (1e-3 + 1e-2 * torch.maximum(x.abs(), y.abs()))).max().item()


def equivalence(args, rank: int, stages: int, device) -> list[dict]:
    whole = build(args.shape_equivalence, device, torch.float32)
    stage = hf_prefixflow.apply_prefixflow(
        pipeline.split_model(build(args.shape_equivalence, device, torch.float32), rank, stages))
    mine = dict(stage.named_parameters())
    reference = {n: p for n, p in whole.named_parameters() if n in mine}
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (whole, stage)]
    rows = []
    for step in range(args.steps):
        prompt, completions, mask, advantages = random_group(
            step, whole.config.vocab_size, args.eq_prefix, 4, args.eq_suffix, device)
        loss_fn = group_loss(completions, mask, advantages)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ids = torch.cat([prompt.expand(len(completions), -1), completions], dim=1)
        full_mask = torch.cat([torch.ones_like(ids[:, : len(prompt)]), mask], dim=1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            ref_loss = loss_fn(whole(ids, attention_mask=full_mask).logits[:, len(prompt) - 1 : -1],
                               torch.arange(len(completions), device=device))
            ref_loss.backward()
            loss = pipeline.train_group(stage, prompt, completions if rank == 0 else None, mask, loss_fn, 2)
        grads = max((violation(p.grad, reference[n].grad), n) for n, p in mine.items())
        before = {n: (p.detach().clone(), reference[n].detach().clone()) for n, p in mine.items()}
        for opt in opts:
            opt.step()
        weights = max((violation(p, reference[n]), n) for n, p in mine.items())
        updates = [(p.detach() - before[n][0], reference[n].detach() - before[n][1]) for n, p in mine.items()]
        update_rel = max((a - b).abs().max().item() for a, b in updates) / max(b.abs().max().item() for _, b in updates)
        row = {"step": step + 1, "stage": rank, "prefix": len(prompt), "grad_violation": grads[0],
               "grad_worst": grads[1], "weight_violation": weights[0], "weight_worst": weights[1],
               "update_rel": update_rel}
        if loss is not None:
            row.update(loss=loss.item(), ref_loss=ref_loss.item(), loss_violation=violation(loss, ref_loss))
        rows.append(row)
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


def report(out: pathlib.Path, meta: dict, rows: list[dict], timing: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pipeline.json").write_text(json.dumps({**meta, "equivalence": rows, "speed": timing}, indent=1))
    lines = [f"# Pipeline parallelism, {meta['stages']} stages ({meta['device']}, torch {meta['torch']})", "",
             f"Equivalence ({meta['precision']}, {TOLERANCE}; violation <= 1 passes):", "",
             "| step | stage | P | loss violation | grad violation (worst) | weight violation (worst) | update rel |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        loss = f"{r['loss_violation']:.3f}" if "loss_violation" in r else "-"
        lines.append(f"| {r['step']} | {r['stage']} | {r['prefix']} | {loss} | {r['grad_violation']:.3f} "
                     f"({r['grad_worst']}) | {r['weight_violation']:.3f} ({r['weight_worst']}) "
                     f"| {r['update_rel']:.2e} |")
    verdict = all(max(r["grad_violation"], r["weight_violation"], r.get("loss_violation", 0)) <= 1 for r in rows)
    lines += ["", f"All within tolerance: {verdict}", "", f"Time ({meta['speed_setting']}):", "",
              "| schedule | median s per group | times | peak GiB (max over stages) |", "| --- | --- | --- | --- |"]
    for name, t in timing.items():
        lines.append(f"| {name} | {t['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in t['times_s'])} "
                     f"| {t['peak_gib_max_stage']:.1f} |")
    base = timing["baseline"]["median_s"]
    lines += ["", f"FLOP bound {meta['flop_bound']:.2f}x. Speedups over the baseline: " + ", ".join(
        f"{name} {base / t['median_s']:.2f}x" for name, t in timing.items() if name != "baseline")]
    (out / "gpu_pipeline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def flop_bound(args) -> float:
    """Full-sequence FLOPs over PrefixFlow's for the timed group (`hf_prefixflow.flops`)."""
    shape = ModelShape.from_config(Qwen3Config(**SHAPES[args.shape_speed], tie_word_embeddings=False))
    suffixes = [args.suffix] * args.n
    return shape.full_sequence(args.prefix, suffixes) / shape.prefixflow(args.prefix, suffixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, few steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--waves", type=lambda v: [int(w) for w in v.split(",")], default=[1, 2, 4],
                        help="completions per PrefixFlow microbatch, each size timed")
    parser.add_argument("--baseline-rows", type=int, default=1, help="[P || S_i] rows per baseline microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.shape_equivalence, args.shape_speed = ("tiny", "tiny") if args.tiny else ("equivalence", "qwen3-1.7b")
    args.eq_prefix, args.eq_suffix = ((48, 64), 12) if args.tiny else ((1024, 1536), 128)
    if args.tiny:
        args.steps, args.prefix, args.suffix, args.n, args.repeats = min(args.steps, 3), 96, 16, 8, 1

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = equivalence(args, rank, stages, device)
    timing = speed(args, rank, stages, device)
    gathered = [None] * stages
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        meta = {"stages": stages, "device": torch.cuda.get_device_name(device) if cuda else "CPU",
                "precision": "fp32 weights, bf16 autocast" if cuda else "fp32",
                "torch": torch.__version__, "speed_setting": f"{args.shape_speed}, P={args.prefix}, S={args.suffix}, "
                f"N={args.n}, baseline {args.baseline_rows} row(s) per microbatch, median of {args.repeats}",
                "flop_bound": flop_bound(args)}
        report(pathlib.Path(args.out), meta, sorted(sum(gathered, []), key=lambda r: (r["step"], r["stage"])), timing)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
