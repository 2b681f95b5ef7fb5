"""Image-text prompts: the vision tower, the projector and the image tokens run once per group.

    with prefix_group(model, prompt_ids, pixel_values=..., image_grid_thw=..., mm_token_type_ids=...) as group:
        out = group(completion_ids, attention_mask=mask)   # text waves, as for a text prompt

Phase A runs the model's own multimodal forward (vision encoder, projector, the merge of image features into the
token embeddings, the decoder) over the whole prompt once, with the processor's tensors for that one prompt, and
caches its decoder K/V. The waves are text: they run the model without images at the positions the full sequence
gives them. Qwen2/2.5/3-VL's multimodal RoPE places text after an image at index + rope delta (the prompt's largest
position + 1 - its length) in all three axes, so a wave's positions are its sequence indices plus the prompt's delta.
Phase C's backward from the cached K/V runs through the merge into the projector and the vision tower: their
gradients equal full-sequence training, where each of the N rows runs the tower on the same images.

Phase A also runs the prompt's last token, which the waves re-read as their first input (as for text groups): a
prefix-LM mask (PaliGemma) or a bidirectional image block (Gemma3) is computed over the prompt as the full sequence
computes it, and the last token, which attends to exactly the whole prompt in both, is exact in the waves too. It
must be text: a wave embeds it as a token.

`apply_prefixflow` checks image prompts once per architecture: a tiny float64 copy trains one group with two images
both ways (`probe`). A family it has no sample for, or whose copy differs, keeps text prompts on PrefixFlow; its
image prompts are refused with the reason (`refusal`), and the trainer runs them on the plain path.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings

import torch
from transformers import PreTrainedModel

from .. import _compat as compat
from ..core import attention
from ..core.access import decoder_of, takes_images, unwrap
from ..core.attention import PASS_KWARG, PrefixPass
from ..core.kv_cache import TrainingKVCache
from ..core.scheduler import PROMPT_RUNNER, GroupRunner, PrefixGroup, prefix_group
from ..core.switch import enable
from ..errors import PrefixFlowError
from .probe import TOLERANCE, ProbeResult, bridge, reach
from .tiny import VOCAB, build_tiny, float64_throughout, recompute_in_float64

# Config attributes holding the placeholder ids the processor repeats once per image (or video) feature.
PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
PER_TOKEN = ("token_type_ids", "mm_token_type_ids")  # processor tensors with one entry per prompt token


@dataclasses.dataclass(frozen=True)
class Family:
    """An image-text family whose image prompts PrefixFlow has a probe for.

    `keys`: the processor tensors of one prompt that Phase A passes on. `layout`: how its pixels come, for the probe's
    sample: "grid" (Qwen: flattened patches and a `[t, h, w]` grid per image), "square" (`[images, 3, S, S]`) or
    "tiles" (Idefics3: `[1, images, 3, S, S]` with a pixel mask). `mrope`: multimodal RoPE (3-D positions).
    `prefix_lm`: `token_type_ids` 0 mark a prefix attended bidirectionally, 1 a causal suffix (PaliGemma); without
    them the whole sequence is bidirectional, so every prompt of such a model needs them, text prompts too.
    """

    keys: tuple[str, ...]
    layout: str
    mrope: bool = False
    prefix_lm: bool = False


_QWEN = Family(("pixel_values", "image_grid_thw", "mm_token_type_ids"), "grid", mrope=True)
FAMILIES = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "gemma3": Family(("pixel_values", "token_type_ids"), "square"),
    "paligemma": Family(("pixel_values", "token_type_ids"), "square", prefix_lm=True),
    "llava": Family(("pixel_values", "image_sizes"), "square"),
    "idefics3": Family(("pixel_values", "pixel_attention_mask"), "tiles"),
    "smolvlm": Family(("pixel_values", "pixel_attention_mask"), "tiles"),
}


def family_of(model: torch.nn.Module) -> Family | None:
    """The `Family` of `model`'s `config.model_type`, or None when PrefixFlow has no image probe for it."""
    return FAMILIES.get(unwrap(model).config.model_type)


