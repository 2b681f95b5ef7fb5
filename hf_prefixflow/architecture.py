"""What PrefixFlow can train exactly: checks of a model's structure, and a probe that trains a tiny copy.

PrefixFlow's prefix interface is each attention layer's K/V. A module that mixes tokens any other way (a convolution
over time, an SSM or linear-attention state, attention that bypasses transformers' `AttentionInterface`) carries
prefix information the cache does not hold, so suffixes trained against the cache would get wrong gradients.
`check_structure` refuses the mixers it can name; `probe` catches the rest, including families added to
transformers later: it builds a tiny random copy of the model's architecture (same class, same config options, small
sizes) in float64 on the CPU, checks that every attention layer runs once per forward and receives its sliding
window, trains one group both ways, and refuses unless loss and every gradient agree. `benchmarks/families.py` runs
the same checks over every causal-LM family transformers has (`docs/families.md`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import _compat as compat, attention, states
from .errors import PrefixFlowError

# `config.layer_types` values whose layers mix tokens only through attention.
# (or not at all: a layer of only an MLP or MoE block, as NemotronH's)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "global", "local", "full", "sliding",
                         "mlp", "moe", "chunked_attention"}  # chunks: the waves' masks keep them (`chunk_size`)
# Module class names of token mixers other than attention, and what each does.
MIXER_PATTERNS = (
    (re.compile(r"Mamba|SSM|Mixer$"), "a state-space (Mamba) mixer carries a recurrent state across the sequence"),
    (re.compile(r"DeltaNet|DeltaAttention|LinearAttention|Lightning|Retention|Rwkv|RWKV|Lstm|LSTM|Recurrent"),
     "a linear-attention / recurrent mixer carries a state across the sequence"),
    (re.compile(r"ShortConv|CausalConv|Conv1d|Conv$"), "a convolution over time mixes neighbouring tokens"),
)
# Why a `layer_types` kind other than attention cannot be trained from cached K/V.
KIND_REASONS = {
    "conv": "it mixes tokens by a causal convolution whose window it does not read through transformers' cache API",
    "linear_attention": "it mixes tokens through a recurrent (linear-attention or state-space) state that it does not "
                        "read through transformers' cache API (get_conv_state / get_recurrent_state)",
    "hybrid": "it mixes tokens through a state-space mixer that does not read its state through transformers' cache "
              "API",
    "hybrid_sliding": "it mixes tokens through a state-space mixer that does not read its state through transformers' "
                      "cache API",
    "indexed_attention": "its sparse-attention indexer scores the prefix with keys of its own",
    "compressed_sparse_attention": "it attends to compressed blocks of the sequence built outside its K/V",
    "heavily_compressed_attention": "it attends to compressed blocks of the sequence built outside its K/V",
}
# `layer_types` kinds of recurrent layers: exact when their mixer reads its state through the cache API
# (`states.is_state_mixer`), which PrefixFlow then serves from the group's cache.
STATE_LAYER_TYPES = {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "mamba2", "ssm", "recurrent"}
# Mixers that read a cached state only for one-token decoding: their multi-token scan always starts from zero, so a
# suffix cannot continue from the prefix's state (Mamba1: Mamba, FalconMamba, Jamba, Zamba).
FROM_ZERO_MIXERS = {"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"}
TOLERANCE = 1e-5  # relative, float64: the equivalence tests' bound


def _decoder_layers(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """(name in `model`, module) of the decoder layers: the elements of the decoder's ModuleList children."""
    from .model import decoder_of

    decoder = decoder_of(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    return [(f"{prefix}.{name}.{index}".lstrip("."), layer) for name, stack in decoder.named_children()
            if isinstance(stack, torch.nn.ModuleList) for index, layer in enumerate(stack)]


def check_structure(model: PreTrainedModel) -> None:
    """Refuse models whose decoder mixes tokens outside the attention function (or has identity MoE experts),
    naming the layer or module and why."""
    owner = type(model).__name__
    text_config = model.config.get_text_config()
    layers = [layer for _, layer in _decoder_layers(model)]
    for index, kind in enumerate(getattr(text_config, "layer_types", None) or []):
        if kind in STATE_LAYER_TYPES and index < len(layers) and _carries_state(layers[index]):
            continue
        if kind not in ATTENTION_LAYER_TYPES:
            how = KIND_REASONS.get(kind, "it is not known to mix tokens only through attention")
            raise PrefixFlowError(
                f"{owner}: layer {index} has layer type {kind!r}: {how}, so a suffix depends on the prefix through "
                "more than the K/V PrefixFlow caches and the causal masks it builds. PrefixFlow would train it "
                "wrongly; train this model with the plain trainer."
            )
    named = list(_decoder_named_modules(model))
    for name, module in named:
        if type(module).__name__ in FROM_ZERO_MIXERS:
            raise PrefixFlowError(
                f"{owner}: {name} ({type(module).__name__}) is a Mamba1 mixer whose multi-token scan in transformers "
                "always starts from a zero state (a cached state is read only when decoding one token), so a suffix "
                "cannot continue from the prompt's state. PrefixFlow would train it wrongly; train this model with "
                "the plain trainer."
            )
    # A recurrent mixer's state at the end of the prefix is cached like K/V (`states`): it, its parts and the
    # layers holding it pass.
    stateful = [n for n, m in named if states.is_state_mixer(type(m)) and hasattr(m, "layer_idx")]
    for name, module in named:
        cls = type(module).__name__
        if any(name == s or name.startswith(s + ".") or s.startswith(name + ".") for s in stateful):
            continue
        if _is_attention(type(module)):  # e.g. Kimi-Linear's MLA `KimiLinearAttention`: the probe checks it
            continue
        if cls.endswith(("Norm", "NormGated")):  # per token (Mamba2RMSNorm): nothing to carry across tokens
            continue
        for pattern, why in MIXER_PATTERNS:
            if pattern.search(cls) or (isinstance(module, torch.nn.Conv1d) and pattern is MIXER_PATTERNS[2][0]):
                raise PrefixFlowError(
                    f"{owner}: {name} ({cls}) mixes tokens outside attention: {why}, so a suffix depends on the "
                    "prefix through it as well as through K/V. PrefixFlow caches K/V and the states mixers read "
                    "through transformers' cache API (get_conv_state / get_recurrent_state); this one keeps its "
                    "state its own way, so PrefixFlow would train it wrongly. Train this model with the plain "
                    "trainer."
                )
        if isinstance(module, torch.nn.Identity) and "expert" in name.rsplit(".", 1)[-1]:
            raise PrefixFlowError(
                f"{owner}: {name} is a zero-computation (identity) MoE expert. When every completion token of a "
                "step routes only to such experts in the last layer, the expert weights get no gradient under "
                "PrefixFlow (only prompt tokens reached them there, and nothing reads the prompt's last-layer "
                "output), where full sequences give them a zero one, which optimizers with momentum or weight "
                "decay still act on. Train this model with the plain trainer."
            )


@functools.lru_cache(maxsize=None)
def _is_attention(cls: type) -> bool:
    """Whether `cls.forward` dispatches through transformers' attention functions (whatever its name says)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "eager_attention_forward" in source


def _carries_state(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer mixes tokens through a recurrent mixer PrefixFlow caches the state of."""
    return any(states.is_state_mixer(type(m)) and hasattr(m, "layer_idx") for m in layer.modules())


def _decoder_named_modules(model: PreTrainedModel):
    for layer_name, layer in _decoder_layers(model):
        for name, module in layer.named_modules():
            yield f"{layer_name}.{name}".rstrip("."), module


# ---- a tiny copy of the architecture --------------------------------------------------------------------------

_SIZES = {
    "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "head_dim": 8, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "ffn_hidden_size": 48, "n_inner": 48, "d_ff": 48,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    # MLA: DeepSeek's rotary dimension is `head_dim`, so the rotary part of a query/key head is as wide as head_dim
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    "v_head_dim": 8, "n_group": 1, "topk_group": 1, "num_shared_experts": 1, "n_shared_experts": 1,
    "global_head_dim": 8, "num_global_key_value_heads": 2, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 97, "laurel_rank": 4, "altup_num_inputs": 2, "rotary_dim": 4,
    "first_k_dense_replace": 1, "num_dense_layers": 1,  # leading dense layers: one, so a tiny copy keeps MoE layers
    # recurrent mixers: Mamba2 heads x head size = expand x hidden (64); scan chunks shorter than the probe's prompt
    "mamba_n_heads": 4, "mamba_num_heads": 4, "n_mamba_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_headdim": 16, "mamba_d_ssm": 64, "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8,
    "mamba_chunk_size": 4, "n_groups": 2, "mamba_n_groups": 2, "mamba_ngroups": 2, "attention_head_dim": 16,
    "attention_hidden_size": 64, "linear_num_heads": 4, "linear_head_dim": 8, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    # sparse-attention indexers, left unset by some default configs
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    # encoder-decoder and fairseq-style names
    "d_model": 32, "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_ffn_dim": 48,
    "encoder_ffn_dim": 48, "decoder_layers": 2, "encoder_layers": 2,
}
_AT_MOST = ("n_groups", "mamba_n_groups", "mamba_ngroups", "num_shared_experts", "n_shared_experts",
            "num_experts_per_tok", "moe_topk", "rotary_dim",
            "first_k_dense_replace", "num_dense_layers", "decoder_layers", "encoder_layers")
# Left unset (None) by some families' default configs although their layers need them.
_UNSET = ("head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "indexer_n_heads",
          "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# Vision and audio towers and their projectors: the probe feeds text only, so they need only be built, and small.
_TOWER_SIZES = {
    "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_heads": 4, "head_dim": 8,
    "embed_dim": 32, "out_hidden_size": 32, "projection_dim": 32, "vision_output_dim": 32, "mlp_dim": 48,
    "projector_hidden_size": 32, "num_hidden_layers": 2, "depth": 2, "num_layers": 2, "num_blocks": 2,
    "num_key_value_heads": 4, "hidden_size_global": 32,
}
_MAX_LAYERS = 8
VOCAB = 97
# Token ids that must index the tiny vocabulary; others (image, audio, vision-start placeholders) stay above it, so
# random text never holds them, as a text-only batch does not.
_TEXT_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
                   "unk_token_id", "decoder_start_token_id")


def tiny_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of `config` with the same family and options at tiny sizes: 32 hidden, 4 heads, head sizes scaled by
    one factor to 8 for the smallest (equal sizes stay equal), a vocabulary of 97, at most 8 layers (a layer of every
    kind in `layer_types`, and the layers that share them their K/V), 4 experts, windows, chunks and temperature steps
    of 4 positions; vision and audio towers of 2 layers at 32 hidden; no dropout and no router jitter."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    configs = nested_configs(config)
    for tower in configs:
        if tower is not text:
            for name, value in _TOWER_SIZES.items():
                current = _get(tower, name)
                if isinstance(current, int) and not isinstance(current, bool) and current > value:
                    _set(tower, name, value)
    _shrink_text(text)
    for name, value in vars(text).items():  # extra vocabularies (hashed n-grams, per-layer inputs) too
        if re.search(r"vocab(_size)?$", name) and isinstance(value, int) and value > VOCAB:
            setattr(text, name, VOCAB)
    text.vocab_size = VOCAB
    for obj in configs:
        _clamp_token_ids(obj)
        if _has(obj, "use_cache"):
            obj.use_cache = False  # training builds no inference cache (nor do PrefixFlow's own forwards)
        for name, value in vars(obj).items():
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
                setattr(obj, name, 0.0)
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return config


def _shrink_text(text: PretrainedConfig) -> None:
    heads, kv_heads = _get(text, "num_attention_heads"), _get(text, "num_key_value_heads")
    before = {name: _get(text, name) for name in _SIZES}
    for name, value in _SIZES.items():
        current = before[name]
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            _set(text, name, min(current, value) if name in _AT_MOST else value)
        elif current is None and name in _UNSET and _has(text, name):
            _set(text, name, value)
    if isinstance(heads, int) and _has(text, "num_key_value_heads"):
        kv_heads = kv_heads if isinstance(kv_heads, int) else heads
        _set(text, "num_key_value_heads", 1 if kv_heads == 1 else 4 if kv_heads >= heads else 2)
    _scale_head_dims(text, before)
    _shrink_per_layer_overrides(text, before)
    _fit_rope_sections(text)
    _fit_mamba_heads(text)
    layers = _get(text, "num_hidden_layers")
    if isinstance(layers, int):
        kinds = list(_get(text, "layer_types") or [])
        keep = min(layers, max(2, _covering(kinds)), _MAX_LAYERS)
        shared = _get(text, "num_kv_shared_layers")
        if isinstance(shared, int) and shared > 0:  # the last layers reuse earlier layers' K/V: keep both kinds
            keep = min(layers, 2 * keep)
            text.num_kv_shared_layers = keep // 2
        kept = list(range(keep)) if isinstance(shared, int) and shared > 0 else _kept_layers(kinds, keep)
        keep = len(kept)
        _split_layer_groups(text, layers, keep)
        if kept == list(range(keep)):
            _truncate_per_layer_lists(text, layers, keep)
        else:
            _select_layers(text, layers, kept)
        text.num_hidden_layers = keep
    # Position scales shorter than the probe's prompt, so what they do is exercised: windows, chunks, and the
    # positions at which Llama 4's attention temperature steps (`attention.index_scaled_query`).
    for name in ("sliding_window", "attention_chunk_size", "floor_scale"):
        if isinstance(_get(text, name), int) and not isinstance(_get(text, name), bool):
            setattr(text, name, 4)


def _get(config: PretrainedConfig, name: str):
    """`config.name` or None, also for per-layer attributes of heterogeneous configs (transformers 5.24), which
    refuse global reads."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, None) if read is not None else getattr(config, name, None)


def _has(config: PretrainedConfig, name: str) -> bool:
    return name in vars(config) or name in getattr(config, "attribute_map", {})


def _shrink_per_layer_overrides(text: PretrainedConfig, before: dict) -> None:
    """Per-layer sizes of a heterogeneous config: twice or half the tiny global size where the layer's value is
    above or below the global one, so layers still differ."""
    spec = vars(text).get("_heterogeneity_spec")
    for overrides in (spec.per_layer_overrides.values() if spec is not None else ()):
        for name, value in overrides.items():
            tiny, global_value = _get(text, name), before.get(name)
            if name not in _SIZES or not all(isinstance(v, int) for v in (value, tiny, global_value)):
                continue
            if value > global_value:
                overrides[name] = tiny * 2
            elif value < global_value:
                overrides[name] = max(1, tiny // 2)
            else:
                overrides[name] = tiny


def _fit_mamba_heads(text: PretrainedConfig) -> None:
    """Mamba2's heads times head size fill its inner width (`expand` x hidden): the head count follows the tiny
    sizes (attention-free Mamba2 names them `num_heads` / `head_dim`)."""
    expand, heads, head_dim = (_get(text, n) for n in ("expand", "num_heads", "head_dim"))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (expand, heads, head_dim)) \
            and not _has(text, "num_attention_heads"):
        _set(text, "num_heads", max(1, expand * _get(text, "hidden_size") // head_dim))
        if isinstance(_get(text, "chunk_size"), int):
            _set(text, "chunk_size", 4)  # shorter than the probe's prompt: the scan crosses chunks


def _fit_rope_sections(text: PretrainedConfig) -> None:
    """Multimodal RoPE's `mrope_section` (rotary frequencies per position axis) fitted to the tiny rotary size:
    scaled where the config has one, drawn where the family takes one (real checkpoints set it)."""
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict) or "mrope_section" not in getattr(text, "ignore_keys_at_rope_validation", ()):
        return
    head_dim = _get(text, "head_dim") or _get(text, "hidden_size") // _get(text, "num_attention_heads")
    target = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    sections = rope.get("mrope_section") or [1, 1, 1]
    if target < len(sections):
        return
    total = sum(sections)
    scaled = [max(1, s * target // total) for s in sections]
    for index in sorted(range(len(scaled)), key=lambda i: sections[i] * target / total - scaled[i], reverse=True):
        scaled[index] += sum(scaled) < target
    rope["mrope_section"] = scaled


def _split_layer_groups(text: PretrainedConfig, layers: int, keep: int) -> None:
    """Counts of layers per stage (`n_input_layers`, `n_recurrent_layers` ...) that add up to the layer count:
    shared out over the layers kept, at least one each."""
    groups = {name: value for name, value in vars(text).items() if re.fullmatch(r"(n|num)_\w+_layers", name)
              and name not in ("num_hidden_layers", "num_kv_shared_layers") and isinstance(value, int)
              and not isinstance(value, bool) and value > 0}
    if len(groups) < 2 or sum(groups.values()) != layers or keep < len(groups):
        return
    shares = {name: max(1, value * keep // layers) for name, value in groups.items()}
    largest = max(shares, key=shares.get)
    shares[largest] += keep - sum(shares.values())
    for name, value in shares.items():
        setattr(text, name, value)


def nested_configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """`config` and every configuration nested in it (text, vision, audio ...), each once."""
    found, stack = {}, [config]
    while stack:
        current = stack.pop()
        if id(current) in found:
            continue
        found[id(current)] = current
        stack.extend(v for v in vars(current).values() if isinstance(v, PretrainedConfig))
    return list(found.values())


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


# Per-head sizes whose equalities and sums a family's shapes rely on: MLA's query/key head is `qk_nope_head_dim +
# qk_rope_head_dim` wide and its rotary part `head_dim`; sdpa takes its grouped-query path only where the value head
# is as wide as the key head (`v_head_dim == qk_head_dim`); Gemma 4's global layers have heads of their own width.
_HEAD_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "global_head_dim")


def _scale_head_dims(text: PretrainedConfig, before: dict) -> None:
    """The config's per-head sizes divided by one factor, the smallest becoming `_SIZES["head_dim"]` (8): equal
    sizes stay equal and sums stay sums. Sizes without such a factor keep `_SIZES`' fixed values."""
    sizes = {name: before[name] for name in _HEAD_DIMS
             if isinstance(before.get(name), int) and not isinstance(before[name], bool) and before[name] > 0}
    if not sizes:
        return
    unit, smallest = _SIZES["head_dim"], min(sizes.values())
    if any(value * unit % smallest for value in sizes.values()) or max(sizes.values()) > 8 * smallest:
        return  # no common factor, or a head over 8 times the smallest (over 64 wide here): the fixed sizes serve
    for name, value in sizes.items():
        _set(text, name, value * unit // smallest)


def _kept_layers(kinds: list, keep: int) -> list[int]:
    """The indices of the `keep` layers a tiny copy keeps: the first `keep`, unless they miss a kind `kinds` holds
    (Qwen2's sliding layers start at `max_window_layers`), then the first layer of each kind and the first of the
    others, in order."""
    if _covering(kinds) <= keep:
        return list(range(keep))
    firsts = {kinds.index(kind) for kind in dict.fromkeys(kinds)}
    others = [index for index in range(len(kinds)) if index not in firsts]
    return sorted(firsts | set(others[:max(0, keep - len(firsts))]))[:max(keep, len(firsts))]


# Config lists of layer indices (not per-layer values): renumbered when a tiny copy keeps layers out of order.
_LAYER_INDEX_LISTS = re.compile(r"(_layers|_idxs|_indices|_layer_ids)$")


def _select_layers(config: PretrainedConfig, layers: int, kept: list[int]) -> None:
    """Keep the layers `kept` (indices of the full config, in order): per-layer lists and overrides take their
    entries, lists of layer indices and `max_window_layers` (the first sliding layer) are renumbered."""
    number = {old: new for new, old in enumerate(kept)}
    for name, value in list(vars(config).items()):
        if name.startswith("_") or not isinstance(value, (list, tuple)):
            continue
        if len(value) == layers:
            setattr(config, name, type(value)(value[i] for i in kept))
        elif _LAYER_INDEX_LISTS.search(name) and all(isinstance(i, int) and 0 <= i < layers for i in value):
            setattr(config, name, type(value)(number[i] for i in value if i in number))
    if isinstance(vars(config).get("max_window_layers"), int):
        config.max_window_layers = sum(index < config.max_window_layers for index in kept)
    spec = vars(config).get("_heterogeneity_spec")
    if spec is not None:
        overrides = {number[i]: value for i, value in spec.per_layer_overrides.items() if i in number}
        spec.per_layer_overrides.clear()
        spec.per_layer_overrides.update(overrides)


def _truncate_per_layer_lists(config: PretrainedConfig, layers: int, keep: int) -> None:
    for name, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and not name.startswith("_"):
            setattr(config, name, type(value)(value[:keep]))
    spec = vars(config).get("_heterogeneity_spec")
    if spec is not None:
        for index in [i for i in spec.per_layer_overrides if i >= keep]:
            del spec.per_layer_overrides[index]


def _clamp_token_ids(config: PretrainedConfig) -> None:
    for name, value in list(vars(config).items()):
        if name.lstrip("_") not in _TEXT_TOKEN_IDS:
            continue
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, VOCAB - 1)
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB else VOCAB - 1 for v in value])


