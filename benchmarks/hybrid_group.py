"""One group of a hybrid model (recurrent + attention layers) on the GPU: PrefixFlow against N full sequences.

    python benchmarks/hybrid_group.py --shape qwen3_5 --prefix 10240 --suffix 2048 -n 16 --out DIR
    python benchmarks/hybrid_group.py --shape nemotron_h --criterion-only --out DIR
    python benchmarks/hybrid_group.py --small --device cpu --criterion-only --seeds 6 --crit-prefix 512 \
        --crit-suffix 128 --wave 2 --out DIR      # the criterion's scatter on an exact path, CPU

Random-weight models of a real family's layer pattern, bf16, one device, the same kernels on both sides (a fused
package where installed, e.g. flash-linear-attention, else transformers' PyTorch path; each row names which ran).
Timed: the baseline trains `[P || S_i]` one row per microbatch; PrefixFlow runs Phase A, the completions in waves,
and Phase C; both with layer checkpointing (non-reentrant) and each step synchronised. The FLOP ratio counts matmul
weights for every token and the quadratic attention term on attention layers only; the recurrent scans' own work,
linear in the tokens, is left out, so the ratio is not a bound where the scans cost much (transformers' PyTorch
path): the token ratio then bounds it from above. The criterion (`benchmarks/criterion.py`): per parameter,
PrefixFlow's gradient error against an fp32 full-sequence reference over the bf16 baseline's own, at most 1.2; a
broken variant (the recurrent states' gradients dropped before Phase C) must fail it. `--small --device cpu` runs the
criterion on the CPU's PyTorch kernels (exact in float64, `tests/test_states.py`) over several data seeds: how far the
ratio of a correct run scatters per parameter."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import transformers
from transformers import AutoConfig

import hf_prefixflow
from hf_prefixflow import _compat
from hf_prefixflow.core import kv_cache

import criterion
import harness

SHAPES = {
    # Qwen3.5's pattern: three gated delta-net layers, then one attention layer.
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=151936,
        layer_types=["linear_attention"] * 3 + ["full_attention"]) ),
    # Nemotron-H's pattern: Mamba2 and MLP layers with an attention layer in every few.
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128, vocab_size=131072,
        layers_block_type=["mamba", "mlp", "mamba", "mlp", "attention", "mlp"] * 4)),
}


# The same layer patterns at a width the CPU trains in seconds (`--small`): the criterion's scatter on the CPU.
SMALL = {
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=1024),
    "nemotron_h": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=32, mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
                       chunk_size=32, vocab_size=1024,
                       layers_block_type=["mamba", "mlp", "mamba", "mlp", "attention", "mlp"] * 2),
}


def build(shape: str, dtype: torch.dtype, device: str, layers: int | None = None,
          small: bool = False) -> torch.nn.Module:
    """A random-weight model of `shape`'s layer pattern; `layers` keeps only its first layers (a quick warm-up),
    `small` the pattern at `SMALL`'s width."""
    model_type, class_name, options = SHAPES[shape]
    options = dict(options, **(SMALL[shape] if small else {}))
    if "layer_types" in options and options["layer_types"] is not None and model_type == "qwen3_5_text":
        options["layer_types"] = options["layer_types"] * (options["num_hidden_layers"] // 4)
    if model_type == "nemotron_h":
        options["num_hidden_layers"] = len(options["layers_block_type"])
    if layers is not None:
        key = "layer_types" if model_type == "qwen3_5_text" else "layers_block_type"
        options[key] = options[key][:layers]
        options["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **options)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, class_name)(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.config._attn_implementation = "sdpa"
    return model


def flop_ratio(model: torch.nn.Module, prefix: int, suffixes: list[int]) -> float:
    """Full sequences' training FLOPs over PrefixFlow's (module docstring)."""
    config = model.config
    layers = model.model.layers
    vocab, hidden = config.vocab_size, config.hidden_size

    def layer_cost(layer, tokens: int, context: int) -> float:
        weights = sum(p.numel() for n, p in layer.named_parameters() if p.dim() >= 2)
        attention = getattr(layer, "self_attn", None) or (getattr(layer, "mixer", None)
                                                          if hasattr(getattr(layer, "mixer", None), "k_proj") else None)
        quadratic = 0.0
        if attention is not None and hasattr(attention, "q_proj"):
            width = attention.q_proj.out_features // (2 if getattr(config, "attn_output_gate", False) else 1)
            quadratic = 12 * width * (tokens * context + tokens * tokens / 2)
        return 6 * weights * tokens + quadratic

    def cost(tokens: int, context: int) -> float:
        return sum(layer_cost(layer, tokens, context) for layer in layers)

    head = 6 * hidden * vocab
    full = sum(cost(prefix + s, 0) + head * s for s in suffixes)
    shared = cost(prefix, 0) + sum(cost(s, prefix) + head * s for s in suffixes)
    return full / shared


def _loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    return (logp * weights).sum()


def full_sequences(model, prefix, suffixes, weights, autocast: bool) -> float:
    total = 0.0
    for suffix, weight in zip(suffixes, weights):
        ids = torch.cat([prefix, suffix])[None]
        with torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model(input_ids=ids, logits_to_keep=len(suffix) + 1).logits[0, :-1]
            loss = _loss(logits, suffix, weight)
        loss.backward()
        total += loss.item()
    return total


def prefixflow(model, prefix, suffixes, weights, wave: int) -> float:
    total = 0.0
    with hf_prefixflow.prefix_group(model, prefix) as group:
        for start in range(0, len(suffixes), wave):
            rows = suffixes[start:start + wave]
            ids = torch.stack(rows)
            logits = group(ids).logits
            loss = sum(_loss(logits[r], rows[r], weights[start + r]) for r in range(len(rows)))
            loss.backward()
            total += loss.item()
    return total


def timed(fn, repeats: int) -> tuple[list[float], float]:
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, torch.cuda.max_memory_allocated() / 2**30


def data(vocab: int, prefix: int, suffix: int, n: int, device: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(0, vocab, (prefix,), generator=gen).to(device)
    s = [torch.randint(0, vocab, (suffix,), generator=gen).to(device) for _ in range(n)]
    w = [torch.randn(suffix, generator=gen).to(device) / (n * suffix) for _ in range(n)]
    return p, s, w


def kernels(model: torch.nn.Module) -> str:
    """Which of the modeling file's kernel functions run a fused package and which the PyTorch reference."""
    module = __import__(type(model).__module__, fromlist=["_"])
    fused, reference = [], []
    for name, fn in sorted(vars(module).items()):
        cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None)
                         or ()))
        if "implementation" in cells and "torch_function" in cells:
            same = cells["implementation"].cell_contents is cells["torch_function"].cell_contents
            (reference if same else fused).append(name)
    return f"fused: {', '.join(fused) or 'none'}; PyTorch: {', '.join(reference) or 'none'}"


