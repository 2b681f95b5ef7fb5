"""One group three ways on one model: N full sequences, Prefix Grouper's layout (on an SDPA path) and PrefixFlow.

    python -m benchmarks prefix_grouper_step --model qwen3-1.7b --prefix 10240 --suffix 2048 -n 16
    python -m benchmarks prefix_grouper_step --tiny --out /tmp/pg_tiny

Prefix Grouper (PyPI `prefix_grouper`, what verl's `use_prefix_grouper` runs) packs a prompt and its N responses
into ONE sequence, `[P, S_1, ..., S_N]`, so the prompt's tokens go through the model once. The caller gives each
response position ids that continue after the prompt (`P, P+1, ...`, as in its full sequence). Every layer except
attention is per token and needs nothing else; attention is replaced by a hook that cuts the packed q/k/v into the
prompt part and the response parts (responses padded into a batch of N) and makes two calls: the prompt attends
causally to itself, and each response's queries attend to the prompt's keys (copied once per response) followed by
its own keys, causally aligned at the bottom right (response token j sees the whole prompt and response tokens
0..j, never another response). The two outputs are packed back into the sequence order. The logit that predicts a
response's first token is the prompt's last position, shared by all N responses. The forward and backward are one
pass over `P + sum(S_i)` tokens: unlike PrefixFlow, the prompt's activations stay alive for the whole backward.

Its stock hook calls FlashAttention-2 (varlen, bottom-right causal), which the GPU image lacks. This script
registers its own function with transformers' `AttentionInterface` for the same semantics on
`F.scaled_dot_product_attention`: the prompt call uses `is_causal`; the response call (responses padded at the end
to the longest) uses SDPA's lower-right causal bias, which runs the flash or memory-efficient kernels without a
dense mask. SDPA's lower-right path takes K/V with as many heads as the queries, so the response call repeats
grouped-query K/V heads (FA2 reads them natively): a transient cost per layer that Prefix Grouper with FA2 does not
pay. The `prefix_grouper` package is not imported (tests/test_prefix_grouper.py cross-checks the attention against
it where installed). The packed pass also holds the logits of all `sum(S_i)` completion tokens at once, as a packed
micro-batch does in verl.

Three sides in one process on the same model object (random init; bf16 on CUDA, float64 on CPU under `--tiny`),
the same loss (mean cross-entropy over each completion's tokens, summed over completions) and the same activation
checkpointing (`--checkpointing`, non-reentrant, on by default as in TRL):
  full: each `[P || S_i]` as its own sequence, one per microbatch (`speed.baseline_group`);
  prefix_grouper: the packed sequence through the attention function here, one forward and one backward;
  prefixflow: `hf_prefixflow.prefix_group`, waves of `--wave` completions (default all N, as Prefix Grouper's
    one pass; `speed.prefixflow_group`).
Each side: one warm-up group, then the median of `--repeats` timed groups, the peak allocated GiB, the speedup over
`full` and its share of the FLOP ratio `ModelShape.bound(P, [S] * N)`. Under `--tiny` (a tiny Qwen3 on the CPU, a
short prompt and three completions of uneven lengths) the script first compares every parameter's gradient of the
two grouped sides against `full` and prints the worst relative error (about 1e-7 when right: the weights are
float64, RoPE's cos/sin tables float32). Rows go to `prefix_grouper_step.json` and `.md` in `--out` (a run replaces
an earlier row of the same setting), with a generated `MANIFEST.md` (`harness.RunFolder`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

import hf_prefixflow
from hf_prefixflow import _compat
from hf_prefixflow.planning.flops import ModelShape
import harness
from speed import SHAPES, baseline_group, build, prefixflow_group, random_group, suffix_loss

ATTENTION = "prefix_grouper_sdpa"
LAYOUT_KWARG = "prefix_layout"
SIDES = ("full", "prefix_grouper", "prefixflow")
# Attention-only shapes: recurrent layers (qwen3.5-2b's) would run the packed sequence as one, mixing completions.
ATTENTION_SHAPES = sorted(name for name, spec in SHAPES.items() if "layer_types" not in spec)
# Under --tiny: a tiny Qwen3, a prompt of TINY_PREFIX tokens and completions of uneven lengths.
TINY_SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=97)
TINY_PREFIX, TINY_SUFFIXES = 12, (7, 4, 5)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where a prompt of `prefix` tokens and its completions of lengths `suffixes` sit in the packed sequence."""

    prefix: int
    suffixes: tuple[int, ...]

    def starts(self) -> list[int]:
        """Each completion's first index in the packed sequence."""
        starts, at = [], self.prefix
        for length in self.suffixes:
            starts.append(at)
            at += length
        return starts

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """`[1, T]`: the prompt's positions, then each completion's continuing after the prompt as in its full
        sequence."""
        parts = [torch.arange(self.prefix)] + [torch.arange(self.prefix, self.prefix + s) for s in self.suffixes]
        return torch.cat(parts).to(device)[None]

    def logit_rows(self, device: torch.device) -> torch.Tensor:
        """Rows whose logits predict completion tokens, completion by completion: the prompt's last row (it predicts
        every completion's first token), then the completion's rows but its last."""
        last = torch.tensor([self.prefix - 1])
        rows = [torch.cat([last, torch.arange(start, start + length - 1)])
                for start, length in zip(self.starts(), self.suffixes)]
        return torch.cat(rows).to(device)

    def suffix_mask(self) -> torch.Tensor:
        """What each completion's queries (padded to the longest) see of `[prompt keys, own keys]`: the whole prompt
        and its own keys up to the query's, SDPA's lower-right causal bias. A shorter completion's padding keys lie
        past all its real queries, so only its padded query rows, which are dropped, see them."""
        longest = max(self.suffixes)
        return causal_lower_right(longest, self.prefix + longest)


