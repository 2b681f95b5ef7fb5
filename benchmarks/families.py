"""Which decoder families PrefixFlow trains exactly, which it refuses, and which have no tiny config (CPU, float64).

    python benchmarks/families.py                        # every family; writes docs/families.md and the JSON
    python benchmarks/families.py --only llama,lfm2 --no-write

Every model type of transformers' causal-LM mapping, and the text side of the image-text models TRL's GRPO trains
(their ConditionalGeneration classes, fed text), is built as a tiny random float64 model
(`tiny_copy.tiny_config` / `build_tiny`) in each configuration its options give (its defaults, which tiny_config
cuts to layers covering every kind in `layer_types`; a sliding window where the family has one off by default; MLA
without a query rank), handed to `apply_prefixflow` and, if accepted, trained on random groups with random suffix
lengths and waves (padded and packed) next to full-sequence training: loss, every gradient and each SGD update
within 1e-5 relative (`tests/equivalence.py`). Outcomes: `exact`, `refused` (the PrefixFlowError), `no tiny config`,
`not a decoder-only causal LM` (encoders, encoder-decoders, draft models fed another model's K/V), `library not
installed` (a model that needs an optional library this environment lacks, e.g. Gemma 3n's timm vision tower);
anything else is a bug: `ACCEPTED-AND-WRONG`, `FAILED-AFTER-ACCEPT`, `APPLY-CRASHED` (apply raised something other
than a PrefixFlowError) or `TIMED-OUT`. Families whose default config transformers itself cannot build or run
(`CHECKPOINT_OPTIONS`) are built with the options their checkpoints carry, and their row says so. Each family runs
in a forked child under a deadline, `--jobs` at a time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
import warnings
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs only: nothing is downloaded

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

import harness  # noqa: E402 - benchmarks/harness.py: the environment a sweep ran in
import hf_prefixflow  # noqa: E402
from equivalence import random_group, random_plan, train_side_by_side  # noqa: E402
from hf_prefixflow import PrefixFlowError  # noqa: E402
from hf_prefixflow.core import states  # noqa: E402
from hf_prefixflow.core import moe
from hf_prefixflow.models import structure, tiny as tiny_copy

EXACT, REFUSED, NO_TINY, NOT_DECODER = "exact", "refused", "no tiny config", "not a decoder-only causal LM"
NO_LIBRARY = "library not installed"
WRONG, FAILED, APPLY_CRASHED, TIMED_OUT = "ACCEPTED-AND-WRONG", "FAILED-AFTER-ACCEPT", "APPLY-CRASHED", "TIMED-OUT"
BUGS = (WRONG, FAILED, APPLY_CRASHED, TIMED_OUT)

# Image-text models whose text decoder GRPO trains on text rows, beyond those the causal-LM mapping already lists
# (gemma3, gemma3n, gemma4 ...): TRL's GRPO tests use LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL; the others are widely used
# image-text models with a transformers ConditionalGeneration class.
IMAGE_TEXT_TYPES = ("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                    "idefics2", "idefics3", "smolvlm", "paligemma", "mistral3", "aya_vision", "internvl", "glm4v",
                    "lfm2_vl")
# Families transformers cannot build or run a model of from their default config, at any size, and the options their
# checkpoints' configs carry with which it can: (options, why the defaults fail). The row names both, and the default
# config's failure as it happens (so a transformers release that fixes it shows).
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CHECKPOINT_OPTIONS = {
    "cohere_compass_text": (
        {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
        "CohereCompassRotaryEmbedding reads rope_parameters[layer type] for each layer type, and the default "
        "config's rope_parameters hold no entry per layer type; its checkpoints give each layer type its RoPE"),
    "dbrx": (
        {"attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000.0},
         "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}},
        "DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares, and clamps Q, K "
        "and V to attn_config.clip_qkv, whose default None makes torch.clamp raise (RuntimeError: torch.clamp: At "
        "least one of 'min' or 'max' must not be None); DBRX checkpoints' attn_config carries both (dbrx-instruct's: "
        "clip_qkv 8, kv_n_heads 8, rope_theta 500000, with 16 experts, 4 per token)"),
    "gemma4_assistant": (
        {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
        "its default text config is Gemma 4 E2B's, with per-layer inputs, which Gemma4AssistantConfig's own "
        "validation refuses; its checkpoints' text configs have none"),
}
DOCS = ROOT / "docs" / "families.md"
RESULTS = ROOT / "benchmarks" / "results" / "families" / "families.json"
COMMAND = "python benchmarks/families.py"


def families() -> list[tuple[str, str, str]]:
    """(model type, class name, source) for every family the sweep covers."""
    causal = [(t, c, "causal-lm") for t, c in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    image_text = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return causal + [(t, image_text[t], "image-text") for t in IMAGE_TEXT_TYPES if t in image_text]


def not_decoder_only(model_type: str, config, model_cls: type | None = None) -> str | None:
    """Why a causal-LM entry is no (standalone) decoder-only model, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder half of an encoder-decoder model (config.is_encoder_decoder)"
    if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder (masked-LM) family whose causal head runs the encoder as a decoder"
    if model_cls is not None and structure.not_standalone(model_cls, config) is not None:
        return "not a standalone decoder-only causal LM: a draft model fed another model's K/V"
    return None


