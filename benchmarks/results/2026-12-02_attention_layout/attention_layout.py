"""Do the attention kernels' backwards need their forward's output in the layout that forward returned?

    python benchmarks/attention_layout.py

Offload restores saved tensors on the GPU for Phase C; the replayed attention hands its kernel's backward the
forward's output and log-sum-exp. This runs each split-attention kernel (cuDNN, flash) forward on one prefix of the
Qwen3-1.7B attention shape in transformers' layout, then its backward with the same inputs again (the run-to-run
spread), then with these made contiguous: the output and log-sum-exp; the incoming gradient alone; the log-sum-exp
alone; the gradient, output and log-sum-exp; q/k/v. It prints each gradient's max |difference| / max |value|
against the first backward.
"""

from __future__ import annotations

import argparse

import torch

from hf_prefixflow.core import split_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    scale = args.head_dim ** -0.5

    def heads(count: int) -> torch.Tensor:  # [1, H, P, D] viewed from transformers' [1, P, H, D]
        return torch.randn(1, args.prefix, count, args.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def apart(got, want) -> list[str]:
        return [f"{((a.float() - b.float()).abs().max() / b.float().abs().max()).item():.2e}"
                for a, b in zip(got, want)]

    q, k, v = heads(args.heads), heads(args.kv_heads), heads(args.kv_heads)
    for kernel in (split_attention.CUDNN, split_attention.FLASH):
        out, lse, state = kernel.forward(q, k, v, True, scale)
        grad = heads(args.heads)
        want = kernel.backward(grad, q, k, v, out, lse, True, scale, state)
        print(f"{kernel.name}: out strides {out.stride()}, grad strides {grad.stride()}; dq, dk, dv apart from the "
              f"first backward:")
        cases = {"same inputs again": (grad, q, k, v, out, lse),
                 "out and lse contiguous": (grad, q, k, v, out.contiguous(), lse.contiguous()),
                 "grad contiguous": (grad.contiguous(), q, k, v, out, lse),  # cuDNN's graph cache keys on q/k/v
                 "lse contiguous": (grad, q, k, v, out, lse.contiguous()),
                 "grad, out and lse contiguous": (grad.contiguous(), q, k, v, out.contiguous(), lse.contiguous()),
                 "q, k, v contiguous": (grad, q.contiguous(), k.contiguous(), v.contiguous(), out, lse)}
        for name, inputs in cases.items():
            print(f"  {name}: {apart(kernel.backward(*inputs, True, scale, state), want)}", flush=True)


if __name__ == "__main__":
    main()