def _pad_stack(parts: tuple[torch.Tensor, ...], longest: int) -> torch.Tensor:
    """`[H, S_i, D]` parts padded at the end of their sequence to `longest`, stacked to `[N, H, longest, D]`."""
    return torch.stack([F.pad(part, (0, 0, 0, longest - part.shape[1])) for part in parts])


def completion_keys(x: torch.Tensor, layout: PackedLayout, groups: int) -> torch.Tensor:
    """`[N, H_kv * groups, P + longest, D]` from the packed `x [1, H_kv, T, D]`: the prompt's keys (or values),
    copied once per completion, then the completion's own; heads repeated for grouped-query attention."""
    p = layout.prefix
    own = _pad_stack(x[0, :, p:].split(layout.suffixes, dim=1), max(layout.suffixes))
    return torch.cat([x[:, :, :p].expand(len(own), -1, -1, -1), own], dim=2).repeat_interleave(groups, dim=1)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Prefix Grouper's attention on SDPA: `query [1, H_q, T, D]`, `key`/`value [1, H_kv, T, D]` of the packed
    sequence; returns `[1, T, H_q, D]`. transformers' `attention_mask` is not used: the layout defines visibility."""
    layout: PackedLayout = kwargs[LAYOUT_KWARG]
    p, longest = layout.prefix, max(layout.suffixes)
    groups = query.shape[1] // key.shape[1]
    prefix_out = F.scaled_dot_product_attention(query[:, :, :p], key[:, :, :p], value[:, :, :p], is_causal=True,
                                                dropout_p=dropout, scale=scaling, enable_gqa=groups > 1)
    queries = _pad_stack(query[0, :, p:].split(layout.suffixes, dim=1), longest)
    suffix_out = F.scaled_dot_product_attention(queries, completion_keys(key, layout, groups),
                                                completion_keys(value, layout, groups), attn_mask=layout.suffix_mask(),
                                                dropout_p=dropout, scale=scaling)
    parts = [prefix_out[0]] + [out[:, :length] for out, length in zip(suffix_out, layout.suffixes)]
    return torch.cat(parts, dim=1).transpose(0, 1)[None], None


AttentionInterface.register(ATTENTION, packed_attention)  # no mask builder: transformers then builds no mask


