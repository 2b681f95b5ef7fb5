"""Phase-B attention as two kernel calls merged by log-sum-exp: the prefix read in place, the suffix causal.

A right-padded wave's queries see every cached prefix key and, causally, their own suffix keys. Instead of
concatenating `[prefix ; suffix]` K/V for every wave (a copy of the whole cache per layer per wave) and running a
bottom-right causal kernel over it, this runs
- the prefix part non-causally with the cached K/V as they are: every row reads the same cache, so the wave's rows
  fold into one query sequence (a view of transformers' `[B, L, H, D]` layout: nothing is copied) over the one
  `[1, Hkv, P, D]` cache with the kernels' native GQA; the kernel sums the rows' prefix dK/dV in its fp32
  accumulator and rounds once;
- the suffix part as the ordinary square causal attention of the wave, GQA native too (K/V not repeated);
both on transformers' `[B, L, H, D]`-strided q/k/v as they come, and merges the two by their log-sum-exps (one
compiled element-wise kernel on a GPU, in the memory order of the kernels' outputs). The backward runs each
part's backward kernel with the *merged* output and log-sum-exp: those give every score its true softmax
probability, so each part returns its exact share of dQ and its own dK/dV (flash-style backwards only ever use `out`
and `lse`, never the part's own).
Kernels: cuDNN (falling back to flash for head dims cuDNN rejects) for bf16/fp16 on sm80+ CUDA GPUs, PyTorch's flash
kernel for any dtype on the CPU. Other cases return None and the caller keeps its general path. The merge and the
sums of the parts' gradients run in at least fp32 and round once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import _compat as compat


@dataclass(frozen=True)
class Kernel:
    """A fused attention kernel that returns its log-sum-exp: `forward -> (out, lse, state)`,
    `backward -> dq, dk, dv`."""

    name: str
    forward: Callable
    backward: Callable


def _cpu_forward(q, k, v, causal, scale):
    out, lse = compat.SDPA_FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_backward(grad, q, k, v, out, lse, causal, scale, state):
    return compat.SDPA_FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, scale=scale)


def _flash_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = compat.SDPA_FLASH(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad, q, k, v, out, lse, causal, scale, state):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return compat.SDPA_FLASH_BACKWARD(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = compat.SDPA_CUDNN(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(grad, q, k, v, out, lse, causal, scale, state):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return compat.SDPA_CUDNN_BACKWARD(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


CPU = Kernel("cpu_flash", _cpu_forward, _cpu_backward)
FLASH = Kernel("flash", _flash_forward, _flash_backward)
CUDNN = Kernel("cudnn", _cudnn_forward, _cudnn_backward)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """A GPU's compute capability, read once: every wave's every layer asks."""
    return torch.cuda.get_device_capability(device)


def kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Kernel | None:
    """The kernel this wave's attention can run on, or None: CUDA fp32/fp64, GPUs before sm80, odd or unequal head
    dims (value heads of another size, as DeepSeek-V3's), devices other than CUDA and the CPU."""
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        return None
    if query.device.type == "cpu":
        return CPU
    if query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16) or head_dim % 8:
        return None
    if _capability(query.device) < (8, 0):
        return None
    if head_dim <= 128 and torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available():
        return CUDNN
    return FLASH if head_dim <= 256 and torch.backends.cuda.flash_sdp_enabled() else None


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """Sums of kernel outputs round once, in at least fp32 (fp64 inputs stay fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _fused(fn: Callable) -> Callable:
    """`fn` compiled into one kernel for CUDA tensors, eager elsewhere. Op by op, the merge and the dq sum make a
    pass over memory per op in fp32; fused, the Llama3-8B shape went from 93% to 94% of the FLOP bound. Compiled
    with every size symbolic (`dynamic=True`) the merge took 0.25 ms a call at that shape
    (benchmarks/results/2026-12-01_split_attention_probes/merge_compile_probe.log); with static sizes the merge and
    the dq sum took 3.2 ms over 64 calls of each (2026-12-01_phase_profiles/
    kernel_categories_llama3-8b_wave2_merge_default.log). So sizes start static, and only those that change between
    waves (the rows, the suffix length) turn symbolic on the one recompile that follows, torch.compile's default
    (merge_compile_probe.log: no slower a call than one static shape)."""
    compiled = functools.cache(lambda: torch.compile(fn))  # on first use: dynamo is slow to import

    @functools.wraps(fn)
    def run(*args):
        if not args[0].is_cuda or torch.compiler.is_compiling():  # a compiled caller fuses `fn` into its own graph
            return fn(*args)
        return in_memory_order(compiled(), *args)

    return run


def in_memory_order(fn: Callable, *args: torch.Tensor):
    """`fn(*args)` over `[B, H, L, ...]` tensors, run on their `[B, L, H, ...]` views when that is how the 4-D ones
    lie in memory (the cuDNN and flash kernels' outputs for transformers' query layout): a compiled element-wise
    kernel then walks memory in order. Outputs come back as `[B, H, L, ...]` views."""
    if not all(x.dim() != 4 or x.transpose(1, 2).is_contiguous() for x in args):
        return fn(*args)
    out = fn(*(x.transpose(1, 2) for x in args))
    return tuple(y.transpose(1, 2) for y in out) if isinstance(out, tuple) else out.transpose(1, 2)


@_fused
def _merge(out_p, lse_p, out_s, lse_s):
    lse = torch.logaddexp(lse_p, lse_s)
    dtype = _accumulation_dtype(out_p)
    out = out_p.to(dtype) * (lse_p - lse).exp().unsqueeze(-1) + out_s.to(dtype) * (lse_s - lse).exp().unsqueeze(-1)
    return out.to(out_p.dtype), lse


@_fused
def _sum(dq_p, dq_s):
    dtype = _accumulation_dtype(dq_s)
    return (dq_p.to(dtype) + dq_s.to(dtype)).to(dq_s.dtype)


def _rows_folded(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, L, ...]` as `[1, H, B*L, ...]`: the rows' queries as one sequence (a view when `x` lies as
    `[B, L, H, ...]`, as transformers' q/k/v and the kernels' outputs do; a copy otherwise). Folded through that
    layout the strides stay those of a `[1, B*L, H, ...]` tensor seen as `[1, H, B*L, ...]`, as the kernels see
    transformers' own; one row stays the tensor it is."""
    if x.shape[0] == 1:
        return x
    rows = x.transpose(1, 2)
    return rows.reshape(1, -1, *rows.shape[2:]).transpose(1, 2)


