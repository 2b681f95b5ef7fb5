"""Where a group's peak device memory goes: the live allocations at the peak, grouped by the code that made them.

    PYTHONPATH=. python benchmarks/memory_trace.py --shares 0,1                        # one GPU, offload shares
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/memory_trace.py --sp --prefix 8192,16384   # Ulysses SP=2

One group of the Qwen3-1.7B shape (speed.py's `build`) runs twice with the allocator's history on; the second
run's peak is the one reported (the first warms caches and pools). The history's alloc / free_requested events are replayed to find the
moment the live set is largest; that set is summed per allocating frame (the first three outside torch).
Both runs are recorded, so what the first run left allocated shows under its frames, marked "[earlier run]";
`max_memory_allocated` can still exceed the traced set by what existed before recording (the weights).
`--free-on free_completed` keeps a freed block live until the allocator may reuse it (after the other streams that
used it, e.g. offload copies, are done).
Single GPU: P=--prefix, N suffixes of --suffix tokens, one per wave, no checkpointing, offload on at each
--shares value (`prefix_recompute`). --sp: the SP capacity run's group (non-reentrant checkpointing, offload on,
N suffixes in one wave, sharded over the two ranks), traced on rank 0. With `--out`, a row per traced group (the two
peaks and the ten largest frames) also goes to `memory_trace.json`, `.md` and a generated `MANIFEST.md` there (rank
0, `harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

import torch

from hf_prefixflow import _compat
import harness
import hf_prefixflow
from speed import build, suffix_loss

GIB = 2**30


def frames(event: dict) -> str:
    ours = [f for f in event.get("frames", []) if f["filename"].endswith(".py") and "site-packages/torch/" not in f["filename"]]
    where = " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in ours[:3]) or "(torch)"
    if "earlier" not in event:
        return where
    if not ours:  # made by torch itself (e.g. an autograd kernel): its own frames say more
        where = " <- ".join(f"{f['name']}" for f in event.get("frames", [])[:4]) or "(no frames)"
    return f"[earlier run, at {event['earlier']}% of it, stream {event.get('stream', '?')}] {where}"


def peak_set(trace: list[dict], free_on: str = "free_requested", start: int = 0) -> tuple[int, dict[str, int]]:
    """Bytes live at the largest point of `trace` from event `start` on (earlier events only build the live set),
    and their split by allocating frames. A block is live until `free_on`: "free_requested" (the tensor died) or
    "free_completed" (the allocator may reuse it, which waits for the other streams that recorded a use of it)."""
    live, current, best, best_live = {}, 0, 0, {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == free_on and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if index >= start and current > best:
            best, best_live = current, dict(live)
    split = collections.Counter()
    for event in best_live.values():
        split[frames(event)] += event["size"]
    return best, split


def traced(run, device: int, free_on: str, collect: bool = False) -> tuple[float, int, dict[str, int]]:
    """Run `run` twice, recording both, and find the peak of the second: what the first left allocated at that
    peak is listed under its own frames (marked "[earlier run]"). Returns max_memory_allocated (GiB) of the second
    run, the traced peak bytes and their split. `collect`: run Python's garbage collector between the runs."""
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    run()
    torch.cuda.synchronize()
    if collect:
        gc.collect()
    torch.cuda.empty_cache()
    start = len(torch.cuda.memory._snapshot()["device_traces"][device])
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][device]
    for index, event in enumerate(trace[:start]):
        event["earlier"] = 100 * index // max(start, 1)
    best, split = peak_set(trace, free_on, start)
    return torch.cuda.max_memory_allocated() / GIB, best, split


def report(title: str, peak_gib: float, best: int, split: dict[str, int]) -> dict:
    """Print the peaks and the ten largest frames; the same as a row."""
    print(f"{title}: max_memory_allocated {peak_gib:.2f} GiB, traced live at the peak {best / GIB:.2f} GiB", flush=True)
    top = sorted(split.items(), key=lambda kv: -kv[1])[:10]
    for where, size in top:
        print(f"  {size / GIB:7.3f} GiB  {where}", flush=True)
    return {"title": title, "max_allocated_gib": round(peak_gib, 3), "traced_peak_gib": round(best / GIB, 3),
            "top": [{"where": where, "gib": round(size / GIB, 3)} for where, size in top]}


