"""The compiled log-sum-exp merge of split attention, per call, by how torch.compile treats its sizes.

    python benchmarks/merge_compile.py

For the Phase-B shapes of Llama3-8B (two rows, 32 heads) and Qwen3-1.7B (one and four rows, 16 heads), suffix
length 2048: the merge compiled with every size symbolic (`dynamic=True`), specialised to one shape, and with
torch.compile's default after two other shapes (rows and length symbolic, heads and head dim static), next to the
module's own `split_attention._merge`. Each is timed over 50 back-to-back calls (CUDA events), so a call's host-side
cost shows where it exceeds the kernel's.
"""

from __future__ import annotations

import types

import torch

from hf_prefixflow.core import split_attention as sa


def timeit(fn, n: int = 50) -> float:
    """Microseconds per call over `n` back-to-back calls after five warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def fresh(fn):
    """A copy of `fn` with its own code object, so that each variant has its own dynamo cache."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def inputs(rows: int, heads: int, length: int, dim: int = 128) -> tuple:
    """The merge's inputs as split attention makes them: both cuDNN parts of one wave over a 10k prefix."""
    q = torch.randn(rows, length, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    prefix = torch.randn(1, 10240, 8, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    own = torch.randn(rows, length, 8, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    out_p, lse_p, _ = sa.CUDNN.forward(sa._rows_folded(q), prefix, prefix, False, dim ** -0.5)
    out_s, lse_s, _ = sa.CUDNN.forward(q, own, own, True, dim ** -0.5)
    return (sa._rows_unfolded(out_p, rows), sa._rows_unfolded(lse_p.reshape(lse_p.shape[:3]), rows), out_s,
            lse_s.reshape(lse_s.shape[:3]))


def main() -> None:
    plain = sa._merge.__wrapped__
    for rows, heads in [(2, 32), (1, 16), (4, 16)]:
        args = inputs(rows, heads, 2048)
        old = torch.compile(fresh(plain), dynamic=True)
        static = torch.compile(fresh(plain))
        auto = torch.compile(fresh(plain))
        for other in (inputs(rows, heads, 1536), inputs(rows + 1, heads, 1792)):  # rows and length turn symbolic
            sa.in_memory_order(auto, *other)
        want = plain(*[a.double() for a in args])
        for name, fn in (("dynamic=True (before)", old), ("default, one shape (static)", static),
                         ("default, after two other shapes", auto), ("split_attention._merge (module)", None)):
            run = (lambda: sa._merge(*args)) if fn is None else (lambda: sa.in_memory_order(fn, *args))
            err = max((g.double() - w).abs().max().item() for g, w in zip(run(), want))
            print(f"B={rows} H={heads} L=2048 {name:35s} {timeit(run):7.1f} us  max err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