def _rows_unfolded(x: torch.Tensor, batch: int) -> torch.Tensor:
    """`[1, H, B*L, ...]` back as `[B, H, L, ...]` (always a view)."""
    return x if batch == 1 else x[0].unflatten(1, (batch, -1)).transpose(0, 1)


def in_layout(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`x` laid out with `stride`, copied only when it lies otherwise. A saved-tensor hook may hand a kernel's output
    back in another layout (torch's `save_on_cpu(pin_memory=True)` returns it contiguous), and cuDNN's attention
    backward returns wrong gradients for an output that does not lie as its forward left it
    (benchmarks/results/2026-12-02_attention_layout/attention_layout.py)."""
    if x.stride() == tuple(stride):
        return x
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def _lse_for(lse: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A log-sum-exp as a backward kernel reads it: in its own shape and contiguous. The GPU kernels take its
    pointer without its strides; the merged one may lie in any order (the compiled merge picks it from its inputs)."""
    return _as_shape(lse, shape).contiguous()


def _as_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`x.reshape(shape)`, without dispatching a view when `x` has that shape already (the CPU and flash kernels'
    log-sum-exps do: a few ops fewer per layer and wave)."""
    return x if x.shape == shape else x.reshape(shape)


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, scale, kernel: Kernel):
        batch = query.shape[0]
        out_p, lse_p, state_p = kernel.forward(_rows_folded(query), prefix_key, prefix_value, False, scale)
        out_s, lse_s, state_s = kernel.forward(query, key, value, True, scale)
        # lse layouts differ between kernels (e.g. a trailing 1): merge in `[B, Hq, L]`, hand each back its own.
        shape_p, shape_s = lse_p.shape, lse_s.shape
        out, lse = _merge(_rows_unfolded(out_p, batch), _rows_unfolded(_as_shape(lse_p, shape_p[:3]), batch),
                          out_s, _as_shape(lse_s, shape_s[:3]))
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out, lse)
        ctx.meta = (scale, kernel, shape_p, shape_s, state_p, state_s, out.stride())
        return out

    @staticmethod
    def backward(ctx, grad):
        query, prefix_key, prefix_value, key, value, out, lse = ctx.saved_tensors
        scale, kernel, shape_p, shape_s, state_p, state_s, out_stride = ctx.meta
        out, grad = in_layout(out, out_stride), in_layout(grad, out_stride)  # cuDNN caches graphs by q/k/v layout
        lse_p = _lse_for(_rows_folded(lse), shape_p)
        dq_p, dk_p, dv_p = kernel.backward(_rows_folded(grad), _rows_folded(query), prefix_key, prefix_value,
                                           _rows_folded(out), lse_p, False, scale, state_p)
        dq_s, dk, dv = kernel.backward(grad, query, key, value, out, _lse_for(lse, shape_s), True, scale, state_s)
        return _sum(_rows_unfolded(dq_p, query.shape[0]), dq_s), dk_p, dv_p, dk, dv, None, None


def split_attention(
    query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, scale: float | None, kernel: Kernel,
) -> torch.Tensor:
    """Attention of right-padded suffix rows `query [B, Hq, L, D]` over the shared prefix K/V `[1, Hkv, P, D]` and,
    causally, their own `key/value [B, Hkv, L, D]`; returns `[B, Hq, L, D]`."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _SplitAttention.apply(query, prefix_key, prefix_value, key, value, scale, kernel)
