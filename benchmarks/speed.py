"""Speed on one GPU: full-sequence training vs PrefixFlow, side by side in one process on the same model object.

    python benchmarks/speed.py --model qwen3-1.7b --splits 10240/2048,2048/10240 --n 4,16

The baseline trains each `[P || S_i]` as an ordinary sequence (one per microbatch, as TRL does with batch 1);
PrefixFlow runs the prefix once and the suffixes as waves of `--wave` suffixes (a list: one row per wave size, all
against one baseline measurement). Same model object, bf16 weights and gradients (full-parameter, no optimizer
step), same loss on suffix tokens only, same attention kernels. Each row: a warm-up group (its first
`--warmup-rows` suffixes, or all), then the median of `--repeats` timed groups (CUDA events), peak allocated memory,
and the FLOP bound from `hf_prefixflow.planning.flops`. Rows go to `<--tag>.json`, `.md` and a generated `MANIFEST.md`
in `--out` after each one (`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_prefixflow
from hf_prefixflow.planning.flops import ModelShape
import harness

SHAPES = {
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256),
    # Qwen3.5's layer pattern (three gated delta-net layers, then attention), 2.3B parameters
    "qwen3.5-2b": dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       vocab_size=151936, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
    # Nemotron-H's pattern (Mamba2 and MLP layers, attention in every sixth), 1.2B parameters
    "nemotron-h-1b": dict(model_type="nemotron_h", hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                          ssm_state_size=128, chunk_size=128, vocab_size=131072, num_hidden_layers=24,
                          layers_block_type=["mamba", "mlp", "mamba", "mlp", "attention", "mlp"] * 4),
}


def build(name: str, prefixflow: bool = True, compile: bool = False, lora: bool = False) -> torch.nn.Module:
    spec = dict(SHAPES[name])
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=32768, **spec)
    torch.manual_seed(0)  # the same weights on every call
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if compile:  # per decoder layer, in place: baseline, Phase A and Phase B all run the compiled layers
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # past the limit dynamo would run layers eagerly
        torch._dynamo.config.recompile_limit = hf_prefixflow.core.attention.RECOMPILE_LIMIT  # as the trainer sets it
        for layer in model.model.layers:
            layer.compile()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return hf_prefixflow.apply_prefixflow(model.train()) if prefixflow else model.train()


def group_parser(doc: str, model: str = "qwen3-1.7b") -> argparse.ArgumentParser:
    """The arguments of the scripts that study one group: `--model`, `--prefix`, `--suffix`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model, choices=sorted(SHAPES))
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    return parser


def random_group(model, prefix: int, suffix: int, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A random prompt of `prefix` tokens and `n` completions of `suffix` tokens on the GPU."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prefix,), device="cuda")
    return prompt, list(torch.randint(0, vocab, (n, suffix), device="cuda"))


def suffix_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="mean")


def baseline_group(model, prompt, suffixes) -> None:
    for suffix in suffixes:
        ids = torch.cat([prompt, suffix])[None]
        logits = model(ids, logits_to_keep=len(suffix) + 1, use_cache=False).logits[:, :-1]
        suffix_loss(logits, suffix[None]).backward()


def prefixflow_group(model, prompt, suffixes, wave: int) -> None:
    with hf_prefixflow.prefix_group(model, prompt) as group:
        for start in range(0, len(suffixes), wave):
            batch = torch.stack(suffixes[start : start + wave])
            suffix_loss(group(batch).logits, batch).backward()


def table(rows: list[dict]) -> list[str]:
    lines = ["| P / S | N | wave | baseline s | PrefixFlow s | speedup | FLOP bound | share of bound | "
             "peak GiB base / PF | allocator retries base / PF |", "| --- " * 10 + "|"]
    return lines + [
        f"| {r['P']} / {r['S']} | {r['N']} | {r['wave']} | {r['baseline_s']:.3f} | {r['prefixflow_s']:.3f} | "
        f"{r['speedup']:.2f}x | {r['flop_bound']:.2f}x | {r['share_of_bound']:.1%} | "
        f"{r['baseline_peak_gib']:.1f} / {r['prefixflow_peak_gib']:.1f} | "
        f"{r['baseline_alloc_retries']} / {r['prefixflow_alloc_retries']} |" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--splits", default="10240/2048,2048/10240")
    parser.add_argument("--n", default="4,16")
    parser.add_argument("--wave", default="1", help="suffixes per Phase-B wave; a comma-separated list measures each "
                                                     "against one baseline measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-rows", type=int, default=None,
                        help="warm up on the first this many suffixes instead of the whole group (saves minutes at "
                             "large N; the timed groups are whole)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on every linear layer instead of full gradients")
    parser.add_argument("--offload", action="store_true",
                        help="PrefixFlow offloads dormant prefix activations (the memory buys larger --wave)")
    parser.add_argument("--prefix-recompute", type=float, default=None,
                        help="share of prefix layers Phase C recomputes (frees Phase-B memory for a larger --wave)")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_speed")
    parser.add_argument("--tag", default="speed")
    args = parser.parse_args()
    run = harness.RunFolder("speed", args.out, args.tag)

    model = hf_prefixflow.apply_prefixflow(build(args.model, compile=args.compile, lora=args.lora), offload=args.offload,
                                           prefix_recompute=args.prefix_recompute)
    shape = ModelShape.from_config(model.config)
    vocab = model.config.vocab_size
    model_name = args.model + ("+lora" if args.lora else "")
    rows = []
    for split in args.splits.split(","):
        prefix, suffix = map(int, split.split("/"))
        for n in map(int, args.n.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(0)
            prompt = torch.randint(0, vocab, (prefix,), device="cuda", generator=gen)
            suffixes = list(torch.randint(0, vocab, (n, suffix), device="cuda", generator=gen))
            warm = suffixes[:args.warmup_rows] if args.warmup_rows else suffixes  # every row has the same shapes
            base_s, base_gib, base_retries = harness.timed(lambda: baseline_group(model, prompt, suffixes),
                                                           args.repeats, lambda: baseline_group(model, prompt, warm))
            bound = shape.bound(prefix, [suffix] * n)
            for wave in map(int, args.wave.split(",")):  # against the one baseline measurement above
                pf_s, pf_gib, pf_retries = harness.timed(
                    lambda: prefixflow_group(model, prompt, suffixes, wave), args.repeats,
                    lambda: prefixflow_group(model, prompt, warm, wave))
                model.zero_grad(set_to_none=True)
                rows.append({
                    "model": model_name, "mode": "compile" if args.compile else "eager", "P": prefix, "S": suffix,
                    "N": n, "wave": wave, "offload": args.offload, "prefix_recompute": args.prefix_recompute,
                    "baseline_s": round(base_s, 4), "prefixflow_s": round(pf_s, 4), "speedup": round(base_s / pf_s, 3),
                    "flop_bound": round(bound, 3), "share_of_bound": round(base_s / pf_s / bound, 3),
                    "baseline_peak_gib": round(base_gib, 2), "prefixflow_peak_gib": round(pf_gib, 2),
                    "baseline_alloc_retries": base_retries, "prefixflow_alloc_retries": pf_retries,
                    "repeats": args.repeats, "warmup_rows": args.warmup_rows, **run.environment})
                print(json.dumps(rows[-1]), flush=True)
                run.write(rows, table(rows))  # after every row, so a run cut short keeps what it measured


if __name__ == "__main__":
    main()
