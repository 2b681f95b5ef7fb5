"""What PrefixFlow can train exactly: checks of a model's structure, and a probe that trains a tiny copy.

PrefixFlow's prefix interface is each attention layer's K/V. A module that mixes tokens any other way (a convolution
over time, an SSM or linear-attention state, attention that bypasses transformers' `AttentionInterface`) carries
prefix information the cache does not hold, so suffixes trained against the cache would get wrong gradients.
`check_structure` refuses the mixers it can name; `probe` catches the rest, including families added to
transformers later: it builds a tiny random copy of the model's architecture (same class, same config options, small
sizes) in float64 on the CPU, trains one group both ways, and refuses unless loss and every gradient agree.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from . import _compat as compat, attention
from .errors import PrefixFlowError

# `config.layer_types` values whose layers mix tokens only through attention.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local",
                         "full", "sliding", "chunked"}
# Module class names of token mixers other than attention, and what each does.
MIXER_PATTERNS = (
    (re.compile(r"Mamba|SSM|Mixer$"), "a state-space (Mamba) mixer carries a recurrent state across the sequence"),
    (re.compile(r"DeltaNet|LinearAttention|Lightning|Retention|Rwkv|RWKV|Lstm|LSTM|Recurrent"),
     "a linear-attention / recurrent mixer carries a state across the sequence"),
    (re.compile(r"ShortConv|CausalConv|Conv1d|Conv$"), "a convolution over time mixes neighbouring tokens"),
)
TOLERANCE = 1e-5  # relative, float64: the equivalence tests' bound


def _decoder_layers(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """(name in `model`, module) of the decoder layers: the elements of the decoder's ModuleList children."""
    from .model import decoder_of

    decoder = decoder_of(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    return [(f"{prefix}.{name}.{index}".lstrip("."), layer) for name, stack in decoder.named_children()
            if isinstance(stack, torch.nn.ModuleList) for index, layer in enumerate(stack)]


def check_structure(model: PreTrainedModel) -> None:
    """Refuse models whose decoder mixes tokens outside the attention function, naming the module and why."""
    owner = type(model).__name__
    text_config = model.config.get_text_config()
    for index, kind in enumerate(getattr(text_config, "layer_types", None) or []):
        if kind not in ATTENTION_LAYER_TYPES:
            raise PrefixFlowError(
                f"{owner}: layer {index} has layer type {kind!r}, which mixes tokens outside attention, so a "
                "suffix depends on the prefix through that layer's state as well as through K/V. PrefixFlow caches "
                "only K/V and would train it wrongly; train this model with the plain trainer."
            )
    for name, module in _decoder_named_modules(model):
        cls = type(module).__name__
        for pattern, why in MIXER_PATTERNS:
            if pattern.search(cls) or (isinstance(module, torch.nn.Conv1d) and pattern is MIXER_PATTERNS[2][0]):
                raise PrefixFlowError(
                    f"{owner}: {name} ({cls}) mixes tokens outside attention: {why}, so a suffix depends on the "
                    "prefix through it as well as through K/V. PrefixFlow caches only K/V and would train it "
                    "wrongly; train this model with the plain trainer."
                )


def _decoder_named_modules(model: PreTrainedModel):
    for layer_name, layer in _decoder_layers(model):
        for name, module in layer.named_modules():
            yield f"{layer_name}.{name}".rstrip("."), module


# ---- a tiny copy of the architecture --------------------------------------------------------------------------

_SIZES = {
    "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "head_dim": 8, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "ffn_hidden_size": 48, "n_inner": 48, "d_ff": 48,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "qk_head_dim": 12,
    "v_head_dim": 8, "n_group": 1, "topk_group": 1, "num_shared_experts": 1, "n_shared_experts": 1,
    "global_head_dim": 8, "num_global_key_value_heads": 2, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 97, "laurel_rank": 4, "altup_num_inputs": 2,
}
_MAX_LAYERS = 8
VOCAB = 97


def tiny_config(config):
    """A copy of `config` with the same family and options at tiny sizes: 32 hidden, 4 heads of 8, a vocabulary of
    97, at most 8 layers (covering every kind in `layer_types`), 4 experts; no dropout and no router jitter."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    for name, value in _SIZES.items():
        current = getattr(text, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            _set(text, name, min(current, value) if name in _AT_MOST else value)
    if isinstance(heads, int) and hasattr(text, "num_key_value_heads"):
        kv_heads = kv_heads if isinstance(kv_heads, int) else heads
        _set(text, "num_key_value_heads", 1 if kv_heads == 1 else 4 if kv_heads >= heads else 2)
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int):
        kinds = list(getattr(text, "layer_types", None) or [])
        keep = min(layers, max(2, _covering(kinds)), _MAX_LAYERS)
        _truncate_per_layer_lists(text, layers, keep)
        text.num_hidden_layers = keep
    if isinstance(getattr(text, "sliding_window", None), int):
        text.sliding_window = 4  # shorter than the probe's sequences: windows are exercised
    text.vocab_size = VOCAB
    for obj in {id(config): config, id(text): text}.values():
        _clamp_token_ids(obj)
        for name, value in vars(obj).items():
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
                setattr(obj, name, 0.0)
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return config


_AT_MOST = ("num_shared_experts", "n_shared_experts", "num_experts_per_tok", "moe_topk")


def _set(config, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except AttributeError:  # a derived property (Falcon's head_dim): it follows the sizes it derives from
        pass


def _covering(kinds: list) -> int:
    """The shortest prefix of `kinds` holding every distinct kind."""
    seen, wanted = set(), set(kinds)
    for index, kind in enumerate(kinds):
        seen.add(kind)
        if seen == wanted:
            return index + 1
    return 0


def _truncate_per_layer_lists(config, layers: int, keep: int) -> None:
    for name, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and not name.startswith("_"):
            setattr(config, name, type(value)(value[:keep]))


def _clamp_token_ids(config) -> None:
    for name, value in list(vars(config).items()):
        if not name.endswith("token_id"):
            continue
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, VOCAB - 1)
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB else VOCAB - 1 for v in value])


def build_tiny(model_cls: type, config, attn: str, seed: int = 0) -> PreTrainedModel:
    """A float64 CPU model of `model_cls` on `tiny_config(config)`, weights drawn from N(0, 0.25) so attention is
    far from uniform and a missed dependency shows in the gradients."""
    tiny = tiny_config(config)
    tiny._attn_implementation = attn
    torch.manual_seed(seed)
    # The class itself, not `_from_config`: under a DeepSpeed ZeRO-3 config that would partition the copy's weights.
    model = model_cls(tiny).to(torch.float64)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25)
    return model


# ---- the probe ------------------------------------------------------------------------------------------------

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
        _probed[key] = _run_probe(type(model), model.config, "sdpa" if base == "flex_attention" else base)
    return _probed[key]


def _run_probe(model_cls: type, config, attn: str) -> ProbeResult:
    from .model import enable  # the switch without a probe

    owner = model_cls.__name__
    try:
        reference = build_tiny(model_cls, config, attn)
        ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            reference(input_ids=ids)
    except Exception as exc:  # noqa: BLE001 - any failure to build or run the copy means "could not probe"
        why = f"a tiny {owner} could not be built or run ({type(exc).__name__}: {str(exc)[:200]})"
        warnings.warn(f"PrefixFlow could not probe {owner}: {why}. Its structure was checked; its gradients were "
                      "not compared with full sequences.", stacklevel=4)
        return ProbeResult(skipped=why)
    candidate = copy.deepcopy(reference)
    enable(candidate)
    result = _reach(candidate)
    _bridge(candidate, result)
    if reference.supports_gradient_checkpointing:
        for tiny in (reference, candidate):
            compat.enable_checkpointing(tiny, use_reentrant=False)
    _compare(reference, candidate, owner)
    return result


def _reach(model: PreTrainedModel) -> ProbeResult:
    """Which attention calls receive the model's kwargs: a forward carrying `attention.REACH`."""
    attention.REACH.calls = []
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]), **{attention.PASS_KWARG: attention.REACH})
        calls = attention.REACH.calls
    finally:
        attention.REACH.calls = None
    owner = type(model).__name__
    if not calls:
        raise PrefixFlowError(
            f"{owner} never called the registered attention function, so PrefixFlow could not cache or read its "
            "prefix K/V: its attention does not go through transformers' AttentionInterface. Train this model "
            "with the plain trainer."
        )
    names = {id(m): n for n, m in model.named_modules()}
    layers = {id(layer): layer for _, layer in _decoder_layers(model)}
    result = ProbeResult()
    for module, reached in calls:
        if not reached:
            layer = _enclosing_layer(model, names[id(module)], layers)
            result.bridged_layers.add(type(layer).__name__)
            result.attention_classes.add(type(module).__name__)
    return result


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
    layers = [layer for _, layer in _decoder_layers(model) if type(layer).__name__ in result.bridged_layers]
    modules = [m for layer in layers for m in layer.modules() if type(m).__name__ in result.attention_classes]
    attention.bridge_layers(layers, modules)