_NARROW = (torch.float32, torch.float16, torch.bfloat16)
_NARROWING_METHODS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


class float64_throughout(TorchFunctionMode):
    """Inside this mode, casts of a float64 tensor to a narrower float keep float64: norms and softmaxes that
    upcast "to float32" narrow a float64 model. Rounding a sum of gradients differs from summing rounded gradients,
    so such casts make two exact computations of one gradient differ by float32 noise (up to 1e-4 of a scalar
    gradient that sums cancelling terms); in float64 throughout they agree to ~1e-13, and a 1e-5 tolerance
    separates exact from inexact. Backward passes run outside the mode (they cast nothing a forward did not);
    checkpoint recomputes inside them take it up through `recompute_in_float64`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Integer tensors too: RoPE's `position_ids.float()` meets float64 frequencies (transformers 5.17).
        if args and isinstance(args[0], torch.Tensor) and (args[0].dtype == torch.float64
                                                           or not args[0].is_floating_point()):
            if func in _NARROWING_METHODS:
                return args[0].to(torch.float64)
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a in _NARROW else a for a in args)
            if kwargs.get("dtype") in _NARROW:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def recompute_in_float64(model: torch.nn.Module) -> None:
    """Make `model`'s non-reentrant activation checkpointing recompute under `float64_throughout`, as its forward
    ran (torch's `context_fn`)."""
    for module in model.modules():
        function = compat.checkpoint_function(module)
        if isinstance(function, functools.partial):
            compat.set_checkpoint_function(module, functools.partial(
                function, context_fn=lambda: (contextlib.nullcontext(), float64_throughout())))


def build_tiny(model_cls: type, config, attn: str, seed: int = 0) -> PreTrainedModel:
    """A float64 CPU model of `model_cls` on `tiny_config(config)`, weights drawn from N(0, 0.25) so attention is
    far from uniform and a missed dependency shows in the gradients."""
    tiny = tiny_config(config)
    tiny._attn_implementation = attn
    torch.random.default_generator.manual_seed(seed)  # the CPU stream alone (`probe` forks it); CUDA's untouched
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
    from .model import enable  # the switch without a probe

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
    result = _reach(candidate)
    _bridge(candidate, result)
    if reference.supports_gradient_checkpointing:
        for tiny in (reference, candidate):
            compat.enable_checkpointing(tiny, use_reentrant=False)
            recompute_in_float64(tiny)
    _compare(reference, candidate, owner)
    return result


def _reach(model: PreTrainedModel) -> ProbeResult:
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
    layers = {id(layer): layer for _, layer in _decoder_layers(model)}
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
    window, kinds = _get(text, "sliding_window"), _get(text, "layer_types") or []
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


# The probe's group: a prompt longer than the windows and chunks `tiny_config` sets (4), and four completions in two
# waves of right-padded rows.
_PROBE_PREFIX, _PROBE_SUFFIXES, _PROBE_WAVES = 13, (6, 3, 5, 2), ((0, 1), (2, 3))


def _compare(reference: PreTrainedModel, candidate: PreTrainedModel, owner: str) -> None:
    from .scheduler import prefix_group

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
