"""The probe: a tiny float64 copy of the model's architecture (`tiny`) trains one group both ways.

It catches what `structure.check_structure` cannot name, including families added to transformers later: on the CPU
it checks that every attention layer runs once per forward and receives its sliding window, trains one group with
PrefixFlow and as full sequences, and refuses unless loss and every gradient agree. `python -m benchmarks families`
runs the same checks over every causal-LM family transformers has (`docs/families.md`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import _compat as compat
from ..core import attention, states
from ..core.scheduler import prefix_group
from ..core.switch import enable
from ..errors import PrefixFlowError
from .structure import decoder_layers
from .tiny import VOCAB, build_tiny, config_value, float64_throughout, recompute_in_float64

TOLERANCE = 1e-5  # relative, float64: the equivalence tests' bound

@dataclass
class ProbeResult:
    """What the probe learnt: the decoder layer classes that drop the model's kwargs before attention (bridged),
    the attention classes inside them, and why the probe could not run (if it could not)."""

    bridged_layers: set[str] = field(default_factory=set)
    attention_classes: set[str] = field(default_factory=set)
    skipped: str | None = None


_probed: dict[tuple, ProbeResult] = {}


def probe(model: PreTrainedModel) -> ProbeResult:
    """Train one group on a tiny copy of `model`'s architecture both ways; raise `PrefixFlowError` unless loss and
    every gradient agree. Cached per model class and config."""
    base = attention.base_name(model.config._attn_implementation)
    key = (type(model), base, model.config.to_json_string(use_diff=False))
    if key not in _probed:
        # flex_attention has no backward on a CPU: sdpa stands in, grouping K/V heads by their shapes as flex does
        flex = base == "flex_attention"
        with torch.random.fork_rng(devices=[]), compat.sdpa_grouped_by_shapes() if flex else contextlib.nullcontext():
            # (the copy's random weights leave the caller's CPU stream as it was)
            _probed[key] = _run_probe(type(model), model.config, "sdpa" if flex else base)
    return _probed[key]


def _run_probe(model_cls: type, config, attn: str) -> ProbeResult:
    with _one_thread(), float64_throughout(), compat.reference_kernels(model_cls):
        return _probe_tiny(model_cls, config, attn)


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread for the tiny copy: more only add synchronisation (tenfold on busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _probe_tiny(model_cls: type, config, attn: str) -> ProbeResult:
    owner = model_cls.__name__
    try:
        reference = build_tiny(model_cls, config, attn)
        ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            reference(input_ids=ids)
    except Exception as exc:  # noqa: BLE001 - any failure to build or run the copy means "could not probe"
        return ProbeResult(skipped=f"a tiny {owner} could not be built or run with attention {attn!r} "
                                   f"({type(exc).__name__}: {str(exc)[:200]})")
    candidate = copy.deepcopy(reference)
    enable(candidate)
    result = reach(candidate)
    _bridge(candidate, result)
    if reference.supports_gradient_checkpointing:
        for tiny in (reference, candidate):
            compat.enable_checkpointing(tiny, use_reentrant=False)
            recompute_in_float64(tiny)
    _compare(reference, candidate, owner)
    return result


def reach(model: PreTrainedModel) -> ProbeResult:
    """Which attention calls receive the model's kwargs: a forward carrying `attention.REACH`. Each call is checked
    to run once, and to receive the sliding window its layer has (PrefixFlow's wave masks need it)."""
    name = model.config._attn_implementation
    registered = ALL_ATTENTION_FUNCTIONS[name]
    windows = []

    def spy(module, *args, **kwargs):
        windows.append(attention.layer_window(module, kwargs))
        return registered(module, *args, **kwargs)

    attention.REACH.calls = []
    AttentionInterface.register(name, spy)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]), **{attention.PASS_KWARG: attention.REACH})
        calls = attention.REACH.calls
    finally:
        attention.REACH.calls = None
        AttentionInterface.register(name, registered)
    owner = type(model).__name__
    if not calls and states.has_states(model):
        return ProbeResult()  # recurrent layers only (a pure state-space stack): their states are the whole cache
    if not calls:
        raise PrefixFlowError(
            f"{owner} never called the registered attention function, so PrefixFlow could not cache or read its "
            "prefix K/V: its attention does not go through transformers' AttentionInterface. Train this model "
            "with the plain trainer."
        )
    names = {id(m): n for n, m in model.named_modules()}
    _check_calls(model, [(module, names[id(module)], window) for (module, _), window in zip(calls, windows)])
    layers = {id(layer): layer for _, layer in decoder_layers(model)}
    result = ProbeResult()
    for module, reached in calls:
        if not reached:
            layer = _enclosing_layer(model, names[id(module)], layers)
            result.bridged_layers.add(type(layer).__name__)
            result.attention_classes.add(type(module).__name__)
    return result