def vision_base(model: torch.nn.Module) -> torch.nn.Module:
    """The module Phase A runs over an image prompt: the model without its LM head (vision tower, projector, merge,
    decoder), e.g. `Qwen2VLModel` inside `Qwen2VLForConditionalGeneration`."""
    inner = unwrap(model)
    base = inner.base_model
    return base if base is not inner and callable(getattr(base, "get_image_features", None)) else inner


def placeholder_ids(config) -> set[int]:
    """The token ids that stand for image or video features in a prompt."""
    return {v for name in PLACEHOLDERS if isinstance(v := getattr(config, name, None), int)}


def refusal(model: torch.nn.Module) -> str | None:
    """Why the image prompts of `model` cannot share their prefix exactly.

    Args:
        model: a transformers model or a wrapper of one.

    Returns:
        The reason as a sentence fragment, or None when they can (decided by `apply_prefixflow`; before it, a
        reason that says to call it).
    """
    inner = unwrap(model)
    if not takes_images(inner):
        return f"{type(inner).__name__} takes no images"
    return getattr(inner, "_prefixflow_image_refusal", "call hf_prefixflow.apply_prefixflow(model) first")


def check(model: PreTrainedModel) -> ProbeResult | None:
    """`apply_prefixflow`'s check of image prompts: probe the architecture once and store the refusal, warned.

    Args:
        model: the unwrapped transformers model.

    Returns:
        For a prefix-LM (PaliGemma), the probe's result, which stands in for the text probe (that feeds no token
        types); else None (also for a model without images).

    Raises:
        PrefixFlowError: a prefix-LM whose image probe fails (refused whole).
    """
    if not takes_images(model):
        return None
    reason, reached = probe(model)
    prefix_lm = family_of(model) is not None and family_of(model).prefix_lm
    if prefix_lm and reason is not None:
        raise PrefixFlowError(f"{type(model).__name__}: {reason}. Train this model with the plain trainer.")
    if reason is not None:
        warnings.warn(f"PrefixFlow trains text prompts of {type(model).__name__} but not its image prompts: {reason}",
                      stacklevel=3)
    model._prefixflow_image_refusal = reason
    setattr(model, PROMPT_RUNNER, MultimodalRunner)  # the scheduler's runner of image prompts
    model._prefixflow_prefix_lm = prefix_lm  # every group then needs token_type_ids (see `PrefixGroup`)
    return reached if prefix_lm else None


# ---- Phase A and the waves of an image prompt ------------------------------------------------------------------