def write(rows: list[dict], args) -> None:
    command = None
    if args.sp:
        command = f"torchrun --nproc_per_node {os.environ.get('WORLD_SIZE', 2)} benchmarks/memory_trace.py " + " ".join(
            sys.argv[1:])
    run = harness.RunFolder("memory_trace", args.out, command=command)
    rows = [{**row, **run.environment} for row in rows]
    lines = ["| group | max allocated GiB | traced at the peak GiB | largest frame |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['title']} | {r['max_allocated_gib']} | {r['traced_peak_gib']} | "
              f"{r['top'][0]['gib'] if r['top'] else '-'} GiB `{r['top'][0]['where'] if r['top'] else '-'}` |"
              for r in rows]
    run.write(rows, lines)


def one_gpu(args) -> list[dict]:
    model = build("qwen3-1.7b")
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prefix[0],), device="cuda", generator=gen)
    suffixes = torch.randint(0, model.config.vocab_size, (args.n, args.suffix), device="cuda", generator=gen)

    def group():
        model.zero_grad(set_to_none=True)
        with hf_prefixflow.prefix_group(model, prompt) as g:
            for row in suffixes.split(1):
                suffix_loss(g(row).logits, row).backward()

    rows = []
    for share in args.shares:
        hf_prefixflow.apply_prefixflow(model, offload=True, prefix_recompute=share)
        title = f"P={args.prefix[0]} S={args.suffix} N={args.n} prefix_recompute={share}, live until {args.free_on}"
        rows.append(report(title + ", gc between runs" * args.gc, *traced(group, 0, args.free_on, args.gc)))
    return rows


def sequence_parallel(args) -> list[dict]:
    """The rows on rank 0, none on the others."""
    import torch.distributed as dist

    from hf_prefixflow.distributed import ulysses

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    model = build("qwen3-1.7b", prefixflow=False)
    _compat.enable_checkpointing(model)
    model = hf_prefixflow.apply_prefixflow(model, offload=True)
    sp = ulysses.SequenceParallel()
    rows = []
    for prefix in args.prefix:
        prompt = torch.randint(0, model.config.vocab_size, (prefix,), device="cuda")
        suffixes = torch.randint(0, model.config.vocab_size, (args.n, args.suffix), device="cuda")
        dist.broadcast(prompt, 0)
        dist.broadcast(suffixes, 0)

        def group():
            model.zero_grad(set_to_none=True)
            with ulysses.prefix_group(model, prompt, sp) as g:
                out = g(suffixes, attention_mask=torch.ones_like(suffixes))
                real = out.token_index >= 0
                suffix_loss(out.logits[:, real], suffixes[:, out.token_index[real]]).backward()

        result = traced(group, rank, args.free_on)
        if rank == 0:
            rows.append(report(f"SP=2 P={prefix} S={args.suffix} N={args.n}, rank 0", *result))
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", action="store_true", help="Ulysses SP=2 under torchrun (2 GPUs)")
    parser.add_argument("--prefix", default=None, help="prefix lengths (one GPU: the first; default 10240 / 8192)")
    parser.add_argument("--suffix", type=int, default=None, help="default 2048 (one GPU) / 256 (--sp)")
    parser.add_argument("--n", type=int, default=None, help="default 3 (one GPU) / 4 (--sp)")
    parser.add_argument("--shares", default="0,1", help="one GPU: prefix_recompute values")
    parser.add_argument("--free-on", default="free_requested", choices=["free_requested", "free_completed"],
                        help="the event that ends a block's life in the replay")
    parser.add_argument("--gc", action="store_true", help="one GPU: collect Python garbage between the two runs")
    parser.add_argument("--out", default=None, help="a run folder for the rows (default: print only)")
    args = parser.parse_args()
    args.prefix = [int(p) for p in (args.prefix or ("8192" if args.sp else "10240")).split(",")]
    args.suffix = args.suffix or (256 if args.sp else 2048)
    args.n = args.n or (4 if args.sp else 3)
    args.shares = [float(s) for s in args.shares.split(",")]
    rows = sequence_parallel(args) if args.sp else one_gpu(args)
    if args.out and rows:
        write(rows, args)


if __name__ == "__main__":
    main()