def layer_kinds(model_cls: type, config) -> list[str]:
    """The layer kinds (transformers' `ALLOWED_ATTN_LAYER_TYPES`) the family's modeling or configuration code
    names: the kinds its `layer_types` can hold, whether or not its defaults use them."""
    source = "".join(inspect.getsource(sys.modules[cls.__module__]) for cls in (model_cls, type(config)))
    return [kind for kind in ALLOWED_ATTN_LAYER_TYPES if f'"{kind}"' in source]


def option_variants(model_cls: type, config) -> list[tuple[str, dict]]:
    """Constructor overrides that exercise the family's options: its defaults; every layer kind it knows, where
    its defaults leave some out; a sliding window where the family has one that is off by default; MLA without a
    query projection rank."""
    text = config.get_text_config()
    variants = [("defaults", {})]
    if config is not text:  # composite configs: the text config's options stay at their defaults
        return variants
    kinds = layer_kinds(model_cls, config)
    if hasattr(text, "layer_types") and not set(kinds) <= set(text.layer_types or []):
        options = {"layer_types": kinds, "num_hidden_layers": len(kinds)}
        if "sliding_attention" in kinds:
            options.update(_window_options(text))
        variants.append(("layer_types " + "/".join(kinds), options))
    if hasattr(text, "sliding_window") and (text.sliding_window is None
                                            or getattr(text, "use_sliding_window", True) is False):
        variants.append(("sliding window 4", {**_window_options(text), "max_window_layers": 1}
                         if hasattr(text, "max_window_layers") else _window_options(text)))
    if isinstance(getattr(text, "q_lora_rank", None), int):
        variants.append(("q_lora_rank None", {"q_lora_rank": None}))
    return variants


def _window_options(text) -> dict:
    return {"sliding_window": 4, **({"use_sliding_window": True} if hasattr(text, "use_sliding_window") else {})}


def router_column(model: torch.nn.Module) -> str:
    """The MoE routers' classes and whether routing replay covers them ('' for dense models)."""
    found = {}
    for module in model.modules():
        if not hasattr(module, "experts"):
            continue
        router = next((getattr(module, n) for n in ("gate", "router") if isinstance(getattr(module, n, None),
                                                                              torch.nn.Module)), None)
        name = type(router).__name__ if router is not None else f"inside {type(module).__name__}"
        why = moe.NO_REPLAY.get(name)
        found[name] = "replay" if name in moe.ADAPTERS else f"no replay ({why})" if why else "no replay"
    return "; ".join(f"{covered}: {name}" for name, covered in sorted(found.items()))


