"""A tiny float64 copy of a model's architecture: same class and config options, small sizes, random weights."""

from __future__ import annotations

import contextlib
import copy
import functools
import re

import torch
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig, PreTrainedModel

from .. import _compat as compat

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
    # the text config's own parts, shrunk as towers (DBRX's ffn_config; `_fit_part_configs`)
    "ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2,
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
                current = config_value(tower, name)
                if isinstance(current, int) and not isinstance(current, bool) and current > value:
                    _set(tower, name, value)
    _shrink_text(text)
    _fit_part_configs(text)
    _fit_patch_widths(config)
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
    heads, kv_heads = config_value(text, "num_attention_heads"), config_value(text, "num_key_value_heads")
    before = {name: config_value(text, name) for name in _SIZES}
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
    layers = config_value(text, "num_hidden_layers")
    if isinstance(layers, int):
        kinds = list(config_value(text, "layer_types") or [])
        keep = min(layers, max(2, _covering(kinds)), _MAX_LAYERS)
        shared = config_value(text, "num_kv_shared_layers")
        if isinstance(shared, int) and shared > 0:  # the last layers reuse earlier layers' K/V: keep both kinds
            keep = min(layers, 2 * keep)
            # (all of them where all share K/V another model computed: a draft model's, `structure.not_standalone`)
            text.num_kv_shared_layers = keep if shared >= layers else keep // 2
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
        if isinstance(config_value(text, name), int) and not isinstance(config_value(text, name), bool):
            setattr(text, name, 4)


def config_value(config: PretrainedConfig, name: str):
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
            tiny, global_value = config_value(text, name), before.get(name)
            if name not in _SIZES or not all(isinstance(v, int) for v in (value, tiny, global_value)):
                continue
            if value > global_value:
                overrides[name] = tiny * 2
            elif value < global_value:
                overrides[name] = max(1, tiny // 2)
            else:
                overrides[name] = tiny


# Sizes a text config's own parts (sub-configs of the text config itself, shrunk with the towers) take from it:
# DBRX's attention reads its key/value heads from `attn_config.kv_n_heads`, which its config copies to
# `num_key_value_heads`, and copies `d_model` into `ffn_config.hidden_size`.
_PART_SIZES = {"kv_n_heads": "num_key_value_heads", "hidden_size": "hidden_size"}


def _fit_part_configs(text: PretrainedConfig) -> None:
    """The text config's parts (DBRX's `attn_config` and `ffn_config`) take the sizes they share with it from the
    tiny text config (`_PART_SIZES`)."""
    for name in getattr(text, "sub_configs", None) or {}:
        part = vars(text).get(name)
        if not isinstance(part, PretrainedConfig) or part is text:
            continue
        for own, source in _PART_SIZES.items():
            value = config_value(text, source)
            if isinstance(config_value(part, own), int) and isinstance(value, int) and not isinstance(value, bool):
                setattr(part, own, value)


def _fit_patch_widths(config: PretrainedConfig) -> None:
    """Widths one nested config takes from another, in byte-to-patch models (BLT): the local encoder hands the
    global transformer `cross_attn_k` patch embeddings of its own width per patch, which the global transformer reads
    as they are where that is its own width (`encoder_cross_output_size` None, BLT's default) or through a projection
    from `encoder_cross_output_size`; the local encoder and decoder read the global width as `hidden_size_global`.
    The towers shrink to one width each, which breaks these: the tiny global transformer is `cross_attn_k` times the
    tiny encoder's width where it was at full size (else its projection reads the tiny product), and
    `hidden_size_global` follows it."""
    encoder, global_ = (getattr(config, name, None) for name in ("encoder_config", "global_config"))
    k = getattr(config, "cross_attn_k", None)
    if not (isinstance(encoder, PretrainedConfig) and isinstance(global_, PretrainedConfig) and isinstance(k, int)
            and _has(global_, "encoder_cross_output_size")):
        return
    if global_.encoder_cross_output_size is None:
        global_.hidden_size = encoder.hidden_size * k
        if isinstance(config_value(global_, "head_dim"), int):
            global_.head_dim = global_.hidden_size // global_.num_attention_heads
    else:
        global_.encoder_cross_output_size = encoder.hidden_size * k
    for tower in nested_configs(config):
        if isinstance(config_value(tower, "hidden_size_global"), int):
            tower.hidden_size_global = global_.hidden_size


def _fit_mamba_heads(text: PretrainedConfig) -> None:
    """Mamba2's heads times head size fill its inner width (`expand` x hidden): the head count follows the tiny
    sizes (attention-free Mamba2 names them `num_heads` / `head_dim`)."""
    expand, heads, head_dim = (config_value(text, n) for n in ("expand", "num_heads", "head_dim"))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (expand, heads, head_dim)) \
            and not _has(text, "num_attention_heads"):
        _set(text, "num_heads", max(1, expand * config_value(text, "hidden_size") // head_dim))
        if isinstance(config_value(text, "chunk_size"), int):
            _set(text, "chunk_size", 4)  # shorter than the probe's prompt: the scan crosses chunks


def _fit_rope_sections(text: PretrainedConfig) -> None:
    """Multimodal RoPE's `mrope_section` (rotary frequencies per position axis) fitted to the tiny rotary size:
    scaled where the config has one, drawn where the family takes one (real checkpoints set it)."""
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict) or "mrope_section" not in getattr(text, "ignore_keys_at_rope_validation", ()):
        return
    head_dim = (config_value(text, "head_dim")
                or config_value(text, "hidden_size") // config_value(text, "num_attention_heads"))
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
        elif func is torch.full and kwargs.get("dtype") is None and _beyond_float32(args[1] if len(args) > 1
                                                                                      else kwargs.get("fill_value")):
            # a mask fill of float64's own minimum (XGLM) cannot take the default float32
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _beyond_float32(value) -> bool:
    return isinstance(value, float) and abs(value) > torch.finfo(torch.float32).max


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
