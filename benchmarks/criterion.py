"""The primary criterion of the GPU equivalence checks: per parameter, PrefixFlow's gradient error against a
high-precision full-sequence reference, divided by the bf16 baseline's own error against it.

    err(g, r) = ||g - r|| / ||r||          (norms over the parameter's whole tensor, in fp64)
    ratio     = err(candidate, r_c) / err(baseline, r_b)          passes when the worst parameter's ratio <= LIMIT

`r` is the gradient of the full sequences in fp64 (or fp32), without autocast, at the weights the judged gradient
was taken at (`r_c` and `r_b` are one tensor while both sides hold the same weights); the baseline is the bf16
full-sequence path. A gradient wrong by more than about two thirds of the baseline's own bf16 error fails (errors
add in quadrature: sqrt(1 + 0.66^2) = 1.2), however small the gradient: element-wise tolerances with an absolute
floor let small gradients through, and weights after AdamW steps move by about the learning rate whatever the
gradient. The ratio is a statistic of rounding noise and scatters where few elements carry a parameter's error
(norm weights, q/k norms, MoE routers): there valid bf16 computations (stock TRL under ZeRO, PrefixFlow over the
concatenated K/V) came to 1.2-1.5 on the CPU's tiny models after a few SGD steps; `ratios` keeps every
parameter's, so a run can be judged again at another limit.

Guards: a parameter whose reference gradient is zero is judged by absolute errors (a relative one is undefined);
a baseline error of zero gives ratio 0 if the candidate's is zero too and infinity otherwise; a non-finite error
counts as infinity; a missing gradient (None) counts as zero. Pure torch: it runs wherever the gradients are, CPU
included.

`variant(name, layers)` patches in a variant of PrefixFlow for the duration of a run (monkeypatched here, the library
untouched). Broken ones must fail the criterion: `phase-c-skipped` (the prefix gets no gradient from the suffixes),
`drop-layer-gk` (the middle layer's gK zeroed before Phase C), `split-own-stats` (Phase B's split attention backward
runs each part's kernel with the part's own output and log-sum-exp instead of the merged ones). The diagnostic
`concat-attention` is correct and must pass: padded waves attend over the concatenated prefix and suffix K/V instead
of the split attention, which tells a precision effect of the split kernels apart from an error elsewhere.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import torch

from hf_prefixflow.core import scheduler
from hf_prefixflow.core import split_attention as split

LIMIT = 1.2
BROKEN = ("phase-c-skipped", "drop-layer-gk", "split-own-stats")
DIAGNOSTIC = ("concat-attention",)
PAPER = "|x-y| <= 1e-3 + 1e-2*max(|x|,|y|)"


def paper_violation(x: torch.Tensor, y: torch.Tensor) -> float:
    """The paper's element-wise tolerance, max over elements of |x-y| / (1e-3 + 1e-2 max(|x|,|y|)); <= 1 passes.
    Secondary: reported beside the primary criterion, never deciding a row."""
    x, y = torch.as_tensor(x).double(), torch.as_tensor(y).double()
    return ((x - y).abs() / (1e-3 + 1e-2 * torch.maximum(x.abs(), y.abs()))).max().item()


def _error(grad: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, float]:
    """(relative error, reference norm); the absolute error where the reference is zero."""
    ref = reference.double()
    norm = ref.norm().item()
    diff = (ref if grad is None else grad.to(ref.device, torch.float64) - ref).norm().item()
    error = diff / norm if norm > 0 else diff
    return (error if math.isfinite(error) else math.inf), norm


def _ratio(candidate: float, baseline: float) -> float:
    if baseline == 0.0:
        return 0.0 if candidate == 0.0 else math.inf
    return candidate / baseline


def judge(candidate: dict, baseline: dict, reference: dict, candidate_reference: dict | None = None,
          limit: float = LIMIT, controls: tuple = ()) -> dict:
    """Judge `candidate` gradients (name -> tensor or None) against `baseline`'s, each against its reference
    (`candidate_reference` defaults to `reference`, the baseline's). `controls` are further valid bf16 full-sequence
    runs as (gradients, reference) pairs, e.g. stock TRL under the candidate's engine where that engine keeps other
    precisions than the baseline: a parameter's baseline error is then the largest of them all. A parameter without
    a reference gradient must have none on either side. Returns a JSON-ready summary: the worst parameter (name,
    ratio, both errors), the median ratio and errors, every parameter's ratio, parameters with a zero reference, and
    `passed`."""
    candidate_reference = reference if candidate_reference is None else candidate_reference
    per_param, zero, unexpected = {}, [], []
    for name in sorted(reference.keys() | candidate.keys() | baseline.keys()):
        ref_b, ref_c = reference.get(name), candidate_reference.get(name)
        if ref_b is None or ref_c is None:
            if any(x is not None for x in (ref_b, ref_c, candidate.get(name), baseline.get(name))):
                unexpected.append(name)
            continue
        err_b, norm = _error(baseline.get(name), ref_b)
        for grads, ref in controls:
            if ref.get(name) is not None:
                err_b = max(err_b, _error(grads.get(name), ref[name])[0])
        err_c, _ = _error(candidate.get(name), ref_c)
        if norm == 0.0:
            zero.append(name)
        per_param[name] = (_ratio(err_c, err_b), err_c, err_b)
    if not per_param:
        return {"passed": False, "error": "no parameter to compare"}
    worst = max(per_param, key=lambda n: per_param[n][0])
    result = {
        "worst_ratio": per_param[worst][0], "worst_param": worst,
        "worst_param_err": {"candidate": per_param[worst][1], "baseline": per_param[worst][2]},
        "median_ratio": statistics.median(r for r, _, _ in per_param.values()),
        "median_err": {"candidate": statistics.median(e for _, e, _ in per_param.values()),
                       "baseline": statistics.median(e for _, _, e in per_param.values())},
        "ratios": {name: ratio for name, (ratio, _, _) in per_param.items()}, "limit": limit,
        "passed": per_param[worst][0] <= limit and not unexpected,
    }
    if zero:
        result["zero_reference"] = zero
    if unexpected:
        result["unexpected_gradients"] = unexpected  # a gradient where one side or the reference has none
    return result


def verdict(passed: bool | None, broken: bool, error: str | None = None) -> str:
    """The row's verdict: a correct or diagnostic row must pass the primary criterion, a broken variant must fail
    it; a row that ended in an error (the variant never applied, a kernel missing) did neither."""
    if error is not None:
        return "ERROR: " + ("broken variant " if broken else "") + "did not finish"
    if passed is None:
        return "-"
    if broken:
        return "ERROR: broken variant passed" if passed else "broken variant: failed as required"
    return "pass" if passed else "FAIL"


def as_expected(row: dict, broken: bool) -> bool:
    """Whether a row came out as it must (correct rows pass, broken ones fail, no errors); control rows (passed
    None) always do."""
    if "error" in row:
        return False
    return row.get("passed") is None or row["passed"] != broken


def applies(name: str | None, attention: str, layout: str) -> bool:
    """Whether variant `name` can act on a run with this base attention and wave layout: the split attention (and
    so `split-own-stats` and `concat-attention`) serves padded `sdpa` waves only."""
    return name not in ("split-own-stats", "concat-attention") or (attention == "sdpa" and layout == "padded")


def format_ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}" if x < 100 else f"{x:.3g}"


def judged_cells(row: dict) -> list[str]:
    """A judged row's table cells: worst ratio (parameter), median ratio, median errors baseline / candidate."""
    return [f"{format_ratio(row['worst_ratio'])} (`{row['worst_param']}`)", format_ratio(row["median_ratio"]),
            f"{row['median_err']['baseline']:.2e} / {row['median_err']['candidate']:.2e}"]


class _OwnStatistics(torch.autograd.Function):
    """`split_attention` whose backward runs each part's kernel with the part's own output and log-sum-exp: the
    scores then get each part's own softmax, not the merged one (the forward is the library's)."""

    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, scale, kernel):
        batch = query.shape[0]
        out_p, lse_p, state_p = kernel.forward(split._rows_folded(query), prefix_key, prefix_value, False, scale)
        out_s, lse_s, state_s = kernel.forward(query, key, value, True, scale)
        out, _ = split._merge(split._rows_unfolded(out_p, batch),
                              split._rows_unfolded(lse_p.reshape(lse_p.shape[:3]), batch),
                              out_s, lse_s.reshape(lse_s.shape[:3]))
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out_p, lse_p, out_s, lse_s)
        ctx.meta = (scale, kernel, state_p, state_s)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, prefix_key, prefix_value, key, value, out_p, lse_p, out_s, lse_s = ctx.saved_tensors
        scale, kernel, state_p, state_s = ctx.meta
        grad_p = split.in_layout(split._rows_folded(grad), out_p.stride())  # each kernel gets its own layout
        dq_p, dk_p, dv_p = kernel.backward(grad_p, split._rows_folded(query), prefix_key, prefix_value, out_p,
                                           lse_p.contiguous(), False, scale, state_p)
        dq_s, dk, dv = kernel.backward(split.in_layout(grad, out_s.stride()), query, key, value, out_s,
                                       lse_s.contiguous(), True, scale, state_s)
        return split._sum(split._rows_unfolded(dq_p, query.shape[0]), dq_s), dk_p, dv_p, dk, dv, None, None