def _message(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def run_variant(model_cls: type, config, seed: int = 0) -> tuple[str, str, str]:
    """(outcome, detail, MoE column) of one configuration, in float64 throughout (see `hf_prefixflow.models.tiny`)."""
    with tiny_copy.float64_throughout():
        return _run_variant(model_cls, config, seed)


def _run_variant(model_cls: type, config, seed: int) -> tuple[str, str, str]:
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    try:
        model = tiny_copy.build_tiny(model_cls, config, attn, seed=seed).train()
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    except Exception as exc:  # noqa: BLE001 - any failure to build or run is "no tiny config", with its reason
        library = missing_library(exc)
        if library is not None:
            return NO_LIBRARY, _no_library(model_cls, config, library, exc), ""
        full_size = at_full_size(model_cls, config)
        if full_size.startswith(REFUSED_AT_FULL_SIZE) and "could not verify" not in full_size:
            # its structure is refused before any probe: the outcome a user sees, whatever the tiny copy does
            return REFUSED, (full_size.removeprefix(REFUSED_AT_FULL_SIZE).strip() + " (no tiny copy could be built or "
                             f"run: {_message(exc)[:200].rstrip('.')}.)"), ""
        return NO_TINY, _message(exc)[:300].rstrip(".") + ". " + full_size, ""
    replay = router_column(model)
    try:
        hf_prefixflow.apply_prefixflow(model)
    except PrefixFlowError as exc:
        return REFUSED, str(exc), replay
    except Exception as exc:  # noqa: BLE001
        return APPLY_CRASHED, _message(exc)[:600] + " | " + _last_frame(exc), replay
    gen = torch.Generator().manual_seed(seed)
    groups = [random_group(gen, prefix=(2, 16), suffix=(1, 8), n=(2, 5)) for _ in range(3)]
    # Recurrent models run padded waves only: a packed row would carry one completion's state into the next.
    layouts = ((("padded",),) * 3 if states.has_states(model) else (("padded",), ("packed",), ("padded", "packed")))
    plans = [random_plan(gen, len(group.suffixes), kinds) for group, kinds in zip(groups, layouts)]
    try:
        train_side_by_side(model, groups, plans, prepare=lambda candidate: candidate)
    except AssertionError as exc:
        return WRONG, " ".join(str(exc).split()), replay
    except PrefixFlowError as exc:  # refused before any step, naming the input the family needs
        return REFUSED, f"at its first group: {exc}", replay
    except Exception as exc:  # noqa: BLE001 - accepted, then failed: a bug either way
        return FAILED, _message(exc)[:600] + " | " + _last_frame(exc), replay
    waves = "; ".join(f"{len(g.suffixes)} suffixes: " + ", ".join(f"{k}{rows}" for k, rows in plan)
                      for g, plan in zip(groups, plans))
    return EXACT, f"3 SGD steps, waves {waves}", replay


REFUSED_AT_FULL_SIZE = "At full size apply_prefixflow refuses it:"


def missing_library(exc: BaseException) -> str | None:
    """The optional library whose absence `exc` reports (transformers' `requires_backends`), or None."""
    match = re.search(r"requires the (\S+) library but it was not found", str(exc))
    return match.group(1) if isinstance(exc, ImportError) and match else None


def _no_library(model_cls: type, config, library: str, exc: BaseException) -> str:
    """The detail of a family that needs a library this environment lacks: which, and the row of its text decoder
    where that is a causal LM of its own."""
    text = config.get_text_config()
    own = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(text, "model_type", None))
    decoder = f" Its text decoder, {own}, is swept as {text.model_type}." if text is not config and own else ""
    reported = _message(exc).split(" You can install it")[0]
    return (f"{model_cls.__name__} needs the {library} library ({reported}), which the dev extra does not install: "
            f"the sweep covers this family only where {library} is installed.{decoder}")


def at_full_size(model_cls: type, config) -> str:
    """What `apply_prefixflow` does with the family at its configured size, built on the meta device."""
    try:
        with torch.device("meta"):
            model = model_cls(config)
    except Exception as exc:  # noqa: BLE001
        return f"Nor can it be built at full size ({_message(exc)[:200]})."
    try:
        hf_prefixflow.apply_prefixflow(model)
    except PrefixFlowError as exc:
        return f"{REFUSED_AT_FULL_SIZE} {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"At full size apply_prefixflow fails: {_message(exc)[:300]}"
    return "At full size apply_prefixflow accepts it."