def _check_calls(model: PreTrainedModel, calls: list[tuple[torch.nn.Module, str, int | None]]) -> None:
    """Refuse attention layers that run twice per forward, and sliding windows or chunks only the model's masks
    carry."""
    owner = type(model).__name__
    text = model.config.get_text_config()
    window, kinds = config_value(text, "sliding_window"), config_value(text, "layer_types") or []
    seen = set()
    for module, name, got in calls:
        index = getattr(module, "layer_idx", None)
        if (index if index is not None else id(module)) in seen:
            raise PrefixFlowError(
                f"{owner}: the attention of layer index {index} ({name}) ran more than once in one forward: its "
                "layers are looped or share an index. PrefixFlow keeps one prefix K/V per attention layer index, "
                "so later calls would read the first call's K/V. Train this model with the plain trainer."
            )
        seen.add(index if index is not None else id(module))
        windowed = not kinds or (isinstance(index, int) and index < len(kinds) and "sliding" in kinds[index])
        if isinstance(window, int) and windowed and got is None:
            raise PrefixFlowError(
                f"{owner}: config.sliding_window is {window} but {name} ({type(module).__name__}) receives no "
                "sliding_window (as an argument, as an attribute or by its layer kind in its config): the window "
                "lives only in the masks the model builds, and PrefixFlow builds its own masks for suffix waves, "
                "which would then attend past the window. Train this model with the plain trainer (or with "
                "sliding_window=None)."
            )
        chunked = isinstance(index, int) and index < len(kinds) and kinds[index] == "chunked_attention"
        if chunked and attention.chunk_size(module) is None:
            raise PrefixFlowError(
                f"{owner}: layer {index} is a chunked-attention layer but {name} ({type(module).__name__}) carries no "
                "config with attention_chunk_size and its layer_idx: the chunks live only in the masks the model "
                "builds, and PrefixFlow builds its own masks for suffix waves, which would then attend across chunks. "
                "Train this model with the plain trainer."
            )


def _enclosing_layer(model: torch.nn.Module, name: str, layers: dict) -> torch.nn.Module:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if id(module) in layers:
            return module
    raise PrefixFlowError(
        f"{type(model).__name__}: the attention module {name} lies outside the decoder's layers and drops the "
        "model's keyword arguments, so PrefixFlow's phase marker cannot reach it."
    )


def _bridge(model: PreTrainedModel, result: ProbeResult) -> None:
    """Install the kwargs bridge on the layers `result` names (see `attention.bridge_layers`)."""
    if not result.bridged_layers:
        return
    layers = [layer for _, layer in decoder_layers(model) if type(layer).__name__ in result.bridged_layers]
    modules = [m for layer in layers for m in layer.modules() if type(m).__name__ in result.attention_classes]
    attention.bridge_layers(layers, modules)


def bridge(model: PreTrainedModel, result: ProbeResult) -> None:
    """Bridge `model`'s layers as the probe found necessary; when it could not probe, every decoder layer."""
    if result.skipped is None:
        _bridge(model, result)
        return
    layers = [layer for _, layer in decoder_layers(model)]
    modules = [m for layer in layers for m in layer.modules()
               if hasattr(m, "layer_idx") and m is not layer and _takes_kwargs(m)]
    attention.bridge_layers(layers, modules)


def _takes_kwargs(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


# The probe's group: a prompt longer than the windows and chunks `tiny_config` sets (4), and four completions in two
# waves of right-padded rows.
_PROBE_PREFIX, _PROBE_SUFFIXES, _PROBE_WAVES = 13, (6, 3, 5, 2), ((0, 1), (2, 3))


def _compare(reference: PreTrainedModel, candidate: PreTrainedModel, owner: str) -> None:
    gen = torch.Generator().manual_seed(1)
    # Longer than the tiny copy's windows and chunks (4): suffixes attend across chunk borders and past the window
    # into the prefix; two waves of right-padded rows, so the prefix K/V gradients sum over waves.
    prefix = torch.randint(3, VOCAB, (_PROBE_PREFIX,), generator=gen)
    suffixes = [torch.randint(3, VOCAB, (n,), generator=gen) for n in _PROBE_SUFFIXES]
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in suffixes]
    reference.train()
    candidate.train()
    ref_loss = 0.0
    for suffix, weight in zip(suffixes, weights):
        logits = reference(input_ids=torch.cat([prefix, suffix])[None]).logits[0, len(prefix) - 1:-1]
        loss = _weighted_logp(logits, suffix, weight)
        loss.backward()
        ref_loss += loss.item()
    loss = 0.0
    try:
        with prefix_group(candidate, prefix) as group:
            for rows in _PROBE_WAVES:
                width = max(len(suffixes[i]) for i in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for row, i in enumerate(rows):
                    ids[row, :len(suffixes[i])], mask[row, :len(suffixes[i])] = suffixes[i], 1
                logits = group(ids, attention_mask=mask).logits
                wave = sum(_weighted_logp(logits[r, :len(suffixes[i])], suffixes[i], weights[i])
                           for r, i in enumerate(rows))
                wave.backward()
                loss += wave.detach()
    except PrefixFlowError:
        raise
    except Exception as exc:  # noqa: BLE001 - the family fails inside a group: refuse rather than fail at step 1
        raise PrefixFlowError(
            f"{owner} fails inside a prefix group ({type(exc).__name__}: {str(exc)[:300]}): its layers do not take "
            "a suffix forward over cached prefix K/V. Train this model with the plain trainer."
        ) from exc
    worst = _worst_gradient(reference, candidate)
    loss_error = abs(loss.item() - ref_loss) / max(abs(ref_loss), 1e-30)
    if loss_error > TOLERANCE or worst[0] > TOLERANCE:
        raise PrefixFlowError(
            f"{owner}: a tiny float64 copy trained with PrefixFlow does not match full sequences (loss off by "
            f"{loss_error:.1e}, gradient of {worst[1]} off by {worst[0]:.1e} of its scale), so some module mixes "
            "tokens outside the attention function or ignores the suffix positions. Train this model with the "
            "plain trainer."
        )


def _weighted_logp(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0] * weights).sum()


def _worst_gradient(reference: torch.nn.Module, candidate: torch.nn.Module) -> tuple[float, str]:
    worst = (0.0, "")
    for (name, expected), (_, actual) in zip(reference.named_parameters(), candidate.named_parameters()):
        if expected.grad is None and actual.grad is None:
            continue
        if expected.grad is None or actual.grad is None:
            return float("inf"), name
        scale = expected.grad.abs().max().item()
        error = (actual.grad - expected.grad).abs().max().item()
        relative = error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))
        worst = max(worst, (relative, name))
    return worst
