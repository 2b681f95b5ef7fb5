"""Is Phase C's recompute bit-exact, so that replaying Phase A's attention output is exact? (GPU, bf16)

    python benchmarks/replay_exactness.py

With offload, each recomputed prefix layer's attention is not run again in Phase C: its backward reads Phase A's
output and log-sum-exp, which is exact only if the recomputed query, key and value equal Phase A's bit for bit.
Eager layers recompute with the same kernels (torch.utils.checkpoint); torch.compile'd ones run Phase A as an
inference graph and Phase C as a training graph (with the discarded projection), which inductor may fuse otherwise.
This trains one group of a small Qwen3-architecture model (head dim 128, bf16) eager and with inductor-compiled
layers, and per layer compares Phase C's query, key and value with Phase A's, and the kernel's output on them with
the replayed one (max |difference|; 0 is exact). `--lora-dropout P` adds LoRA adapters with dropout P on every
linear layer: a recompute that drew other masks than Phase A's would differ by far more than rounding.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_prefixflow
from hf_prefixflow.core import recompute
from hf_prefixflow.core.access import decoder_of


def run(compiled: bool, args) -> list[str]:
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float64)
    config = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device, dtype).train()
    model.set_attn_implementation("sdpa")
    if args.lora_dropout:
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=args.lora_dropout,
                                                 init_lora_weights=False)).to(dtype)
    if compiled:
        for layer in recompute.decoder_layers(decoder_of(model)):
            layer.compile()
    hf_prefixflow.apply_prefixflow(model, offload=True, prefix_recompute=1.0)
    phase_a, rows = {}, []
    forward = recompute._ReplayedAttention.forward

    def checking(ctx, query, key, value, scale, kernel, replay, layer):
        replaying = layer in replay.kept
        out = forward(ctx, query, key, value, scale, kernel, replay, layer)
        if not replaying:
            phase_a[layer] = [t.detach().clone() for t in (query, key, value)]
            return out
        fresh = kernel.forward(query, key, value, True, scale)[0]
        apart = [(a.float() - b.float()).abs().max().item() for a, b in zip((query, key, value), phase_a[layer])]
        rows.append(f"| {'inductor' if compiled else 'eager'} | {layer} | {apart[0]:.3g} | {apart[1]:.3g} | "
                    f"{apart[2]:.3g} | {(fresh.float() - out.float()).abs().max().item():.3g} |")
        return out

    recompute._ReplayedAttention.forward = staticmethod(checking)
    try:
        prompt = torch.randint(0, config.vocab_size, (args.prefix,), device=device)
        completions = torch.randint(0, config.vocab_size, (args.n, args.suffix), device=device)
        for _ in range(2):  # the first compiles
            rows.clear()
            with hf_prefixflow.prefix_group(model, prompt) as group:
                group(completions).logits.float().logsumexp(-1).mean().backward()
    finally:
        recompute._ReplayedAttention.forward = staticmethod(forward)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled layers (a CPU smoke run)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, fp64"
    dropout = f", LoRA dropout {args.lora_dropout}" if args.lora_dropout else ""
    print(f"# Phase C recompute vs Phase A ({device}, torch {torch.__version__}{dropout})\n")
    print("| layers | layer | query | key | value | kernel output on them vs replayed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for compiled in (False,) if args.eager_only else (False, True):
        print("\n".join(run(compiled, args)), flush=True)


if __name__ == "__main__":
    main()