def _last_frame(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


def run_family(model_type: str, class_name: str, source: str) -> dict:
    """One row: the family's outcome over its option variants (on top of `CHECKPOINT_OPTIONS`, where the family
    has them)."""
    row = {"model_type": model_type, "class": class_name, "source": source, "moe": "", "variants": []}
    base, why = CHECKPOINT_OPTIONS.get(model_type, ({}, ""))
    try:
        model_cls = getattr(transformers, class_name)
        config = CONFIG_MAPPING[model_type](**base)
        config_cls = _own_config(model_cls, config)
        reason = not_decoder_only(model_type, config, model_cls)
        variants = option_variants(model_cls, config_cls(**base))
    except Exception as exc:  # noqa: BLE001
        return {**row, "outcome": NO_TINY, "detail": f"default config or class: {_message(exc)[:400]}"}
    for name, options in variants:
        start = time.perf_counter()
        try:
            variant_config = config_cls(**{**base, **options})
        except Exception as exc:  # noqa: BLE001
            outcome, detail, replay = NO_TINY, f"the config rejects {options}: {_message(exc)[:300]}", ""
        else:
            outcome, detail, replay = run_variant(model_cls, variant_config)
        row["moe"] = row["moe"] or replay
        row["variants"].append({"name": name, "options": options, "outcome": outcome, "detail": detail,
                                "seconds": round(time.perf_counter() - start, 2)})
    summary = summarise(row["variants"], reason)
    if base:
        summary["detail"] = f"{default_config_failure(model_cls, config_cls)}: {why}. With {base}: {summary['detail']}"
    return {**row, **summary}


def default_config_failure(model_cls: type, config_cls: type) -> str:
    """How transformers fails to build and run `model_cls` from `config_cls`'s defaults at tiny sizes (the first
    exception), or that it no longer does (then `CHECKPOINT_OPTIONS` can lose the family)."""
    try:
        with tiny_copy.float64_throughout():
            model = tiny_copy.build_tiny(model_cls, config_cls(), "eager")
            with torch.no_grad():
                model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    except Exception as exc:  # noqa: BLE001
        return f"transformers cannot build or run {model_cls.__name__} from its default config ({_message(exc)[:200]})"
    return (f"transformers now builds and runs {model_cls.__name__} from its default config (CHECKPOINT_OPTIONS can "
            "drop it)")


def _own_config(model_cls: type, config) -> type:
    """The config class `model_cls` is built from: the sub-config of its own config class where the model type's
    config holds one (a causal LM listed under its multimodal model type takes the text config, as transformers'
    auto classes do), else the model type's config (aliases such as exaone -> LlamaForCausalLM)."""
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) \
            and any(isinstance(sub, wanted) for sub in tiny_copy.nested_configs(config)):
        return wanted
    return type(config)


def summarise(variants: list[dict], not_decoder: str | None) -> dict:
    """The family's one outcome: a bug in any variant; else refused if any configuration is refused (the detail
    says which), exact if any is exact, else no tiny config."""
    rank = {**{bug: 0 for bug in BUGS}, REFUSED: 1, EXACT: 2, NO_LIBRARY: 3, NO_TINY: 4}
    main = min(variants, key=lambda v: rank[v["outcome"]])
    if len(variants) == 1:
        detail = main["detail"]
    else:
        detail = "; ".join(f"{v['name']}: {v['outcome']}" + (f" ({v['detail']})" if v["outcome"] != EXACT else "")
                           for v in sorted(variants, key=lambda v: v is not main))
    if not_decoder and main["outcome"] not in BUGS:
        return {"outcome": NOT_DECODER, "detail": f"{not_decoder}. apply_prefixflow on it: {main['outcome']}: {detail}"}
    return {"outcome": main["outcome"], "detail": detail}


# ---- running families in children under a deadline --------------------------------------------------------------

def _child(spec: tuple[str, str, str], conn) -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    try:
        conn.send(run_family(*spec))
    except BaseException as exc:  # noqa: BLE001 - report whatever happened to the parent
        conn.send({"model_type": spec[0], "class": spec[1], "source": spec[2], "moe": "", "variants": [],
                   "outcome": FAILED, "detail": f"sweep error: {_message(exc)[:400]}"})
    conn.close()


def sweep(specs: list[tuple[str, str, str]], jobs: int, timeout: float, width: int = 110) -> list[dict]:
    """Run each family in a forked child, `jobs` at a time; a child past `timeout` seconds is killed."""
    context = multiprocessing.get_context("fork")
    pending, running, rows = list(specs), {}, []
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(spec, send), daemon=True)
            process.start()
            send.close()
            running[receive] = (spec, process, time.monotonic())
        ready = wait(list(running), timeout=1.0)
        now = time.monotonic()
        for conn in list(running):
            spec, process, started = running[conn]
            row = None
            if conn in ready:
                try:
                    row = conn.recv()
                except EOFError:
                    process.join()
                    row = _crashed(spec, f"the child died (exit code {process.exitcode})")
            elif now - started > timeout:
                process.kill()
                row = _crashed(spec, f"no result within {timeout:.0f} s", TIMED_OUT)
            if row is None:
                continue
            row["seconds"] = round(now - started, 1)
            rows.append(row)
            del running[conn]
            conn.close()
            process.join()
            print(f"{row['model_type']:28s} {row['outcome']:28s} {row['seconds']:6.1f}s  {row['detail'][:width]}",
                  flush=True)
    order = {spec[0]: index for index, spec in enumerate(specs)}
    return sorted(rows, key=lambda r: order[r["model_type"]])