@contextlib.contextmanager
def attention_of(model: torch.nn.Module, name: str) -> Iterator[None]:
    """The model's attention implementation set to `name` for the block (backward included: checkpointed layers
    re-run their attention there)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def prefix_grouper_group(model: torch.nn.Module, prompt: torch.Tensor, suffixes: list[torch.Tensor]) -> None:
    """One forward and one backward of the packed sequence, with `suffix_loss` per completion as the other sides."""
    layout = PackedLayout(len(prompt), tuple(len(s) for s in suffixes))
    ids = torch.cat([prompt, *suffixes])[None]
    with attention_of(model, ATTENTION):
        logits = model(ids, position_ids=layout.position_ids(ids.device), logits_to_keep=layout.logit_rows(ids.device),
                       use_cache=False, **{LAYOUT_KWARG: layout}).logits[0]
        chunks = logits.split(layout.suffixes)
        sum(suffix_loss(chunk, suffix) for chunk, suffix in zip(chunks, suffixes)).backward()


def sides(model: torch.nn.Module, prompt: torch.Tensor, suffixes: list[torch.Tensor],
          wave: int) -> dict[str, Callable[[], None]]:
    return {"full": lambda: baseline_group(model, prompt, suffixes),
            "prefix_grouper": lambda: prefix_grouper_group(model, prompt, suffixes),
            "prefixflow": lambda: prefixflow_group(model, prompt, suffixes, wave)}


def build_tiny(checkpointing: bool) -> torch.nn.Module:
    config = AutoConfig.for_model("qwen3", **TINY_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    return prepare(model, checkpointing)


def prepare(model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
    """Checkpointing (non-reentrant, which PrefixFlow needs) on the model object all three sides share."""
    if checkpointing:
        _compat.enable_checkpointing(model.train())
    return hf_prefixflow.apply_prefixflow(model.train())


def tiny_group(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    return (torch.randint(0, vocab, (TINY_PREFIX,), generator=gen),
            [torch.randint(0, vocab, (s,), generator=gen) for s in TINY_SUFFIXES])


def gradients(model: torch.nn.Module, run: Callable[[], None]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def worst_relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest `|g - g_ref| / |g_ref|` over parameters (inf where a parameter's gradient is missing)."""
    if grads.keys() != reference.keys():
        return float("inf")
    return max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in reference.items())


def gradient_errors(model: torch.nn.Module, prompt: torch.Tensor, suffixes: list[torch.Tensor],
                    wave: int) -> dict[str, float]:
    """Each grouped side's worst relative gradient error against the full sequences."""
    runs = sides(model, prompt, suffixes, wave)
    reference = gradients(model, runs["full"])
    return {side: worst_relative_error(gradients(model, runs[side]), reference) for side in SIDES[1:]}


def measure(model: torch.nn.Module, run: Callable[[], None], repeats: int) -> tuple[float, float | None]:
    """Median seconds over `repeats` after one warm-up, and the peak allocated GiB (None on the CPU)."""
    model.zero_grad(set_to_none=True)
    seconds, peak, _ = harness.timed(run, repeats, run)
    model.zero_grad(set_to_none=True)
    return seconds, peak


def row(args, model: torch.nn.Module, prompt: torch.Tensor, suffixes: list[torch.Tensor],
        environment: dict) -> dict:
    lengths = [len(s) for s in suffixes]
    bound = ModelShape.from_config(model.config).bound(len(prompt), lengths)
    result = {"model": "tiny-qwen3" if args.tiny else args.model, "P": len(prompt), "S": lengths, "N": len(suffixes),
              "wave": args.wave, "checkpointing": args.checkpointing, "flop_ratio": round(bound, 3)}
    if args.tiny:
        errors = gradient_errors(model, prompt, suffixes, args.wave)
        print("worst relative gradient error against full sequences: "
              + ", ".join(f"{side} {error:.2e}" for side, error in errors.items()), flush=True)
        result.update({f"{side}_grad_rel_err": error for side, error in errors.items()})
    runs, result["out_of_memory"] = sides(model, prompt, suffixes, args.wave), []
    for side in SIDES:
        try:
            seconds, peak = measure(model, runs[side], args.repeats)
        except torch.OutOfMemoryError:  # recorded, and the other sides still run
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            result["out_of_memory"].append(side)
            result[f"{side}_s"] = result[f"{side}_peak_gib"] = None
            print(side, "out of device memory", flush=True)
            continue
        result[f"{side}_s"], result[f"{side}_peak_gib"] = round(seconds, 4), None if peak is None else round(peak, 2)
        print(side, f"{seconds:.3f} s", f"{peak:.1f} GiB" if peak else "", flush=True)
    for side in SIDES[1:]:
        if result["full_s"] is None or result[f"{side}_s"] is None:
            result[f"{side}_speedup"] = result[f"{side}_share_of_flop_ratio"] = None
            continue
        speedup = result["full_s"] / result[f"{side}_s"]
        result[f"{side}_speedup"], result[f"{side}_share_of_flop_ratio"] = round(speedup, 3), round(speedup / bound, 3)
    result.update(repeats=args.repeats, **environment)
    return result