def bridge(model: PreTrainedModel, result: ProbeResult) -> None:
    """Bridge `model`'s layers as the probe found necessary; when it could not probe, every decoder layer."""
    if result.skipped is None:
        _bridge(model, result)
        return
    layers = [layer for _, layer in _decoder_layers(model)]
    modules = [m for layer in layers for m in layer.modules()
               if hasattr(m, "layer_idx") and m is not layer and _takes_kwargs(m)]
    attention.bridge_layers(layers, modules)


def _takes_kwargs(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _compare(reference: PreTrainedModel, candidate: PreTrainedModel, owner: str) -> None:
    from .scheduler import prefix_group

    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, VOCAB, (7,), generator=gen)
    suffixes = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (4, 2)]
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in suffixes]
    reference.train()
    candidate.train()
    ref_loss = 0.0
    for suffix, weight in zip(suffixes, weights):
        logits = reference(input_ids=torch.cat([prefix, suffix])[None]).logits[0, len(prefix) - 1:-1]
        loss = _weighted_logp(logits, suffix, weight)
        loss.backward()
        ref_loss += loss.item()
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.zeros(2, 4, dtype=torch.long)
    for row, suffix in enumerate(suffixes):
        ids[row, :len(suffix)], mask[row, :len(suffix)] = suffix, 1
    try:
        with prefix_group(candidate, prefix) as group:
            logits = group(ids, attention_mask=mask).logits
            loss = sum(_weighted_logp(logits[r, :len(s)], s, w) for r, (s, w) in enumerate(zip(suffixes, weights)))
            loss.backward()
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
