"""Memory planning: does a group fit in device memory, how much does PrefixFlow need against full sequences, and
which knobs to use.

    estimate = hf_prefixflow.plan(model, prompt_tokens=10240, completion_tokens=2048, num_generations=16,
                                  device_memory=80 * 2**30, checkpointing="full")
    estimate.fits, estimate.phase_b_peak_bytes, estimate.baseline_peak_bytes, estimate.config()

An explicit byte model, no measurement: what autograd keeps per token of each decoder layer, checked against the
tensors a transformers Llama/Qwen3 layer saves (tests/test_planner.py) and against measured H200 peaks
(`benchmarks/memory.py` prints both). Notation (all in bytes unless a count):

    L layers, d hidden size, q = query heads x head dim, kv = key/value heads x head dim, Hq, Hkv head counts,
    f MLP width (experts per token x expert width for MoE), V vocabulary, e = element size of the activations (the
    weights' dtype; no autocast), e_g = element size of gK/gV (`kv_grad_dtype`, by default the trainable weights'),
    m = 4 for a gated MLP (gate, activation, up, product), 2 for a plain one. The loss's bytes for n scored
    positions, `loss(n)`: with `scoring="fused"` (TRL's fused LM head, GRPOTrainer's from TRL 1.15 on: tiles, no
    logits tensor) its backward's fp32 weight-gradient accumulator and cast, V d (4 + e), plus per position an fp32
    hidden-state gradient and cast, d (4 + e), and a tile row, e 32768 (for at most 4096 positions at a time); with
    `scoring="logits"` l V per position, l = loss bytes per logit (12: an fp32 log-softmax and its gradient, the
    model-dtype logits freed).

Per token and layer:

    norm(w) = 4w + 4 + e w                     RMSNorm: the fp32 copy of its input, 1/rms, the normalised input
    A   = 2 (norm(d) + e d)                     two norms, each output kept by the linear layers reading it
          + [q/k norms] (4 + e)(q + kv) + 4 (Hq + Hkv)
          + e (2q + 2kv) + 4 Hq                 attention's q, k, v, output and log-sum-exp
          + m e f                               MLP
    A_k = norm(d) + e d + [k norm] (4 + e) kv + 4 Hkv + 2 e kv
                                                the last prefix layer: only what leads to its K/V survives Phase A
    C   = e d                                   a checkpointed layer's input
    S   = C + e (q + 2kv + 2d + (m/2) f)        selective: the input and every matrix multiply's output
    KV  = 2 e kv                                the cached prefix K/V (K after RoPE; V is the projection's output)
    G   = 2 e_g kv                              gK/gV
    X   = (m/2) e f + (8 + 2e) d                a layer backward's gradients beyond its saved tensors
    F   = norm(d) + e d                         the final norm, once per token (outside the layers)

Policies: `none` keeps A per layer; `full` (TRL's default, non-reentrant) keeps C and recomputes one layer at a time
(transient A + X); `selective` keeps S and recomputes the rest (transient A + X). With T_pol = X for `none`, A + X
otherwise, and R_pol = A, C or S:

    static    = weights + gradients of the trainable parameters + optimizer state
    baseline  = static + r (P + S) (L R_pol + F) + max(loss(r S), r (P + S) T_pol)         r rows per microbatch
    Phase B   = static + P' (prefix + L G) + w S (L R_suf + F) + max(loss(w S), w S T_suf + P' 2 e kv)
    Phase A   = static + P' (L A + F)                       no checkpointing, no offload, no prefix recompute
              = static + P' (prefix + A)                    otherwise (one layer's forward in flight)
    Phase C   = static + P' (prefix + L G) + P' (A + X)     prefix layers recomputed (checkpointed or offloaded)
              = static + P' (prefix + L G) + P' X           otherwise; offload adds 2 layers prefetched, P' H

P' = P - 1 cached prompt tokens (the last one opens each wave), w completions per wave, R_suf / T_suf the suffix's
policy (`suffix_checkpointing=False` keeps A), and the prompt's resident bytes per token `prefix`:

    none, no offload            (L - 1) A + A_k         k = round(share L) layers recomputed: k (C + KV) + (L - k) A
    full, no offload            L (C + KV)
    selective, no offload       L (S + e kv)            K after RoPE on top of the matrix multiplies' outputs
    none or full, offload       L KV                    the rest waits on the host: H = C + e q + 4 Hq per layer
    selective, offload          L (S - C + e kv)        torch keeps selective saves itself: only C leaves

With `offload_kv` the K/V and gK/gV wait on the host too: `prefix` drops its L KV and L G becomes the two layers in
flight (a layer's K/V read while the next one's arrive; a layer's sum taking the wave's gradient while the next
one's arrives): 2 KV and 2 G in Phase B, 2 G in Phase C, and the host holds L (KV + G) more per prompt token (and,
without checkpointing, the K/V of the prompt layers not recomputed once more, saved by their attention). Waves that
keep their activations keep each layer's K/V they read: L KV in Phase B again.

Dense decoders are modelled tensor by tensor; MoE routing buffers, LoRA adapters' small activations, autocast
copies and allocator fragmentation are not (keep a margin).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..config import PrefixFlowConfig
from ..errors import PrefixFlowError
from ..core.offload import PREFETCH_LAYERS

POLICIES = ("none", "full", "selective")
LOSS_BYTES_PER_LOGIT = 12.0  # fp32 log-softmax output, the loss's gradient and log-softmax's, at its backward
SCORINGS = ("fused", "logits")
HEAD_TILE_TOKENS, HEAD_TILE_VOCAB = 4096, 32768  # TRL's fused head: its tile, tokens by vocabulary entries
MAX_WAVE = 4  # completions per wave past which Phase B ran no faster on an H200 (docs/benchmarks.md)


@dataclasses.dataclass(frozen=True)
class TokenBytes:
    """The byte model's terms for one architecture, in bytes per token (per layer unless noted)."""

    layers: int
    activations: float  # A: a layer's saved tensors without checkpointing
    last_layer_kv: float  # A_k: what the last prefix layer keeps after Phase A (its K/V path)
    layer_input: float  # C: a checkpointed layer's input
    selective: float  # S: the input plus the matrix multiplies' outputs
    kv: float  # KV: prefix K and V
    kv_grad: float  # G: gK and gV
    key: float  # e kv: K after RoPE alone (selective keeps V as the projection's output)
    backward: float  # X: gradients a layer's backward holds beyond its saved tensors
    final_norm: float  # F: per token, once
    logits: float  # l V: per scored position, once (scoring "logits")
    host: float  # H: per offloaded prefix layer (input, attention output and log-sum-exp)
    head: float = 0.0  # the fused head's weight-gradient accumulator and its cast, once (scoring "fused")
    head_token: float = 0.0  # the fused head's hidden-state gradient and cast, per scored position
    head_tile: float = 0.0  # a row of the fused head's tile, per scored position up to HEAD_TILE_TOKENS

    def loss(self, scored: int) -> float:
        """The loss's device bytes at its backward for `scored` positions (module docstring)."""
        if scored <= 0:
            return 0.0
        return (self.logits * scored + self.head + self.head_token * scored
                + self.head_tile * min(scored, HEAD_TILE_TOKENS))

    def resident(self, policy: str) -> float:
        """R_pol: bytes per token and layer a policy keeps until the backward."""
        return {"none": self.activations, "full": self.layer_input, "selective": self.selective}[policy]

    def transient(self, policy: str) -> float:
        """T_pol: bytes per token a layer's backward adds (its recompute included)."""
        return self.backward if policy == "none" else self.activations + self.backward


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What `plan` estimates for one group and the knobs it picked. Every peak counts the static state (weights,
    gradients, optimizer state), as inside an accumulation window.

    Args:
        fits: every phase's peak is at most `device_memory` (and the host pool at most `host_memory`, if given).
        phase_b_peak_bytes: device bytes at the peak of Phase B (the suffix waves), static state included.
        phase_a_peak_bytes, phase_c_peak_bytes: the same for the prompt's forward and its delayed backward.
        baseline_peak_bytes: full-sequence training of the same group, `rows_per_microbatch` rows at a time, under
            the same checkpointing policy.
        baseline_fits: `baseline_peak_bytes <= device_memory`.
        wave_size, offload, offload_kv, suffix_checkpointing, prefix_recompute: the knobs (`config()` builds them);
            `prefix_recompute` None means the library's default for `offload`.
        extra_recompute: recompute beyond the checkpointing policy ("none" or the prefix layers' share).
        host_bytes: page-locked host memory the offloaded prompt activations take (a new buffer is the size asked,
            in whole pages; one reused from an earlier group may be up to twice it).
        checkpointing: the policy both sides use.
        breakdown: Phase B's terms in bytes (static, prefix, kv_grad, wave, peak_transient).
    """

    fits: bool
    phase_b_peak_bytes: int
    phase_a_peak_bytes: int
    phase_c_peak_bytes: int
    baseline_peak_bytes: int
    baseline_fits: bool
    wave_size: int
    offload: bool
    offload_kv: bool
    suffix_checkpointing: bool
    prefix_recompute: float | None
    extra_recompute: str
    host_bytes: int
    checkpointing: str
    breakdown: dict[str, int]

    @property
    def peak_bytes(self) -> int:
        """The highest of the three phases' peaks."""
        return max(self.phase_a_peak_bytes, self.phase_b_peak_bytes, self.phase_c_peak_bytes)

    def config(self) -> PrefixFlowConfig:
        """The knobs as a `PrefixFlowConfig` (the wave size goes to the waves: `prefixflow_wave_size`)."""
        return PrefixFlowConfig(offload=self.offload, offload_kv=self.offload_kv,
                                prefix_recompute=self.prefix_recompute, suffix_checkpointing=self.suffix_checkpointing)


@dataclasses.dataclass(frozen=True)
class _Model:
    """A model's byte model and its static bytes."""

    tokens: TokenBytes
    static: float  # weights + gradients + optimizer state


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / engine / PEFT wrappers (whose parameters count as the model's)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module) and not hasattr(model, "config"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _structure(model: torch.nn.Module) -> tuple[bool, bool]:
    """(per-head q/k norms, gated MLP) of the first decoder layer with attention (hybrid stacks interleave
    recurrent layers, which the byte model counts as attention layers of the same width)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and any(_attention_of(layer) for layer in module):
            layer = next(layer for layer in module if _attention_of(layer))
            break
    else:
        raise PrefixFlowError(f"{type(model).__name__} has no decoder layers with attention: plan() models "
                              "decoders.")
    attention, mlp = _attention_of(layer), getattr(layer, "mlp", None)
    qk_norm = hasattr(attention, "q_norm") and hasattr(attention, "k_norm")
    gated = mlp is not None and any(hasattr(m, name) for m in mlp.modules()
                                    for name in ("gate_proj", "gate_up_proj", "w1"))
    return qk_norm, gated


def _attention_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's attention module (`self_attn`, or NemotronH's `mixer`), if it has one."""
    return next((m for m in (getattr(layer, "self_attn", None), getattr(layer, "mixer", None))
                 if m is not None and any(hasattr(m, p) for p in ("k_proj", "qkv_proj", "kv_a_proj_with_mqa"))),
                None)


@functools.lru_cache(maxsize=16)
def _config_facts(config_class: type, text: str) -> tuple[int, bool, bool]:
    """(parameter count, q/k norms, gated MLP) of the model a config builds, on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_class.from_dict(json.loads(text)))
    return sum(p.numel() for p in model.parameters()), *_structure(model)


def _facts(config: PretrainedConfig) -> tuple[int, bool, bool]:
    return _config_facts(type(config), config.to_json_string(use_diff=False))


def _dtype_of(model: torch.nn.Module | None, config: PretrainedConfig) -> torch.dtype:
    """The dtype most floating-point weights have, else the config's `dtype`, else bfloat16."""
    if model is not None:
        counts: dict[torch.dtype, int] = {}
        for p in model.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        if counts:
            return max(counts, key=counts.get)
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.bfloat16


def _trainable_dtype(model: torch.nn.Module, fallback: torch.dtype) -> torch.dtype:
    """The library's default gK/gV dtype: the widest dtype of the trainable parameters (`model.kv_grad_dtype`)."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    return functools.reduce(torch.promote_types, dtypes) if dtypes else fallback


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def token_bytes(model_or_config: torch.nn.Module | PretrainedConfig, dtype: torch.dtype | None = None,
                kv_grad_dtype: torch.dtype | None = None,
                loss_bytes_per_logit: float = LOSS_BYTES_PER_LOGIT, scoring: str = "fused") -> TokenBytes:
    """The byte model's terms (module docstring) for a model or a config.

    Args:
        model_or_config: a transformers causal LM (possibly PEFT-wrapped) or its `PretrainedConfig`.
        dtype: the activations' dtype; default: that of most floating-point weights, or the config's `dtype`, or
            bfloat16 when the config names none.
        kv_grad_dtype: gK/gV's dtype; default the library's: the trainable parameters' widest dtype (a config:
            `dtype`).
        loss_bytes_per_logit: with `scoring="logits"`, device bytes the loss holds per logit at its peak (12: fp32
            log-softmax).
        scoring: "fused" (TRL's fused LM head: GRPOTrainer's and PrefixFlowGRPOTrainer's from TRL 1.15 on) or
            "logits" (the model's logits and a log-softmax).
    Returns:
        TokenBytes, bytes per token.
    """
    wrapper = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    model = _inner(wrapper) if wrapper is not None else None
    config = _text_config(model.config if model is not None else model_or_config)
    dtype = dtype or _dtype_of(model, config)
    if wrapper is not None:
        qk_norm, gated = _structure(model)
        kv_grad_dtype = kv_grad_dtype or _trainable_dtype(wrapper, dtype)
    else:
        _, qk_norm, gated = _facts(model_or_config)
    e, e_g = _size(dtype), _size(kv_grad_dtype or dtype)
    d = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = getattr(config, "num_experts_per_tok", None)
    width = (experts * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size) if experts
             else config.intermediate_size)
    half = 2 if gated else 1  # matrix-multiply outputs of the MLP's first half: gate and up, or up
    products = 2 * half

    def norm(w: int) -> float:
        return 4 * w + 4 + e * w

    head_norms = ((4 + e) * (q + kv) + 4 * (heads + kv_heads)) if qk_norm else 0
    activations = 2 * (norm(d) + e * d) + head_norms + e * (2 * q + 2 * kv) + 4 * heads + products * e * width
    key_norm = ((4 + e) * kv + 4 * kv_heads) if qk_norm else 0
    layer_input = e * d
    return TokenBytes(
        layers=config.num_hidden_layers, activations=activations,
        last_layer_kv=norm(d) + e * d + key_norm + 2 * e * kv, layer_input=layer_input,
        selective=layer_input + e * (q + 2 * kv + 2 * d + half * width), kv=2 * e * kv, kv_grad=2 * e_g * kv,
        key=e * kv, backward=half * e * width + (8 + 2 * e) * d, final_norm=norm(d) + e * d,
        host=layer_input + e * q + 4 * heads, **_loss_terms(scoring, config, e, loss_bytes_per_logit))


def _loss_terms(scoring: str, config: PretrainedConfig, e: int, loss_bytes_per_logit: float) -> dict[str, float]:
    if scoring not in SCORINGS:
        raise PrefixFlowError(f"scoring is one of {SCORINGS}, got {scoring!r}.")
    d, vocab = config.hidden_size, config.vocab_size
    if scoring == "logits":
        return {"logits": loss_bytes_per_logit * vocab}
    return {"logits": 0.0, "head": vocab * d * (4 + e), "head_token": d * (4 + e), "head_tile": e * HEAD_TILE_VOCAB}


def static_bytes(model_or_config: torch.nn.Module | PretrainedConfig, dtype: torch.dtype | None = None,
                 trainable_parameters: int | None = None, optimizer_state_bytes: float = 0.0) -> float:
    """Weights in their dtypes, gradients of the trainable ones in theirs, and `optimizer_state_bytes` per
    trainable parameter. A config's model has every weight in `dtype` (default as in `token_bytes`) and, unless
    `trainable_parameters` says otherwise, every one trainable."""
    if isinstance(model_or_config, torch.nn.Module):
        params = list(model_or_config.parameters())
        weights = sum(p.numel() * p.element_size() for p in params)
        trainable = [p for p in params if p.requires_grad]
        if trainable_parameters is None:
            count, grads = sum(p.numel() for p in trainable), sum(p.numel() * p.element_size() for p in trainable)
        else:
            size = _size(dtype or _dtype_of(_inner(model_or_config), _text_config(_inner(model_or_config).config)))
            count, grads = trainable_parameters, trainable_parameters * size
    else:
        size = _size(dtype or _dtype_of(None, _text_config(model_or_config)))
        total = _facts(model_or_config)[0]
        count = total if trainable_parameters is None else trainable_parameters
        weights, grads = total * size, count * size
    return weights + grads + count * optimizer_state_bytes


def _check(checkpointing: str, prompt_tokens: int, completion_tokens: int, num_generations: int,
           device_memory: float, rows: int) -> None:
    if checkpointing not in POLICIES:
        raise PrefixFlowError(f"checkpointing is one of {POLICIES}, got {checkpointing!r}.")
    for name, value in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens),
                        ("num_generations", num_generations), ("rows_per_microbatch", rows)):
        if not isinstance(value, int) or value < 1:
            raise PrefixFlowError(f"{name} must be a positive integer, got {value!r}.")
    if not device_memory > 0:
        raise PrefixFlowError(f"device_memory is a number of bytes above 0, got {device_memory!r}.")


def baseline_peak(tokens: TokenBytes, static: float, prompt_tokens: int, completion_tokens: int, rows: int,
                  checkpointing: str) -> float:
    """Full-sequence training's peak bytes: `rows` sequences of P + S tokens per microbatch (module docstring)."""
    n = rows * (prompt_tokens + completion_tokens)
    resident = n * (tokens.layers * tokens.resident(checkpointing) + tokens.final_norm)
    return static + resident + max(tokens.loss(rows * completion_tokens), n * tokens.transient(checkpointing))


def prefix_resident(tokens: TokenBytes, checkpointing: str, offload: bool, share: float,
                    offload_kv: bool = False) -> float:
    """`prefix`: device bytes per cached prompt token between Phase A and Phase C, gK/gV aside."""
    layers = tokens.layers
    if checkpointing == "selective":
        kept = tokens.selective - tokens.layer_input if offload else tokens.selective
        return layers * kept + (2 * tokens.kv if offload_kv else layers * tokens.key)
    if offload_kv:
        return 2 * tokens.kv
    if offload:
        return layers * tokens.kv
    if checkpointing == "full":
        return layers * (tokens.layer_input + tokens.kv)
    recomputed = round(share * layers)
    if recomputed == 0:
        return (layers - 1) * tokens.activations + tokens.last_layer_kv
    return recomputed * (tokens.layer_input + tokens.kv) + (layers - recomputed) * tokens.activations


def host_bytes(tokens: TokenBytes, checkpointing: str, share: float, prompt_tokens: int,
               offload_kv: bool = False) -> float:
    """Host bytes the offloaded prompt activations (and with `offload_kv` the K/V and gK/gV) take."""
    cached = prompt_tokens - 1
    streamed = cached * tokens.layers * (tokens.kv + tokens.kv_grad) if offload_kv else 0.0
    if checkpointing != "none":
        return streamed + cached * tokens.layers * tokens.host
    recomputed = round(share * tokens.layers)
    # the layers not recomputed save all they keep, their K/V too when it also waits on the host as streamed
    kept_elsewhere = (tokens.layers - recomputed) * (tokens.activations - (0 if offload_kv else tokens.kv))
    return streamed + cached * (recomputed * tokens.host + kept_elsewhere)


def prefixflow_peaks(tokens: TokenBytes, static: float, prompt_tokens: int, completion_tokens: int, wave: int,
                     checkpointing: str, offload: bool, share: float, suffix_checkpointing: bool,
                     offload_kv: bool = False) -> tuple[float, float, float, dict[str, int]]:
    """Phase A, B and C peak bytes of one group and Phase B's terms (module docstring)."""
    cached = prompt_tokens - 1
    layers = tokens.layers
    suffix_policy = checkpointing if suffix_checkpointing else "none"
    prefix = cached * prefix_resident(tokens, checkpointing, offload, share, offload_kv)
    # a wave keeping its activations keeps each layer's K/V it read, until its backward: Phase B only
    waves_kv = cached * (layers - 2) * tokens.kv if offload_kv and suffix_policy == "none" else 0.0
    kv_grad = cached * (2 if offload_kv else layers) * tokens.kv_grad
    n = wave * completion_tokens
    wave_bytes = n * (layers * tokens.resident(suffix_policy) + tokens.final_norm)
    transient = max(tokens.loss(n), n * tokens.transient(suffix_policy) + cached * tokens.kv)
    phase_b = static + prefix + waves_kv + kv_grad + wave_bytes + transient
    recomputes = checkpointing != "none" or offload or round(share * layers) > 0
    if recomputes:
        phase_a = static + prefix + cached * tokens.activations
    else:
        phase_a = static + cached * (layers * tokens.activations + tokens.final_norm)
    phase_c = static + prefix + kv_grad + cached * (tokens.activations + tokens.backward if recomputes
                                                    else tokens.backward)
    if offload:
        phase_c += cached * PREFETCH_LAYERS * tokens.host
    breakdown = {"static": round(static), "prefix": round(prefix + waves_kv), "kv_grad": round(kv_grad),
                 "wave": round(wave_bytes), "peak_transient": round(transient)}
    return phase_a, phase_b, phase_c, breakdown


def keeps_suffix_activations(tokens: TokenBytes, prompts: list[int], completion_tokens: int, rows: list[int],
                             baseline_rows: int, checkpointing: str = "full", offload: bool = False,
                             share: float = 0.0) -> bool:
    """Whether a run of suffix waves may keep its activations (no checkpointing) within the device memory that
    full-sequence training under the same `checkpointing` policy needs for one microbatch of `baseline_rows` rows of
    the longest prompt (the static state is the same on both sides and left out).

    Args:
        tokens: the model's byte model (`token_bytes`).
        prompts: each group's prompt tokens P.
        completion_tokens: the run's completion width S.
        rows: each group's completions in the run (all of them backpropagate together, so their activations
            coexist; one group's loss transient at a time).
        baseline_rows: the full-sequence microbatch's rows (TRL's `per_device_train_batch_size`).
        checkpointing, offload, share: the policy of both sides and PrefixFlow's prefix knobs.
    """
    budget = baseline_peak(tokens, 0.0, max(prompts), completion_tokens, baseline_rows, checkpointing)
    held, transient = 0.0, 0.0
    for prompt, count in zip(prompts, rows):
        parts = prefixflow_peaks(tokens, 0.0, prompt, completion_tokens, count, checkpointing, offload, share,
                                 suffix_checkpointing=False)[3]
        held += parts["prefix"] + parts["kv_grad"] + parts["wave"]
        transient = max(transient, parts["peak_transient"])
    return held + transient <= budget


OFFLOAD_MODES = ((False, False), (True, False), (True, True))  # (offload, offload_kv), cheapest first


def run_need(tokens: TokenBytes, prompts: list[int], completion_tokens: int, rows: list[int],
             checkpointing: str = "full", offload: bool = False, offload_kv: bool = False,
             prefix_recompute: float | None = None, suffix_checkpointing: bool = True) -> float:
    """Device bytes a run of groups adds on top of what is allocated: the groups' prompt state and their waves'
    activations (checkpointed layer inputs, or all of them where the waves keep them) coexist, for the run's waves
    backpropagate together; one group's phase transient at a time; each group's completions in one wave.

    Args:
        tokens: the model's byte model (`token_bytes`).
        prompts: each group's prompt tokens P.
        completion_tokens: the run's completion width S.
        rows: each group's completions in the run.
        checkpointing: the policy of both sides.
        offload, offload_kv: PrefixFlow's offload mode.
        prefix_recompute: the user's `prefix_recompute` (None: the library's default per mode).
        suffix_checkpointing: whether the waves recompute their activations in the backward.
    """
    share = PrefixFlowConfig(offload=offload, prefix_recompute=prefix_recompute).recompute_share
    held = transient = 0.0
    for prompt, count in zip(prompts, rows):
        *phases, parts = prefixflow_peaks(tokens, 0.0, prompt, completion_tokens, count, checkpointing, offload,
                                          share, suffix_checkpointing, offload_kv)
        group = parts["prefix"] + parts["kv_grad"] + parts["wave"]
        held, transient = held + group, max(transient, max(phases) - group)
    return held + transient


def run_host_need(tokens: TokenBytes, prompts: list[int], checkpointing: str = "full", offload_kv: bool = False,
                  prefix_recompute: float | None = None) -> float:
    """Host bytes an offloading run of groups holds in the pool (`host_bytes` of every prompt: the groups' Phase C
    come after all their waves).

    Args:
        tokens, prompts, checkpointing, prefix_recompute: as `run_need` takes them.
        offload_kv: whether the prompts' K/V and gK/gV wait on the host too.
    """
    share = PrefixFlowConfig(offload=True, prefix_recompute=prefix_recompute).recompute_share
    return sum(host_bytes(tokens, checkpointing, share, prompt, offload_kv) for prompt in prompts)


def offload_for(tokens: TokenBytes, prompts: list[int], completion_tokens: int, rows: list[int], budget: float,
                checkpointing: str = "full", prefix_recompute: float | None = None,
                allow_kv: bool = True, host_budget: float | None = None) -> tuple[bool, bool]:
    """The cheapest offload mode under which a run of groups, its waves recomputed under checkpointing, fits in
    `budget` device bytes on top of what is allocated (`run_need`) and its host pool in `host_budget`
    (`run_host_need`); the trainer's `prefixflow_offload_auto`.

    Args:
        tokens, prompts, completion_tokens, rows, checkpointing, prefix_recompute: as `run_need` takes them.
        budget: device bytes the run may add.
        allow_kv: whether `offload_kv` may be picked (not where a parallel rule moves K/V).
        host_budget: host bytes the pool may hold (None: unbounded). A mode whose pool exceeds it is never picked.

    Returns:
        `(offload, offload_kv)`: the first of no offload, offload, offload_kv that fits; the one needing least
        device memory when none does.
    """
    needs = []
    for offload, kv in OFFLOAD_MODES:
        if kv and not allow_kv:
            continue
        if offload and host_budget is not None and run_host_need(
                tokens, prompts, checkpointing, kv, prefix_recompute) > host_budget:
            continue
        need = run_need(tokens, prompts, completion_tokens, rows, checkpointing, offload, kv, prefix_recompute)
        if need <= budget:
            return offload, kv
        needs.append((need, (offload, kv)))
    return min(needs)[1]


def _prepare(model_or_config, dtype, kv_grad_dtype, loss_bytes_per_logit, trainable_parameters,
             optimizer_state_bytes, scoring) -> _Model:
    return _Model(token_bytes(model_or_config, dtype, kv_grad_dtype, loss_bytes_per_logit, scoring),
                  static_bytes(model_or_config, dtype, trainable_parameters, optimizer_state_bytes))


def plan(model_or_config: torch.nn.Module | PretrainedConfig, prompt_tokens: int, completion_tokens: int,
         num_generations: int, device_memory: float, checkpointing: str = "full", *, rows_per_microbatch: int = 1,
         max_wave: int = MAX_WAVE, wave_size: int | None = None, offload: bool | None = None,
         suffix_checkpointing: bool | None = None, prefix_recompute: float | None = None,
         host_memory: float | None = None, offload_kv: bool | None = None, dtype: torch.dtype | None = None,
         kv_grad_dtype: torch.dtype | None = None, trainable_parameters: int | None = None,
         optimizer_state_bytes: float = 0.0, loss_bytes_per_logit: float = LOSS_BYTES_PER_LOGIT,
         scoring: str = "fused") -> MemoryPlan:
    """Estimate one group's device memory both ways and pick PrefixFlow's knobs.

    Args:
        model_or_config: a transformers causal LM (possibly PEFT-wrapped: its trainable parameters count) or its
            config (every parameter trainable unless `trainable_parameters` says otherwise).
        prompt_tokens, completion_tokens: P and S, tokens (the longest completion of the group).
        num_generations: N, completions per prompt; a wave holds at most N.
        device_memory: bytes one device may use.
        checkpointing: the activation-checkpointing policy of both sides: "none", "full" (every decoder layer,
            non-reentrant: TRL's default) or "selective" (matrix multiplies' outputs kept).
        rows_per_microbatch: the baseline's full sequences per forward.
        max_wave: the widest wave worth running (completions; past about 4 Phase B gains no speed).
        wave_size, offload, suffix_checkpointing, prefix_recompute: force a knob instead of choosing it.
        host_memory: bytes of pinned host memory offload may use (None: unbounded).
        offload_kv: force streaming the prompt's K/V and gK/gV from the host (True) or rule it out (False).
        dtype, kv_grad_dtype: the activations' and gK/gV's dtypes (defaults: `token_bytes`).
        trainable_parameters: count of trainable parameters (LoRA); default all (a config) or `requires_grad`.
        optimizer_state_bytes: optimizer bytes per trainable parameter (torch's AdamW: 2 x the parameter's
            element size); 0 for a measurement without an optimizer step.
        loss_bytes_per_logit: with `scoring="logits"`, device bytes the loss holds per logit at its peak.
        scoring: how completion tokens are scored (`token_bytes`): "fused" (TRL's fused LM head) or "logits".
    Returns:
        MemoryPlan. Knobs: among the configurations that fit, the widest wave (up to `max_wave` and N) wins; at
        equal width no offload before offload (offload costs 2.5-5% of the group's time) before `offload_kv`
        (host-device traffic every wave), and suffix activations kept before checkpointed. With none fitting, the
        smallest peak (`fits` False).
    """
    _check(checkpointing, prompt_tokens, completion_tokens, num_generations, device_memory, rows_per_microbatch)
    model = _prepare(model_or_config, dtype, kv_grad_dtype, loss_bytes_per_logit, trainable_parameters,
                     optimizer_state_bytes, scoring)
    return _choose(model, prompt_tokens, completion_tokens, num_generations, device_memory, checkpointing,
                   rows_per_microbatch, max_wave, wave_size, offload, suffix_checkpointing, prefix_recompute,
                   host_memory, offload_kv)


def _choose(model: _Model, prompt_tokens: int, completion_tokens: int, num_generations: int, device_memory: float,
            checkpointing: str, rows: int, max_wave: int, wave_size: int | None, offload: bool | None,
            suffix_checkpointing: bool | None, prefix_recompute: float | None,
            host_memory: float | None, offload_kv: bool | None = None) -> MemoryPlan:
    for name, value in (("wave_size", wave_size), ("max_wave", max_wave)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise PrefixFlowError(f"{name} is a number of completions, at least 1; got {value!r}.")
    tokens, static = model.tokens, model.static
    baseline = baseline_peak(tokens, static, prompt_tokens, completion_tokens, rows, checkpointing)
    widest = max(1, min(num_generations, max_wave))
    waves = [wave_size] if wave_size is not None else list(range(widest, 0, -1))
    modes = [(False, False), (True, False), (True, True)]  # (offload, offload_kv), cheapest first
    modes = [(off, kv) for off, kv in modes if (offload is None or off == offload or kv)
             and (offload_kv is None or kv == offload_kv) and not (offload is False and kv)]
    keeps = ([suffix_checkpointing] if suffix_checkpointing is not None
             else [True] if checkpointing == "none" else [False, True])
    candidates = []
    for wave in waves:
        for off, kv in modes:
            share = PrefixFlowConfig(offload=off, prefix_recompute=prefix_recompute).recompute_share
            pool = host_bytes(tokens, checkpointing, share, prompt_tokens, kv) if off else 0.0
            # With offload_kv kept activations would hold every layer's K/V through the wave: the waves recompute.
            for keep in ([True] if kv and checkpointing != "none" else keeps):
                phases = prefixflow_peaks(tokens, static, prompt_tokens, completion_tokens, wave, checkpointing, off,
                                          share, keep, kv)
                fits = max(phases[:3]) <= device_memory and (host_memory is None or pool <= host_memory)
                candidates.append((fits, wave, off, kv, keep, share, pool, phases))
    fitting = [c for c in candidates if c[0]]
    fits, wave, off, kv, keep, share, pool, (phase_a, phase_b, phase_c, breakdown) = (
        fitting[0] if fitting else min(candidates, key=lambda c: max(c[7][:3])))
    extra = "none"
    if share > 0 and checkpointing == "none":
        extra = f"prefix layers (share {share:g})"
    return MemoryPlan(
        fits=fits, phase_b_peak_bytes=round(phase_b), phase_a_peak_bytes=round(phase_a),
        phase_c_peak_bytes=round(phase_c), baseline_peak_bytes=round(baseline), baseline_fits=baseline <= device_memory,
        wave_size=wave, offload=off, offload_kv=kv, suffix_checkpointing=keep, prefix_recompute=prefix_recompute,
        extra_recompute=extra, host_bytes=round(pool), checkpointing=checkpointing, breakdown=breakdown)


_PLAN_KNOBS = ("rows_per_microbatch", "max_wave", "wave_size", "offload", "suffix_checkpointing", "prefix_recompute",
               "host_memory", "offload_kv")
_MODEL_KNOBS = ("dtype", "kv_grad_dtype", "trainable_parameters", "optimizer_state_bytes", "loss_bytes_per_logit",
                "scoring")


def longest(model_or_config: torch.nn.Module | PretrainedConfig, prompt_tokens: int, completion_tokens: int,
            num_generations: int, device_memory: float, checkpointing: str = "full", *, vary: str = "both",
            side: str = "prefixflow", resolution: int = 1, maximum: int = 1 << 22, **knobs) -> int:
    """The capacity frontier the byte model predicts: the longest length that trains within `device_memory`.

    Args:
        prompt_tokens, completion_tokens: the shape to grow. `vary`: "both" keeps their proportions and returns the
            longest P + S, "prompt" keeps the completions and returns the longest P, "completion" the longest S.
        side: "prefixflow" (every phase fits, with the knobs `plan` picks or `knobs` force) or "baseline".
        resolution: the answer is a multiple of it (tokens); `maximum`: the longest length considered.
        knobs: `plan`'s keyword arguments (rows_per_microbatch, offload, wave_size, optimizer_state_bytes, ...).
    Returns:
        Tokens; 0 if not even `resolution` fits.
    """
    if vary not in ("both", "prompt", "completion") or side not in ("prefixflow", "baseline"):
        raise PrefixFlowError(f"vary is 'both', 'prompt' or 'completion' and side 'prefixflow' or 'baseline'; got "
                              f"{vary!r}, {side!r}.")
    unknown = set(knobs) - set(_PLAN_KNOBS) - set(_MODEL_KNOBS)
    if unknown:
        raise PrefixFlowError(f"longest() takes plan()'s keyword arguments; unknown: {sorted(unknown)}.")
    rows = knobs.get("rows_per_microbatch", 1)
    _check(checkpointing, prompt_tokens, completion_tokens, num_generations, device_memory, rows)
    model = _prepare(model_or_config, knobs.get("dtype"), knobs.get("kv_grad_dtype"),
                     knobs.get("loss_bytes_per_logit", LOSS_BYTES_PER_LOGIT), knobs.get("trainable_parameters"),
                     knobs.get("optimizer_state_bytes", 0.0), knobs.get("scoring", "fused"))
    ratio = prompt_tokens / (prompt_tokens + completion_tokens)

    def fits(length: int) -> bool:
        if vary == "prompt":
            prompt, completion = length, completion_tokens
        elif vary == "completion":
            prompt, completion = prompt_tokens, length
        else:
            prompt = max(1, round(length * ratio))
            completion = max(1, length - prompt)
        estimate = _choose(model, prompt, completion, num_generations, device_memory, checkpointing, rows,
                           knobs.get("max_wave", MAX_WAVE), *(knobs.get(k) for k in _PLAN_KNOBS[2:]))
        return estimate.baseline_fits if side == "baseline" else estimate.fits

    low, high = 0, resolution
    while high <= maximum and fits(high):
        low, high = high, high * 2
    high = min(high, maximum + resolution)
    while high - low > resolution:
        middle = low + (high - low) // (2 * resolution) * resolution
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