class MultimodalRunner(GroupRunner):
    """Runs a group whose prompt holds images: Phase A through the multimodal forward over the whole prompt with
    the processor's tensors, the waves as text at the positions the full sequence gives them.

    Args:
        group: the group, its prefix ids checked.
        inputs: the processor's tensors for the one prompt (`pixel_values`, `image_grid_thw`, `token_type_ids` ...;
            per-token ones `[P]` or `[1, P]`), on the model's device.

    Attributes:
        prefix_positions: Phase A's positions, `[1, P]`, or `[3, 1, P]` under multimodal RoPE.
        rope_delta: `[1, 1]`, added to a wave's positions under multimodal RoPE, else None.

    Raises:
        PrefixFlowError: the model's image prompts are refused (`refusal`); a prefix-LM without `token_type_ids`;
            an input the family does not take (videos, other modalities); a prompt ending with a placeholder
            token; a non-tensor input, one on the wrong device, or a per-token one without one entry per token.
    """

    def __init__(self, group: PrefixGroup, inputs: dict[str, torch.Tensor]):
        reason = refusal(group.model)
        if reason is not None:
            raise PrefixFlowError(f"image prompts cannot share their prefix here: {reason}")
        family = family_of(group.model)
        if family.prefix_lm and "token_type_ids" not in inputs:
            raise PrefixFlowError(
                f"{type(group.hf_model).__name__} attends bidirectionally over every token not marked as a completion "
                "(token_type_ids 1), so each prompt needs its token_type_ids (0 for each prompt token), text ones too."
            )
        unknown = set(inputs) - set(family.keys)
        if unknown:
            raise PrefixFlowError(
                f"prefix inputs {sorted(unknown)} are not taken for {type(group.hf_model).__name__}'s image prompts "
                f"(checked: {', '.join(family.keys)}); videos and other modalities train on the plain path."
            )
        ids = group.prefix_ids
        if int(ids[0, -1]) in placeholder_ids(group.hf_model.config):
            raise PrefixFlowError(
                "the prompt ends with an image placeholder token; each wave re-reads the prompt's last token as a "
                "text token, so the prompt must end with text (chat templates end with the assistant header)."
            )
        self.inputs = {}
        for name, tensor in inputs.items():
            if not isinstance(tensor, torch.Tensor):
                raise PrefixFlowError(f"prefix input {name} must be a tensor, got {type(tensor).__name__}.")
            group._check_device(tensor, name)
            if name in PER_TOKEN:
                if tensor.numel() != ids.shape[1]:
                    raise PrefixFlowError(f"{name} must have one entry per prompt token ({ids.shape[1]}), got "
                                          f"shape {tuple(tensor.shape)}.")
                tensor = tensor.reshape(1, -1)
            self.inputs[name] = tensor
        positions = group.position_offset + torch.arange(ids.shape[1], device=ids.device)[None]
        self.rope_delta = None
        if family.mrope:
            rope, delta = _rope_index(vision_base(group.model), ids, self.inputs)
            positions, self.rope_delta = rope + group.position_offset, delta.reshape(1, 1).to(ids.device)
        self.prefix_positions = positions  # [1, P], or [3, 1, P] with multimodal RoPE

    def forward(self, group: PrefixGroup, module: torch.nn.Module, input_ids: torch.Tensor,
                position_ids: torch.Tensor, **kwargs):
        """Phase A: the whole prompt `group.prefix_ids [1, P]` with its images through the multimodal base (or
        the FSDP2 root given), `input_ids` / `position_ids` ignored, each layer's K/V cached without the last
        token's. A wave: `input_ids [B, S]` at `position_ids [B, S]`, mapped to `[3, B, S]` (plus the prompt's
        rope delta) under multimodal RoPE.

        Returns:
            `module`'s output, as `GroupRunner.forward`.
        """
        marker = kwargs.get(PASS_KWARG)
        if isinstance(marker, PrefixPass):
            if module is decoder_of(group.model):
                module = vision_base(group.model)
            kwargs[PASS_KWARG] = dataclasses.replace(marker, cache=_FirstTokens(marker.cache))
            return module(input_ids=group.prefix_ids, position_ids=self.prefix_positions, use_cache=False,
                          **self.inputs, **kwargs)
        if self.rope_delta is not None:
            position_ids = (position_ids + self.rope_delta)[None].expand(3, -1, -1)
        return super().forward(group, module, input_ids, position_ids, **kwargs)