def _crashed(spec: tuple[str, str, str], why: str, outcome: str = FAILED) -> dict:
    return {"model_type": spec[0], "class": spec[1], "source": spec[2], "moe": "", "variants": [],
            "outcome": outcome, "detail": why}


# ---- reports -----------------------------------------------------------------------------------------------------

def counts(rows: list[dict]) -> dict[str, int]:
    found = {}
    for row in rows:
        found[row["outcome"]] = found.get(row["outcome"], 0) + 1
    return dict(sorted(found.items(), key=lambda item: -item[1]))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Model families under PrefixFlow",
        "",
        f"Generated by `{command}` with transformers {transformers.__version__} and torch {torch.__version__}",
        "(CPU, float64); do not edit by hand. Each family is built as a tiny random model",
        "(`hf_prefixflow.models.tiny.tiny_config`) in each configuration its options give, handed to",
        "`apply_prefixflow` and, if accepted, trained for three SGD steps on random groups with random suffix lengths",
        "and waves (padded and packed) next to full-sequence training (`benchmarks/families.py`, which says how), in",
        "float64 throughout: casts to float32 inside the models keep float64",
        "(`hf_prefixflow.models.tiny.float64_throughout`), so",
        "rounding noise cannot pass for an error nor hide one. Any outcome but the four below is a bug",
        "(`ACCEPTED-AND-WRONG`, `FAILED-AFTER-ACCEPT`, `APPLY-CRASHED`, `TIMED-OUT`).",
        "",
        "- `exact`: loss, every gradient and each update within 1e-5 relative of full-sequence training.",
        "- `refused`: `apply_prefixflow` raised `PrefixFlowError` (at full size, for a family no tiny copy of which "
        "could be built), or the first group did before any step (the message is the detail).",
        "- `no tiny config`: no tiny random model of the family could be built or run (the reason is the detail).",
        "- `not a decoder-only causal LM`: an encoder or encoder-decoder family, or a draft model fed another",
        "  model's K/V (what `apply_prefixflow` does with it is in the detail).",
        "- `library not installed`: the model needs an optional library the dev extra does not install (which one",
        "  is in the detail); the sweep covers it where that library is installed.",
        "- Where transformers cannot build or run a family from its default config at any size, the family is built",
        "  with the options its checkpoints carry (`CHECKPOINT_OPTIONS` in `benchmarks/families.py`), and the detail",
        "  names transformers' failure and the options.",
        "- MoE: the routers of MoE families, and whether rollout routing replay (`hf_prefixflow.core.moe.ADAPTERS`)",
        "  covers them. Without replay an MoE family still trains exactly here: each token routes by its own hidden",
        "  state, the same in both runs.",
        "",
        "Counts: " + ", ".join(f"{outcome} {n}" for outcome, n in counts(rows).items()) + ".",
        "",
        "| model type | class | outcome | detail | MoE replay |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        model_type = row["model_type"] + (" (image-text)" if row["source"] == "image-text" else "")
        lines.append(f"| {model_type} | `{row['class']}` | {row['outcome']} | {_cell(row['detail'])} | "
                     f"{_cell(row['moe'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per family")
    parser.add_argument("--no-write", action="store_true",
                        help="print every detail; leave docs/ and results/ alone")
    args = parser.parse_args()
    specs = families()
    if args.only:
        wanted = set(args.only.split(","))
        specs = [spec for spec in specs if spec[0] in wanted]
    start = time.perf_counter()
    rows = sweep(specs, args.jobs, args.timeout, width=100_000 if args.no_write else 110)
    total = time.perf_counter() - start
    print(f"{len(rows)} families in {total:.0f} s: {counts(rows)}")
    if args.no_write:
        return
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(markdown(rows, COMMAND))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": COMMAND, **harness.environment(gpu="cpu"), "jobs": args.jobs,
                                   "seconds": round(total),
                                   "counts": counts(rows), "families": rows}, indent=1) + "\n")
    print(f"wrote {DOCS.relative_to(ROOT)} and {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
