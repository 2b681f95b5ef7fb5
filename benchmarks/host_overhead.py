"""Host overhead per decoder layer: PrefixFlow's group against the same group as one padded batch of full sequences.

A deep, very narrow model (a Qwen3 config with `--layers` layers of width 16, 2 query heads and 1 key-value head,
float32) makes arithmetic small, so a step's time is mostly host time: Python, the dispatcher and autograd, per op.
Each side trains one group (a prompt of `--prompt` tokens, `--completions` completions of up to `--completion`
tokens) forward and backward: PrefixFlow as `prefix_group` with one wave and Phase C, the baseline as one padded
batch of full sequences (what GRPOTrainer runs per microbatch); each without and with non-reentrant activation
checkpointing, and PrefixFlow under checkpointing also with its waves keeping their activations
(`suffix_checkpointing=False`, what the trainer's "auto" picks where they fit). Prints host ms per layer per step
(median over `--repeats`; on a CPU this thread's CPU time less the attention kernels' own, which the CPU flash
kernel keeps large) and aten ops per layer (counted below autograd: what reaches the kernels), and writes them to a
run folder. On a GPU the same command shows how much of a step the host takes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_prefixflow
from harness import RunFolder


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# (checkpointing, side): without checkpointing a wave keeps its activations anyway.
SIDES = [(False, "prefixflow"), (False, "padded batch"), (True, "prefixflow"),
         (True, "prefixflow, waves keep activations"), (True, "padded batch")]


def narrow_model(layers: int, device: str, checkpointing: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_dropout=0.0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def group_inputs(args, device: str):
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(128, (args.prompt,), generator=generator)
    completions = torch.randint(128, (args.completions, args.completion), generator=generator)
    lengths = torch.randint(1, args.completion + 1, (args.completions,), generator=generator)
    lengths[0] = args.completion  # the batch is as wide as its longest completion
    mask = (torch.arange(args.completion) < lengths[:, None]).long()
    return prompt.to(device), completions.to(device), mask.to(device)


def prefixflow_step(model, prompt, completions, mask) -> None:
    with hf_prefixflow.prefix_group(model, prompt) as group:
        out = group(completions, attention_mask=mask)
        (out.logits.float().mean(-1) * mask).sum().backward()


def padded_step(model, prompt, completions, mask) -> None:
    """GRPOTrainer's microbatch: the prompt repeated per row, completions right-padded, logits for the completion."""
    rows = completions.shape[0]
    input_ids = torch.cat([prompt.expand(rows, -1), completions], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompt).expand(rows, -1), mask], dim=1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completions.shape[1] + 1)
    (out.logits[:, :-1].float().mean(-1) * mask).sum().backward()


def clock(device: str) -> float:
    """Seconds on the host: this thread's CPU time on a CPU (robust on a shared machine: waiting for a core does not
    count; kernels run on this thread, autograd's backward included), wall time after a sync on a GPU."""
    if device == "cpu":
        return time.thread_time()
    torch.cuda.synchronize()
    return time.perf_counter()


def kernel_ms(step, model, inputs, device: str) -> float:
    """The attention kernels' own time in one step (forward and backward), which a CPU spends on arithmetic the
    narrow model cannot shrink away (PyTorch's CPU flash kernel costs tens of microseconds per row and head); 0 on
    a GPU, where kernels run beside the host."""
    if device != "cpu":
        return 0.0
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step(model, *inputs)
    return sum(e.self_cpu_time_total for e in profiler.key_averages() if "attention" in e.key) / 1e3


def measure(step, model, inputs, repeats: int, layers: int, device: str) -> dict:
    """Median host ms per layer over `repeats` steps after two warm-ups (less the attention kernels' own time), and
    the aten ops of one step per layer."""
    times = []
    for index in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        start = clock(device)
        step(model, *inputs)
        if index >= 2:
            times.append((clock(device) - start) * 1e3)
    kernels = min(kernel_ms(step, model, inputs, device) for _ in range(3))  # contention only adds
    model.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        step(model, *inputs)
    step_ms = statistics.median(times)
    return {"ms_per_step": round(step_ms, 2), "attention_kernel_ms": round(kernels, 2),
            "host_ms_per_layer": round((step_ms - kernels) / layers, 3),
            "ops_per_layer": round(sum(counter.ops.values()) / layers, 1), "top_ops": counter.ops.most_common(8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--completion", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="run folder; default benchmarks/results/<date>_host_overhead")
    parser.add_argument("--top-ops", action="store_true", help="also print each side's most frequent ops")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the narrow model's kernels gain nothing from threads; one keeps timings steady
    inputs = group_inputs(args, args.device)
    rows = []
    for checkpointing, side in SIDES:
        model = narrow_model(args.layers, args.device, checkpointing)
        if side != "padded batch":  # the trainer's default keeps a wave's activations where they fit
            model = hf_prefixflow.apply_prefixflow(model, suffix_checkpointing=side == "prefixflow")
        step = padded_step if side == "padded batch" else prefixflow_step
        row = {"side": side, "checkpointing": checkpointing,
               **measure(step, model, inputs, args.repeats, args.layers, args.device)}
        rows.append(row)
        print(f"{side:>34}  checkpointing {'on ' if checkpointing else 'off'}  {row['ms_per_step']:8.2f} ms/step"
              f" ({row['attention_kernel_ms']:6.2f} in attention kernels)  {row['host_ms_per_layer']:7.3f} host "
              f"ms/layer  {row['ops_per_layer']:6.1f} aten ops/layer", flush=True)
        if args.top_ops:
            print(" " * 36, ", ".join(f"{name} {count}" for name, count in row["top_ops"]))
    table = ["| side | checkpointing | ms / step | attention kernels ms | host ms / layer | aten ops / layer |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['side']} | {'on' if r['checkpointing'] else 'off'} | {r['ms_per_step']} | "
              f"{r['attention_kernel_ms']} | {r['host_ms_per_layer']} | {r['ops_per_layer']} |" for r in rows]
    RunFolder("host_overhead", args.out).write(rows, table)


if __name__ == "__main__":
    main()