class _FirstTokens:
    """The group's cache as Phase A over the whole prompt captures into it: each layer's K/V without the last
    token's, which the waves compute as their first input."""

    def __init__(self, cache: TrainingKVCache):
        self.cache = cache

    def capture(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache.capture(layer_idx, key[:, :, :-1], value[:, :, :-1])

    def __getattr__(self, name: str):
        return getattr(self.cache, name)


def _rope_index(base: torch.nn.Module, ids: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own multimodal RoPE positions `[3, 1, P]` of the prompt and its delta `[1, 1]`."""
    accepted = inspect.signature(base.get_rope_index).parameters
    kwargs = {name: value for name, value in inputs.items() if name in accepted and name != "pixel_values"}
    if "mm_token_type_ids" in accepted and "mm_token_type_ids" not in kwargs:  # derived as the processor does
        config = base.config
        types = torch.zeros_like(ids)
        types[ids == getattr(config, "image_token_id", -1)] = 1
        types[ids == getattr(config, "video_token_id", -1)] = 2
        kwargs["mm_token_type_ids"] = types
    return base.get_rope_index(ids, **kwargs)


# ---- tiny samples: the probe's and the tests' ------------------------------------------------------------------

IMAGE_ID = VOCAB - 3  # placeholder ids of a tiny copy, inside its vocabulary, above its text ids
VIDEO_ID = VOCAB - 4
TEXT_IDS = (3, VIDEO_ID)  # random text draws from [3, VIDEO_ID)


def fit_images(config) -> None:
    """Shrink the image geometry of a (to be tiny) `config` in place: a few patches and tokens per image, and its
    placeholder ids inside the tiny vocabulary (`tiny.tiny_config` keeps them above it).

    Args:
        config: a config of a `FAMILIES` model type; modified in place.
    """
    family = FAMILIES[config.model_type]
    for name in PLACEHOLDERS:
        if name in vars(config) or name in getattr(config, "attribute_map", {}):
            setattr(config, name, VIDEO_ID if name.startswith("video") else IMAGE_ID)
    vision = config.vision_config
    if family.layout == "grid":
        if getattr(vision, "deepstack_visual_indexes", None):
            # Qwen3-VL adds these vision layers' features to the image tokens after as many first decoder layers:
            # one, so that the tiny decoder's last layer does not get one (only prompt outputs would read it)
            vision.deepstack_visual_indexes = [0]
        return
    patch = vision.patch_size
    if config.model_type == "gemma3":
        vision.image_size, config.mm_tokens_per_image = 4 * patch, 4
    elif config.model_type == "paligemma":
        vision.image_size, config.text_config.num_image_tokens = 2 * patch, 4
    elif config.model_type == "llava":
        vision.image_size = 2 * patch
        config.image_seq_length = 4 + (config.vision_feature_select_strategy == "full")
    else:  # tiles: pixel shuffle by `scale_factor` per side
        vision.image_size = 2 * config.scale_factor * patch


def image_tokens(config, index: int) -> int:
    """Placeholder tokens of the sample's image `index` under a `fit_images` config."""
    layout = FAMILIES[config.model_type].layout
    if layout == "grid":
        return 2 * (index + 2)  # grid [1, 4, 2(index+2)] merged 2x2: its positions span fewer than its tokens
    if config.model_type == "llava":
        return config.image_seq_length
    return 4


def sample_prompt(model: torch.nn.Module, gen: torch.Generator, images: int, text: int = 3
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random prompt for a tiny model of a `fit_images` config: text, then per image its placeholder tokens and
    more text (so the prompt ends with text).

    Args:
        model: the tiny model.
        gen: the CPU generator to draw from.
        images: how many images.
        text: text tokens before the first image and after each.

    Returns:
        `(ids [P] int64, processor tensors)` on the CPU, the pixels in the model's floating dtype; per-token ones
        `[P]`.
    """
    inner = unwrap(model)
    config, family = inner.config, family_of(inner)
    dtype = next(p.dtype for p in inner.parameters() if p.is_floating_point())
    pieces, kinds = [torch.randint(*TEXT_IDS, (text,), generator=gen)], [torch.zeros(text, dtype=torch.long)]
    for index in range(images):
        count = image_tokens(config, index)
        pieces += [torch.full((count,), IMAGE_ID), torch.randint(*TEXT_IDS, (text,), generator=gen)]
        kinds += [torch.ones(count, dtype=torch.long), torch.zeros(text, dtype=torch.long)]
    ids, kinds = torch.cat(pieces), torch.cat(kinds)
    types = {}
    if family.mrope:
        types["mm_token_type_ids"] = kinds
    elif "token_type_ids" in family.keys:  # PaliGemma's: 0 throughout, the whole prompt is its prefix
        types["token_type_ids"] = torch.zeros_like(kinds) if family.prefix_lm else kinds
    if not images:
        return ids, types
    vision = config.vision_config
    if family.layout == "grid":
        grid = torch.tensor([[1, 4, 2 * (i + 2)] for i in range(images)])
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=gen, dtype=dtype)
        return ids, {"pixel_values": pixels, "image_grid_thw": grid, **types}
    size = vision.image_size
    pixels = torch.randn(images, 3, size, size, generator=gen, dtype=dtype)
    if family.layout == "tiles":
        mask = torch.ones(1, images, size, size, dtype=torch.bool)
        return ids, {"pixel_values": pixels[None], "pixel_attention_mask": mask}
    return ids, {"pixel_values": pixels, **types}


def full_inputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], rows: int, width: int
                ) -> dict[str, torch.Tensor]:
    """One prompt's processor tensors for `rows` full sequences `[P || S]` of `width` tokens (the batch a plain
    trainer runs): images repeated per row, per-token types extended over the completion.

    Args:
        model: the model (its family decides the layout).
        inputs: the prompt's processor tensors, per-token ones `[P]` or `[1, P]`.
        rows: full sequences in the batch.
        width: tokens per full sequence, `>= P`.

    Returns:
        The batch's tensors; per-token ones `[rows, width]`.
    """
    family = family_of(model)
    out = {}
    for name, tensor in inputs.items():
        if name in PER_TOKEN:
            tensor = tensor.reshape(1, -1)
            fill = int(family.prefix_lm and name == "token_type_ids")
            tail = torch.full((1, width - tensor.shape[1]), fill, dtype=tensor.dtype, device=tensor.device)
            out[name] = torch.cat([tensor, tail], dim=1).expand(rows, -1)
        elif family.layout == "tiles":
            out[name] = tensor.expand(rows, *tensor.shape[1:])
        else:
            out[name] = torch.cat([tensor] * rows)
    return out


# ---- the probe -------------------------------------------------------------------------------------------------

_probed: dict[tuple, tuple[str | None, ProbeResult | None]] = {}


def probe(model: PreTrainedModel) -> tuple[str | None, ProbeResult | None]:
    """Train one group with two images on a tiny float64 copy of `model`'s architecture both ways (activation
    checkpointing on). Cached per model class, attention and config.

    Args:
        model: the unwrapped transformers model.

    Returns:
        `(reason, reach)`: why the two ways differ, or None if loss and every gradient (vision tower and projector
        included) agree; and which layers need the kwargs bridge (None when no tiny copy was built).
    """
    owner, config = type(model).__name__, model.config
    if config.model_type not in FAMILIES:
        return (f"PrefixFlow has no image probe for the {config.model_type!r} family of {owner} (it has one for "
                f"{', '.join(sorted(FAMILIES))}), so sharing its image prompts is not known to be exact"), None
    base = attention.base_name(config._attn_implementation)
    base = "sdpa" if base == "flex_attention" else base
    key = (type(model), base, config.to_json_string(use_diff=False))
    if key not in _probed:
        with torch.random.fork_rng(devices=[]), float64_throughout():
            _probed[key] = _probe_images(type(model), config, base)
    return _probed[key]


def tiny_model(model_cls: type, config, attn: str = "sdpa", seed: int = 0) -> PreTrainedModel:
    """A float64 CPU model of `model_cls` on a tiny copy of `config` with a few patches per image
    (`build_tiny` after `fit_images`; `config` itself is left as it is).

    Args:
        model_cls: the model class.
        config: a config of a `FAMILIES` model type.
        attn: the attention implementation.
        seed: the weights' seed.
    """
    fitted = copy.deepcopy(config)
    fit_images(fitted)
    return build_tiny(model_cls, fitted, attn, seed)


def _probe_images(model_cls: type, config, attn: str) -> tuple[str | None, ProbeResult | None]:
    owner = model_cls.__name__
    try:
        reference = tiny_model(model_cls, config, attn)
    except Exception as exc:  # noqa: BLE001 - a copy that cannot be built cannot vouch for the family
        return f"a tiny {owner} with images could not be built ({type(exc).__name__}: {str(exc)[:200]})", None
    candidate = copy.deepcopy(reference)
    enable(candidate)
    candidate._prefixflow_image_refusal = None  # on trial
    setattr(candidate, PROMPT_RUNNER, MultimodalRunner)
    reached = reach(candidate)
    bridge(candidate, reached)
    for tiny in (reference, candidate):
        if tiny.supports_gradient_checkpointing:
            compat.enable_checkpointing(tiny, use_reentrant=False)
            recompute_in_float64(tiny)
    return _compare(reference, candidate, owner), reached


def _compare(reference: PreTrainedModel, candidate: PreTrainedModel, owner: str) -> str | None:
    gen = torch.Generator().manual_seed(2)
    prompt, inputs = sample_prompt(reference, gen, images=2)
    suffixes = [torch.randint(*TEXT_IDS, (n,), generator=gen) for n in (4, 2)]
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in suffixes]
    try:
        ref_loss = 0.0
        for suffix, weight in zip(suffixes, weights):
            full = torch.cat([prompt, suffix])[None]
            logits = reference(input_ids=full, **full_inputs(reference, inputs, 1, full.shape[1])).logits
            loss = _weighted_logp(logits[0, len(prompt) - 1:-1], suffix, weight)
            loss.backward()
            ref_loss += loss.item()
    except Exception as exc:  # noqa: BLE001
        return f"a tiny {owner} could not run an image prompt ({type(exc).__name__}: {str(exc)[:200]})"
    ids, mask = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    for row, suffix in enumerate(suffixes):
        ids[row, :len(suffix)], mask[row, :len(suffix)] = suffix, 1
    try:
        with prefix_group(candidate, prompt, **inputs) as group:
            logits = group(ids, attention_mask=mask).logits
            loss = sum(_weighted_logp(logits[r, :len(s)], s, w) for r, (s, w) in enumerate(zip(suffixes, weights)))
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the family fails inside a group
        return f"a tiny {owner} fails on an image prompt inside a prefix group ({type(exc).__name__}: {str(exc)[:300]})"
    worst, name = _worst_gradient(reference, candidate)
    loss_error = abs(loss.item() - ref_loss) / max(abs(ref_loss), 1e-30)
    if loss_error > TOLERANCE or worst > TOLERANCE:
        return (f"a tiny float64 {owner} trained on an image prompt with PrefixFlow does not match full sequences "
                f"(loss off by {loss_error:.1e}, gradient of {name} off by {worst:.1e} of its scale)")
    return None


def _worst_gradient(reference: torch.nn.Module, candidate: torch.nn.Module) -> tuple[float, str]:
    """The largest gradient error relative to its parameter's gradient scale, that scale at least a millionth of the
    model's largest: a tower's key biases get gradients of rounding noise alone (softmax ignores a shift shared by
    every key), which the tower's N runs per image and PrefixFlow's one run round differently."""
    pairs = [(name, ref.grad, cand.grad) for (name, ref), (_, cand) in
             zip(reference.named_parameters(), candidate.named_parameters())]
    floor = 1e-6 * max((g.abs().max().item() for _, g, _ in pairs if g is not None), default=0.0)
    worst = (0.0, "")
    for name, expected, actual in pairs:
        if expected is None and actual is None:
            continue
        if expected is None or actual is None:
            return float("inf"), name
        scale = max(expected.abs().max().item(), floor)
        error = (actual - expected).abs().max().item()
        worst = max(worst, (error / scale if scale > 0 else float(error > 0) * float("inf"), name))
    return worst


def _weighted_logp(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0] * weights).sum()
