"""Phase-B attention kernels on a GPU: which way of attending a suffix wave to `[prefix ; suffix]` is fastest.

    python benchmarks/attention_kernels.py --prefix 10240 --suffix 2048

Times forward + backward (CUDA events, median of 10 after warm-up) of one layer's attention, Qwen3-1.7B heads
(16 query / 8 KV heads, head dim 128), bf16:
- `flash bottom-right`: SDPA with a lower-right CausalBias (PyTorch's FA2 kernel), what Phase B runs today;
- `cudnn + bool mask`: SDPA restricted to cuDNN with the materialized visibility mask;
- `cudnn split (no merge)`: the two halves a log-sum-exp split would run, prefix non-causal + suffix causal;
- `split cudnn` / `split flash`: `hf_prefixflow.core.split_attention`, what Phase B runs now: the prefix read in place
  (non-causal, GQA folded into the query length), the suffix causal, merged by log-sum-exp, exact backward;
- `cudnn square causal`: the baseline's kernel on the full `[P || S]` sequence, for its FLOP rate.
Before timing, each split kernel's output and gradients are checked against fp32 math (bf16 tolerance). Writes
`attention_kernels.json` (the config and a row per case), `.md` and a generated `MANIFEST.md` to `--out`
(`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import harness
from hf_prefixflow.core import split_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_attention_kernels")
    args = parser.parse_args()
    p, s, h, hk, d = args.prefix, args.suffix, args.heads, args.kv_heads, args.dim
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(1, h, s, d), make(1, hk, p + s, d), make(1, hk, p + s, d)
    kr, vr = (x.detach().repeat_interleave(h // hk, dim=1).requires_grad_() for x in (k, v))
    grad = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(s, p + s, dtype=torch.bool, device="cuda").tril(p)

    def run(fn):
        return lambda: fn().backward(grad)

    cases = {
        "flash bottom-right": run(lambda: F.scaled_dot_product_attention(
            q, kr, vr, attn_mask=causal_lower_right(s, p + s))),
        "cudnn + bool mask": run(lambda: _cudnn(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))),
        "cudnn split (no merge)": lambda: (
            _cudnn(lambda: F.scaled_dot_product_attention(q, kr[:, :, :p], vr[:, :, :p])).backward(grad),
            _cudnn(lambda: F.scaled_dot_product_attention(q, kr[:, :, p:], vr[:, :, p:], is_causal=True)).backward(grad)),
    }
    part = lambda x, sl: x.detach()[:, :, sl].contiguous().requires_grad_()  # noqa: E731
    pk, pv, sk, sv = part(k, slice(None, p)), part(v, slice(None, p)), part(k, slice(p, None)), part(v, slice(p, None))
    for kernel in (split_attention.CUDNN, split_attention.FLASH):
        check_split(kernel, q, pk, pv, sk, sv, kr, vr, grad)
        cases[f"split {kernel.name}"] = (lambda kernel=kernel: split_attention.split_attention(
            q, pk, pv, sk, sv, None, kernel).backward(grad))
    full_q = make(1, h, p + s, d)
    full_grad = torch.randn_like(full_q)
    cases["cudnn square causal"] = lambda: _cudnn(
        lambda: F.scaled_dot_product_attention(full_q, kr, vr, is_causal=True)).backward(full_grad)

    flops_wave = 4 * 2.5 * h * d * s * (p + s / 2) + 4 * h * d * s * (p + s / 2)  # fwd + 2.5x bwd
    flops_full = (4 + 10) * h * d * (p + s) ** 2 / 2
    rows = []
    for name, fn in cases.items():
        try:
            ms = harness.median_seconds(fn, repeats=10, warmup=3) * 1000
            flops = flops_full if "square" in name else flops_wave
            rows.append({"case": name, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
        except Exception as exc:  # a kernel that cannot run this case is a result too
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    run = harness.RunFolder("attention_kernels", args.out)
    meta = {"P": p, "S": s, "heads": h, "kv_heads": hk, "dim": d, **run.environment}
    run.write({"config": meta, "rows": rows}, table(meta, rows))


def table(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"One layer's attention, forward and backward: P={meta['P']}, S={meta['S']}, {meta['heads']} / "
             f"{meta['kv_heads']} heads, head dim {meta['dim']}, bf16; median of 10 after 3.", "",
             "| case | ms | TFLOP/s |", "| --- | --- | --- |"]
    return lines + [f"| {r['case']} | {r['ms']} | {r['tflops']} |" if "error" not in r else
                    f"| {r['case']} | {r['error'][:120]} | - |" for r in rows]


def check_split(kernel, q, pk, pv, sk, sv, kr, vr, grad) -> None:
    """The split kernel's output and input gradients against fp32 math on the concatenated K/V."""
    inputs = (q, pk, pv, sk, sv)
    out = split_attention.split_attention(*inputs, None, kernel)
    got = (out, *torch.autograd.grad(out, inputs, grad))
    wide = [x.detach().float().requires_grad_() for x in (q, kr, vr)]
    ref = F.scaled_dot_product_attention(*wide, attn_mask=causal_lower_right(q.shape[2], kr.shape[2]))
    dq, dk, dv = torch.autograd.grad(ref, wide, grad.float())
    groups = q.shape[1] // pk.shape[1]
    fold = lambda x: x.unflatten(1, (-1, groups)).sum(2)  # noqa: E731  (repeated heads -> KV heads)
    p = pk.shape[2]
    want = (ref, dq, fold(dk[:, :, :p]), fold(dv[:, :, :p]), fold(dk[:, :, p:]), fold(dv[:, :, p:]))
    for name, a, b in zip(("out", "dq", "dk prefix", "dv prefix", "dk suffix", "dv suffix"), got, want):
        err = ((a.float() - b).abs() - (1e-3 + 1e-2 * torch.maximum(a.float().abs(), b.abs()))).max().item()
        if err > 0:
            raise AssertionError(f"split {kernel.name}: {name} outside the bf16 tolerance by {err:.3e}")
    print(f"split {kernel.name}: output and gradients within tolerance", flush=True)


def _cudnn(fn):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return fn()


if __name__ == "__main__":
    main()