@contextlib.contextmanager
def variant(name: str | None, layers: int):
    """Patch in the variant `name` (None: PrefixFlow as it is) of a model with `layers` decoder layers; yields a
    dict whose "calls" counts the patched code's uses (0 after a run: the variant never applied there)."""
    used = {"calls": 0}
    if name is None:
        yield used
        return
    phase_c, split_fn, kernel_for = scheduler.delayed_backward, split.split_attention, split.kernel_for
    middle = layers // 2

    def skipped(caches, *args, **kwargs):
        used["calls"] += 1
        return 0

    def drop_gk(caches, *args, **kwargs):
        for cache in caches:
            entry = cache.layers.get(middle)  # a pipeline stage caches its own layers only
            if entry is not None and entry.key.grad is not None:
                used["calls"] += 1
                entry.key.grad = torch.zeros_like(entry.key.grad)
        return phase_c(caches, *args, **kwargs)

    def own_statistics(query, prefix_key, prefix_value, key, value, scale, kernel):
        used["calls"] += 1
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return _OwnStatistics.apply(query, prefix_key, prefix_value, key, value, scale, kernel)

    def no_split(query, key, value):
        used["calls"] += kernel_for(query, key, value) is not None
        return None

    module, attr, fn = {"phase-c-skipped": (scheduler, "delayed_backward", skipped),
                        "drop-layer-gk": (scheduler, "delayed_backward", drop_gk),
                        "split-own-stats": (split, "split_attention", own_statistics),
                        "concat-attention": (split, "kernel_for", no_split)}[name]
    setattr(module, attr, fn)
    try:
        yield used
    finally:
        scheduler.delayed_backward, split.split_attention, split.kernel_for = phase_c, split_fn, kernel_for
