"""PrefixFlow under pipeline parallelism: one rank per stage, each rollout group's completions as 1F1B microbatches.

    torchrun --nproc_per_node 2 examples/pipeline_parallel.py                 # tiny random-init model, CPU (gloo)
    torchrun --nproc_per_node 2 examples/pipeline_parallel.py --model PATH    # a real checkpoint, one GPU per stage

Each rank keeps only its stage of the model (`pipeline.split_model`), then trains `--steps` groups of random data
with a GRPO-shaped loss. With `--check` (the default for the tiny model) every rank also trains the whole model on
one process and compares its own parameters' gradients; the last stage prints each stage's largest relative difference.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_prefixflow
from hf_prefixflow.distributed import pipeline


def load_model(path: str | None, device: torch.device) -> torch.nn.Module:
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                    device_map={"": device})
    config = Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)  # the same weights on every rank
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.float64)


def token_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="path of a checkpoint to load with from_pretrained (untied embeddings)")
    parser.add_argument("--prefix", type=int, default=512, help="prompt tokens")
    parser.add_argument("--suffix", type=int, default=48, help="longest completion")
    parser.add_argument("--completions", type=int, default=8, help="completions in a group (N)")
    parser.add_argument("--microbatches", type=int, default=4, help="suffix waves per group (1F1B microbatches)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare gradients with whole-model training (default: on without --model)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    full = load_model(args.model, device).train()
    whole = copy.deepcopy(full) if (args.check if args.check is not None else not args.model) else None
    stage = hf_prefixflow.apply_prefixflow(pipeline.split_model(full, rank, stages))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-5)
    vocab = stage.config.vocab_size

    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)  # every rank draws the same group
        prompt = torch.randint(0, vocab, (args.prefix,), generator=gen).to(device)
        completions = torch.randint(0, vocab, (args.completions, args.suffix), generator=gen).to(device)
        lengths = torch.randint(args.suffix // 4, args.suffix + 1, (args.completions,), generator=gen).to(device)
        mask = (torch.arange(args.suffix, device=device)[None] < lengths[:, None]).long()
        advantages = torch.randn(args.completions, generator=gen).to(device)

        def loss_fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # summed over microbatches
            logp = token_logp(logits, completions[rows])
            return -(logp * mask[rows] * advantages[rows, None]).sum() / mask.sum()

        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = pipeline.train_group(stage, prompt, completions if rank == 0 else None, mask, loss_fn,
                                    args.microbatches)
        seconds = time.perf_counter() - start
        if whole is not None and step == 0:
            compare(whole, stage, prompt, completions, mask, loss_fn, rank)
        optimizer.step()
        if loss is not None:
            print(f"step {step}: loss {loss.item():+.5f}, {seconds:.2f}s per group "
                  f"(prompt {args.prefix}, {args.completions} completions, {stages} stages)", flush=True)
    dist.destroy_process_group()


def compare(whole, stage, prompt, completions, mask, loss_fn, rank: int) -> None:
    """The whole model trained on [prompt || completion_i] as ordinary sequences, on this rank alone."""
    ids = torch.cat([prompt.expand(len(completions), -1), completions], dim=1)
    full_mask = torch.cat([torch.ones_like(ids[:, : len(prompt)]), mask], dim=1)
    logits = whole(ids, attention_mask=full_mask).logits[:, len(prompt) - 1 : -1]
    loss_fn(logits, torch.arange(len(completions), device=ids.device)).backward()
    reference = dict(whole.named_parameters())
    worst = max(((p.grad - reference[n].grad).abs().max() / reference[n].grad.abs().max()).item()
                for n, p in stage.named_parameters())
    worsts = [0.0] * dist.get_world_size()
    dist.all_gather_object(worsts, worst)  # the last stage prints them, as it prints the losses: lines of several
    for stage_index, stage_worst in enumerate(worsts if rank == len(worsts) - 1 else []):  # processes can interleave
        print(f"stage {stage_index}: gradients vs whole-model training, max relative difference {stage_worst:.2e}",
              flush=True)


if __name__ == "__main__":
    main()
