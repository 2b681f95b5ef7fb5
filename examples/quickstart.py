"""PrefixFlow in one screen: train a rollout group (one long prompt, N completions) both ways and compare.

    python examples/quickstart.py                 # tiny random-init Qwen3-style model on the CPU, fp64
    python examples/quickstart.py --model PATH    # a real checkpoint through from_pretrained

Prints the largest relative gradient difference between full-sequence training and PrefixFlow, and the FLOPs
PrefixFlow saves on this group.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_prefixflow
from hf_prefixflow.planning.flops import ModelShape


def load_model(path: str | None, dtype: torch.dtype) -> torch.nn.Module:
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    config = Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype)


def group_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor):
    """A GRPO-shaped loss: advantage-weighted token log-likelihood, masked to real completion tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    return -(logp * mask * advantages[:, None]).sum() / mask.sum()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="path of a checkpoint to load with from_pretrained")
    parser.add_argument("--prefix", type=int, default=512, help="prompt tokens")
    parser.add_argument("--suffix", type=int, default=48, help="longest completion")
    parser.add_argument("--n", type=int, default=8, help="completions in the group")
    parser.add_argument("--wave", type=int, default=4, help="completions per suffix wave")
    args = parser.parse_args(argv)

    dtype = torch.float32 if args.model else torch.float64
    baseline = load_model(args.model, dtype).train()
    model = hf_prefixflow.apply_prefixflow(copy.deepcopy(baseline))
    vocab = baseline.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prefix,), generator=gen)
    completions = torch.randint(0, vocab, (args.n, args.suffix), generator=gen)
    lengths = torch.randint(args.suffix // 4, args.suffix + 1, (args.n,), generator=gen)
    mask = (torch.arange(args.suffix)[None] < lengths[:, None]).long()  # right-padded completions
    advantages = torch.randn(args.n, generator=gen)

    with torch.no_grad():  # warm both paths up, so the timings below compare steady states
        baseline(prompt[None, :8])
        with hf_prefixflow.prefix_group(model, prompt[:8]) as group:
            group(completions[:1, :4])

    start = time.perf_counter()
    sequences = torch.cat([prompt.expand(args.n, -1), completions], dim=1)
    full_mask = torch.cat([torch.ones(args.n, args.prefix, dtype=torch.long), mask], dim=1)
    logits = baseline(sequences, attention_mask=full_mask).logits[:, args.prefix - 1 : -1]
    group_loss(logits, completions, mask, advantages).backward()
    baseline_s = time.perf_counter() - start

    start = time.perf_counter()
    with hf_prefixflow.prefix_group(model, prompt) as group:  # Phase A: the prompt runs forward once
        for rows in torch.arange(args.n).split(args.wave):  # Phase B: completions train in waves
            out = group(completions[rows], attention_mask=mask[rows])
            loss = group_loss(out.logits, completions[rows], mask[rows], advantages[rows])
            (loss * mask[rows].sum() / mask.sum()).backward()
    prefixflow_s = time.perf_counter() - start  # Phase C ran when the block closed

    worst, worst_name = 0.0, ""
    for (name, ref), (_, got) in zip(baseline.named_parameters(), model.named_parameters()):
        err = ((got.grad - ref.grad).abs().max() / ref.grad.abs().max()).item()
        if err > worst:
            worst, worst_name = err, name
    shape = ModelShape.from_config(baseline.config)
    suffixes = lengths.tolist()
    full, shared = shape.full_sequence(args.prefix, suffixes), shape.prefixflow(args.prefix, suffixes)
    print(f"group: prompt {args.prefix} tokens, {args.n} completions of {min(suffixes)}-{max(suffixes)} tokens")
    print(f"gradients: max relative difference {worst:.2e} ({worst_name}) over {len(list(model.parameters()))} tensors")
    print(f"FLOPs: full sequence {full:.3e}, PrefixFlow {shared:.3e}: {1 - shared / full:.1%} saved, bound {full / shared:.2f}x")
    print(f"time on this machine: full sequence {baseline_s:.2f}s, PrefixFlow {prefixflow_s:.2f}s")
    return worst


if __name__ == "__main__":
    main()