def _key(r: dict) -> tuple:
    return r["model"], r["P"], tuple(r["S"]), r["checkpointing"], r["wave"]


def _lengths(suffixes: list[int]) -> str:
    return str(suffixes[0]) if len(set(suffixes)) == 1 else ",".join(map(str, suffixes))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    """A measured figure, or OOM where its side ran out of device memory."""
    return "OOM" if value is None else format(value, spec) + unit


def write(rows: list[dict], run: harness.RunFolder) -> None:
    """Rows to `prefix_grouper_step.json` and `.md`; a run replaces an earlier row of the same setting."""
    path = run.path / "prefix_grouper_step.json"
    kept = [r for r in (json.loads(path.read_text()) if path.exists() else []) if _key(r) not in map(_key, rows)]
    rows = kept + rows
    lines = ["Prefix Grouper's layout runs on SDPA (`prefix_grouper_sdpa`), not its FlashAttention-2 hook.", "",
             "| model | P / S | N | ckpt | full s | PG s | PF s | PG speedup | PF speedup | FLOP ratio | PG share | "
             "PF share | peak GiB full / PG / PF | grad rel err PG / PF | device |", "| --- " * 15 + "|"]
    for r in rows:
        errors = (f"{r['prefix_grouper_grad_rel_err']:.1e} / {r['prefixflow_grad_rel_err']:.1e}"
                  if "prefixflow_grad_rel_err" in r else "-")
        lines.append(
            f"| {r['model']} | {r['P']} / {_lengths(r['S'])} | {r['N']} | {r['checkpointing']} "
            f"| {' | '.join(_fmt(r[f'{side}_s'], '.3f') for side in SIDES)} "
            f"| {_fmt(r['prefix_grouper_speedup'], '.2f', 'x')} | {_fmt(r['prefixflow_speedup'], '.2f', 'x')} "
            f"| {r['flop_ratio']:.2f}x "
            f"| {_fmt(r['prefix_grouper_share_of_flop_ratio'], '.1%')} "
            f"| {_fmt(r['prefixflow_share_of_flop_ratio'], '.1%')} "
            f"| {' / '.join(_gib(r[f'{side}_peak_gib']) for side in SIDES)} | {errors} "
            f"| {r.get('gpu', r.get('device'))} |")  # rows written before the harness: `device`
    run.write(rows, lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=ATTENTION_SHAPES)
    parser.add_argument("--prefix", type=int, default=10240)
    parser.add_argument("--suffix", type=int, default=2048)
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--wave", type=int, default=None,
                        help="completions per PrefixFlow wave (default N: one pass over every completion, the rows "
                             "Prefix Grouper's packed pass holds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on",
                        help="non-reentrant activation checkpointing of every decoder layer, on all three sides")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny float64 Qwen3 on the CPU, P={TINY_PREFIX}, S={TINY_SUFFIXES} (overrides --model, "
                             "--prefix, --suffix, -n and --wave), with a gradient check of both grouped sides")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_prefix_grouper")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.wave = args.wave or args.n
    checkpointing = args.checkpointing == "on"
    if args.tiny:
        args.wave = 1  # uneven completions: one per wave
        model = build_tiny(checkpointing)
        prompt, suffixes = tiny_group(model)
    else:
        model = prepare(build(args.model, prefixflow=False), checkpointing)  # bf16 on CUDA
        prompt, suffixes = random_group(model, args.prefix, args.suffix, args.n)
    run = harness.RunFolder("prefix_grouper_step", args.out, argv=argv)
    result = row(args, model, prompt, suffixes, run.environment)
    print(json.dumps(result), flush=True)
    write([result], run)


if __name__ == "__main__":
    main()