def speed(args) -> dict:
    model = build(args.shape, torch.bfloat16, "cuda", args.layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    prefix, suffixes, weights = data(model.config.vocab_size, args.prefix, args.suffix, args.n, "cuda")
    pf_model = hf_prefixflow.apply_prefixflow(model)
    row = dict(shape=args.shape, layers=len(model.model.layers), prefix=args.prefix, suffix=args.suffix, n=args.n, wave=args.wave,
               kernels=kernels(model),
               checkpointing="full (non-reentrant), both sides",
               params_b=sum(p.numel() for p in model.parameters()) / 1e9,
               flop_ratio=flop_ratio(model, args.prefix, [args.suffix] * args.n))
    for name, fn in (("full_sequences", lambda: full_sequences(model, prefix, suffixes, weights, False)),
                     ("prefixflow", lambda: prefixflow(pf_model, prefix, suffixes, weights, args.wave))):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn()  # warm-up (Triton compilation)
        torch.cuda.synchronize()
        row[f"{name}_warmup_s"] = time.perf_counter() - start
        print(name, f"warm-up {row[f'{name}_warmup_s']:.1f} s", flush=True)
        model.zero_grad(set_to_none=True)
        times, peak = timed(lambda: (model.zero_grad(set_to_none=True), fn()), args.repeats)
        row[f"{name}_s"] = times
        row[f"{name}_median_s"] = statistics.median(times)
        row[f"{name}_peak_gib"] = peak
        print(name, times, f"{peak:.1f} GiB", flush=True)
    row["speedup"] = row["full_sequences_median_s"] / row["prefixflow_median_s"]
    row["share_of_flop_ratio"] = row["speedup"] / row["flop_ratio"]
    return row


def _grads(model) -> dict:
    return {n: (p.grad.detach().double().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def criterion_rows(args, seed: int = 1) -> list[dict]:
    """bf16 gradients of both paths against an fp32 full-sequence reference; the broken variant must fail."""
    device = args.device
    reference_model = build(args.shape, torch.float32, device, small=args.small)
    prefix, suffixes, weights = data(reference_model.config.vocab_size, args.crit_prefix, args.crit_suffix,
                                     args.crit_n, device, seed)
    with _compat.reference_kernels(type(reference_model)):  # the math itself, not the fused kernels under test
        full_sequences(reference_model, prefix, suffixes, weights, autocast=False)
    reference = _grads(reference_model)
    del reference_model
    baseline_model = build(args.shape, torch.bfloat16, device, small=args.small)
    full_sequences(baseline_model, prefix, suffixes, weights, autocast=False)
    baseline = _grads(baseline_model)
    del baseline_model
    rows = []
    for variant in ("correct", "state-gradients-dropped"):
        model = hf_prefixflow.apply_prefixflow(build(args.shape, torch.bfloat16, device, small=args.small))
        with _variant(variant):
            prefixflow(model, prefix, suffixes, weights, args.wave)
        judged = criterion.judge(_grads(model), baseline, reference)
        broken = variant != "correct"
        rows.append(dict(shape=args.shape, small=args.small, seed=seed, device=device, variant=variant,
                         kernels=kernels(model), prefix=args.crit_prefix,
                         suffix=args.crit_suffix, n=args.crit_n, worst_ratio=judged["worst_ratio"],
                         worst_parameter=judged["worst_param"], median_ratio=judged["median_ratio"],
                         passed=judged["passed"], ratios=judged["ratios"],
                         verdict=criterion.verdict(judged["passed"], broken)))
        print(rows[-1], flush=True)
        del model
    return rows


def kernel_check(args) -> list[dict]:
    """The fused gated delta rule (flash-linear-attention) against transformers' PyTorch reference, float32 on the
    GPU, from a nonzero initial state: the output, the final state and every input's gradient, the initial state's
    included (PrefixFlow's Phase C needs it). The broken variant detaches the initial state in the fused call."""
    module = __import__("transformers.models.qwen3_5.modeling_qwen3_5", fromlist=["_"])
    fused = module.torch_chunk_gated_delta_rule
    reference = getattr(fused, "__wrapped__", fused)
    if fused.__closure__ is None or dict(zip(fused.__code__.co_freevars, fused.__closure__))[
            "implementation"].cell_contents is reference:
        raise SystemExit("kernel check: no fused gated delta rule is installed (flash-linear-attention)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # As Qwen3.5's layer calls it: query and key already repeated to the value heads (the PyTorch path needs that).
    batch, tokens, k_heads, v_heads, dim = 2, args.check_tokens, 8, 8, 128

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    inputs = dict(query=rand(batch, tokens, k_heads, dim), key=rand(batch, tokens, k_heads, dim),
                  value=rand(batch, tokens, v_heads, dim), g=-torch.rand(batch, tokens, v_heads, device="cuda",
                                                                         generator=gen) * 0.1,
                  beta=torch.rand(batch, tokens, v_heads, device="cuda", generator=gen),
                  initial_state=rand(batch, v_heads, dim, dim) * 0.1)
    upstream = (rand(batch, tokens, v_heads, dim), rand(batch, v_heads, dim, dim))

    def run(fn, detach_state: bool):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        call = dict(leaves, initial_state=leaves["initial_state"].detach() if detach_state
                    else leaves["initial_state"])
        # q, k, v positionally: the fused kernel names them q, k, v, the reference query, key, value.
        out, state = fn(call.pop("query"), call.pop("key"), call.pop("value"), **call, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        ((out * upstream[0]).sum() + (state * upstream[1]).sum()).backward()
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in leaves.items()}
        return dict(output=out.detach(), final_state=state.detach(), **{f"grad_{k}": g for k, g in grads.items()})

    want = run(reference, False)
    rows = []
    for variant, detach in (("correct", False), ("initial-state-detached", True)):
        got = run(fused, detach)
        errors = {k: ((got[k].double() - want[k].double()).norm() / want[k].double().norm()).item() for k in want}
        worst = max(errors, key=errors.get)
        passed = errors[worst] <= args.check_tolerance
        rows.append(dict(variant=variant, tokens=tokens, relative_errors=errors, worst=worst,
                         worst_error=errors[worst], tolerance=args.check_tolerance, passed=passed,
                         verdict=criterion.verdict(passed, variant != "correct")))
        print(rows[-1], flush=True)
    return rows


@contextlib.contextmanager
def _variant(name: str):
    if name == "correct":
        yield
        return
    original = kv_cache.TrainingKVCache.capture_state
    kv_cache.TrainingKVCache.capture_state = lambda self, key, live: original(self, key, live.detach())
    try:
        yield
    finally:
        kv_cache.TrainingKVCache.capture_state = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_5")
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--wave", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--crit-prefix", type=int, default=1024)
    parser.add_argument("--crit-suffix", type=int, default=256)
    parser.add_argument("--crit-n", type=int, default=4)
    parser.add_argument("--layers", type=int, help="keep only the first layers of the shape (a quick warm-up)")
    parser.add_argument("--kernel-check", action="store_true",
                        help="only: the fused gated delta rule against the PyTorch reference (float32)")
    parser.add_argument("--check-tokens", type=int, default=333)
    parser.add_argument("--check-tolerance", type=float, default=1e-2)
    parser.add_argument("--criterion-only", action="store_true")
    parser.add_argument("--seeds", type=int, default=1, help="criterion rows for data seeds 1..SEEDS")
    parser.add_argument("--small", action="store_true", help="the criterion on the shape at SMALL's width")
    parser.add_argument("--device", default="cuda", help="the criterion's device (cpu with --small)")
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--one-config", action="store_true",
                        help="narrow Triton autotuning to one configuration per kernel (harness.one_triton_config)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<date>_<run>")
    args = parser.parse_args()
    autotuning = harness.one_triton_config() if args.one_config else "Triton's own"
    stem = ("kernel_check_gated_delta_rule" if args.kernel_check
            else f"hybrid_group_{args.shape}" + (f"_{args.layers}layers" if args.layers else "")
            + ("_small" if args.small else ""))
    run = harness.RunFolder("hybrid_group", args.out, tag=stem)
    result = dict(run.environment, autotuning=autotuning)
    if args.kernel_check:
        result["kernel_check"] = kernel_check(args)
    else:
        if not args.speed_only:
            result["criterion"] = []
            for seed in range(1, args.seeds + 1):
                result["criterion"] += criterion_rows(args, seed)
        if not args.criterion_only:
            result["speed"] = speed(args)
    run.write(result)

if __name__ == "__main__":
    main()
