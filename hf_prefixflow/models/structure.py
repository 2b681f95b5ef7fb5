"""What PrefixFlow can train exactly, read from a model's structure.

PrefixFlow's prefix interface is each attention layer's K/V and each recurrent mixer's state. A module that mixes
tokens any other way (a convolution over time or an SSM state it keeps its own way, attention that bypasses
transformers' `AttentionInterface`) carries prefix information the cache does not hold, so suffixes trained against
the cache would get wrong gradients. `check_structure` refuses the mixers it can name; `probe.probe` catches the rest.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers import PreTrainedModel

from ..core import states
from ..core.access import decoder_of
from ..errors import PrefixFlowError

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


def decoder_layers(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """(name in `model`, module) of the decoder layers: the elements of the decoder's ModuleList children."""
    decoder = decoder_of(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    return [(f"{prefix}.{name}.{index}".lstrip("."), layer) for name, stack in decoder.named_children()
            if isinstance(stack, torch.nn.ModuleList) for index, layer in enumerate(stack)]


def check_structure(model: PreTrainedModel) -> None:
    """Refuse models whose decoder mixes tokens outside the attention function (or has identity MoE experts),
    naming the layer or module and why."""
    owner = type(model).__name__
    text_config = model.config.get_text_config()
    check_standalone(model)
    layers = [layer for _, layer in decoder_layers(model)]
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


def not_standalone(model_cls: type, config) -> str | None:
    """Why `model_cls` on `config` is no standalone decoder-only causal LM, or None: a draft model for assisted
    decoding (Gemma 4's assistants), every layer of which attends to K/V another model computed (its config shares
    K/V across all its layers, `num_kv_shared_layers` >= `num_hidden_layers`), passed in with that model's hidden
    states, so no layer computes K/V from the model's own tokens."""
    text = config.get_text_config()
    shared, layers = (getattr(text, name, None) for name in ("num_kv_shared_layers", "num_hidden_layers"))
    if not (isinstance(shared, int) and isinstance(layers, int) and 0 < layers <= shared):
        return None
    inputs = inspect.signature(model_cls.forward).parameters
    fed = (", which its forward takes as `shared_kv_states` with that model's hidden states as `inputs_embeds`"
           if "shared_kv_states" in inputs else "")
    return (f"every one of its {layers} layers attends to K/V that another model computed (num_kv_shared_layers "
            f"{shared}, num_hidden_layers {layers}){fed}, so no layer computes K/V from the model's own tokens: a "
            "draft model for assisted decoding, run beside its target model")


def check_standalone(model: PreTrainedModel) -> None:
    """Refuse a model that is no standalone decoder-only causal LM (`not_standalone`)."""
    why = not_standalone(type(model), model.config)
    if why is not None:
        raise PrefixFlowError(
            f"{type(model).__name__} is not a standalone decoder-only causal LM: {why}. PrefixFlow runs a prompt's "
            "forward once and trains completions against the K/V each layer computed from that prompt; this model "
            "has no such K/V, and does not train from token ids alone."
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
    for layer_name, layer in decoder_layers(model):
        for name, module in layer.named_modules():
            yield f"{layer_name}.{name}".rstrip("."), module
