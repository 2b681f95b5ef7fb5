"""Rollout routing replay for TRL batches: record routes during generation, align them with the batch, replay them.

Routes ride in the batch as `prefixflow_routes`, an int16 tensor `[B, layers, prompt width + completion width, k]`
laid out like `cat(prompt_ids, completion_ids)`, so TRL's shuffles and splits carry them with their rows. Every
completion of a prompt replays the prompt routes of the group's first rollout: one prefix mask per group. Tokens
generation did not route here (tool results and the turns after them) carry -1 and route afresh; a batch generated
elsewhere (custom rollouts, vLLM, continuous batching) carries None: all its rows route afresh, as in the stock trainer.
A recording that cannot stand for the batch (no router ran, some layers' routers did not, beam search, assisted
decoding or generation without a KV cache routed other tokens, the rollouts are not the recorded prompts) degrades
the same way: never an error, always counted (`FALLBACK` reasons, `prefixflow/routing_fallbacks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.core.moe import ROUTES_KWARG, RoutingRecorder

logger = logging.getLogger(__name__)

BATCH_KEY = "prefixflow_routes"
UNRECORDED = "unrecorded"  # the trainer's routes while a batch generated without recording is scored or trained
FALLBACK = "MoE routing replay"  # the start of every reason rows route afresh for (`prefixflow/routing_fallbacks`)
NOT_RECORDED = (f"{FALLBACK}: rollouts from custom rollouts, vLLM or continuous batching carry no recorded routes and "
                "route afresh")
LATER_TURNS = f"{FALLBACK}: tool results and the turns after them route afresh"


@dataclass(frozen=True)
class Recording:
    """One recorded generation turn (a batch's first), or why it cannot be replayed.

    Attributes:
        prompt_ids: the turn's B prompts, as generation received them.
        completion_ids: the turn's B completions.
        routes: int16 `[B, layers, prompt_width + completion width, k]` (`assemble`), or None where `gap` is set.
        prompt_width: W, the turn's left-padded prompt width.
        gap: why the routes cannot stand for the turn (its rows then route afresh), or None.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    routes: torch.Tensor | None = None
    prompt_width: int = 0
    gap: str | None = None


def padded_width(lengths: list[int], pad_to_multiple_of: int | None) -> int:
    """The width TRL pads rows of these lengths to (`trl.trainer.utils.pad`)."""
    width = max(lengths, default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return width


def record_turn(recorder: RoutingRecorder, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                num_layers: int, routed_layers: list[int], group_size: int, top_k: int,
                pad_to_multiple_of: int | None = None) -> Recording:
    """Read what `recorder` saw during one call of transformers generation as routes of its rows, or name the gap.

    Generation of N tokens from left-padded prompts of width W runs one prefill (W tokens per row, possibly in
    chunks) and N - 1 decode calls of one token per row through every router: W + N - 1 tokens per row. Anything
    else (no router ran, some layers' routers did not, another row count, beam search, assisted decoding,
    generation without a KV cache) cannot be aligned with the rows and is returned as a gap, never raised.

    Args:
        recorder: the recording of the call.
        prompt_ids: the call's B prompts (unpadded).
        completion_ids: the B completions it returned (cut after EOS).
        num_layers: the decoder's layer count.
        routed_layers: the layers that have a router (`moe.routers`); each must have recorded.
        group_size: consecutive rows that share a prompt (they replay the first row's prompt routes).
        top_k: experts per token.
        pad_to_multiple_of: the trainer's prompt padding (TRL's `pad_to_multiple_of`).

    Returns:
        A `Recording` with routes, or with `gap` set and no routes. Gaps name their kind only (one warning per kind);
        the counts behind them are logged at debug level.
    """
    prompts, completions = [list(p) for p in prompt_ids], [list(c) for c in completion_ids]
    recording = Recording(prompts, completions)
    rows = len(prompts)
    if rows == 0 or len(completions) != rows:
        logger.debug("routing replay: %d completions for %d prompts", len(completions), rows)
        return replace(recording, gap="generation returned another number of completions than prompts")
    gap = recorder.gap(rows, routed_layers)
    if gap is not None:
        return replace(recording, gap=gap)
    width = padded_width([len(p) for p in prompts], pad_to_multiple_of)
    steps = max(len(c) for c in completions)
    per_row = sum(c.shape[0] for c in next(iter(recorder.calls.values()))) // rows
    if per_row != width + max(steps, 1) - 1:
        logger.debug("routing replay: %d tokens per row routed, %d-token prompts and %d generated tokens route %d",
                     per_row, width, steps, width + max(steps, 1) - 1)
        return replace(recording, gap="generation routed other tokens than the prompts' prefill and one decode step "
                                      "per generated token (beam search, assisted decoding or no KV cache?)")
    # Rows replay their group leader's prompt routes only where the leader's prompt is theirs.
    if any(prompts[r] != prompts[r - r % group_size] for r in range(rows)):
        group_size = 1
    try:
        routes = assemble(recorder, rows, width, steps, num_layers, group_size, top_k)
    except (PrefixFlowError, RuntimeError) as error:  # checked above; still, a recording never stops training
        return replace(recording, gap=str(error))
    return replace(recording, routes=routes, prompt_width=width)


def for_rollouts(recording: Recording | None, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                 pad_to_multiple_of: int | None = None) -> tuple[torch.Tensor | str, list[tuple[str, int]]]:
    """The routes of the rollouts TRL builds its batch from, aligned with that batch, and the rows that route afresh.

    A row replays its prompt and its recorded first turn where its completion starts with that turn; the rest of
    its completion (tool results, later turns) routes afresh (-1). Rollouts without a usable recording (none made,
    a gap, other prompts than the recorded ones) route afresh as a whole (`UNRECORDED`).

    Args:
        recording: the batch's first recorded turn (`record_turn`), or None if generation recorded none.
        prompt_ids: the rollouts' B prompts.
        completion_ids: their B final completions.
        pad_to_multiple_of: TRL's padding of the batch.

    Returns:
        `(routes, fallbacks)`: int16 `[B, layers, prompt width + completion width, k]` matching the batch TRL pads
        from these rollouts, or `UNRECORDED`; and `(reason, rows)` for every set of rows that routes afresh.
    """
    rows = len(completion_ids)
    if recording is None:
        return UNRECORDED, [(NOT_RECORDED, rows)]
    if recording.gap is not None:
        return UNRECORDED, [(f"{FALLBACK}: {recording.gap}; the batch routes afresh", rows)]
    if [list(p) for p in prompt_ids] != recording.prompt_ids:
        return UNRECORDED, [(f"{FALLBACK}: the rollouts' prompts are not the prompts generation recorded; the batch "
                             "routes afresh", rows)]
    completions = [list(c) for c in completion_ids]
    first = [len(f) if c[: len(f)] == f else 0 for c, f in zip(completions, recording.completion_ids)]
    width = padded_width([len(c) for c in completions], pad_to_multiple_of)
    routes = first_turn_only(recording.routes, recording.prompt_width, first, width)
    fallbacks = []
    later = sum(n > 0 and len(c) > n for c, n in zip(completions, first))
    if later:
        fallbacks.append((LATER_TURNS, later))
    unrecorded = sum(n == 0 for n in first)
    if unrecorded:
        fallbacks.append((f"{FALLBACK}: completions that do not continue the recorded turn route afresh", unrecorded))
    return routes, fallbacks


def assemble(recorder: RoutingRecorder, rows: int, prompt_width: int, completion_width: int, num_layers: int,
             group_size: int, top_k: int) -> torch.Tensor:
    """Align transformers `generate`'s recording (one prefill call over left-padded prompts, then one call per decoded
    token) with the `[prompt | completion]` layout of the batch TRL builds from it."""
    recorded = recorder.routes(rows, num_layers).transpose(0, 1)  # [B, layers, prefill + decode steps, k]
    if recorded.shape[2] < prompt_width:
        raise PrefixFlowError("the recorded routing is shorter than the prompts; was generation interrupted?")
    # A completion's last token never runs through the model during generation: -1 lets the router choose, as the
    # stock trainer does (its log-prob does not depend on it; the load-balancing loss does).
    routes = recorded.new_full((rows, num_layers, prompt_width + completion_width, top_k), -1)
    length = min(recorded.shape[2], prompt_width + completion_width)
    routes[:, :, :length] = recorded[:, :, :length]
    leaders = torch.arange(rows, device=routes.device) // group_size * group_size
    routes[:, :, :prompt_width] = routes[leaders, :, :prompt_width]
    return routes.to(torch.int16)


def first_turn_only(routes: torch.Tensor, prompt_width: int, first_lengths: list[int], width: int) -> torch.Tensor:
    """Routes of rows that went on after tool calls: the recording covers each row's prompt and first turn; every
    later token (tool results, the turns after them) gets -1.

    Args:
        routes: the recorded `[B, layers, prompt_width + recorded completion width, k]`.
        prompt_width: W.
        first_lengths: each row's recorded first-turn length (0: none of its completion replays).
        width: the batch's final (padded) completion width.

    Returns:
        `[B, layers, prompt_width + width, k]`, -1 from each row's `prompt_width + first_lengths[row]` on.
    """
    rows, layers, _, top_k = routes.shape
    out = routes.new_full((rows, layers, prompt_width + width, top_k), -1)
    common = min(routes.shape[2], out.shape[2])
    out[:, :, :common] = routes[:, :, :common]
    first = torch.tensor(first_lengths, device=routes.device)
    later = torch.arange(out.shape[2], device=routes.device)[None] >= prompt_width + first[:, None]
    return out.masked_fill_(later[:, None, :, None], -1)


def plain_logps(trainer, model, input_ids, attention_mask, logits_to_keep, routes, compute_entropy, compute_aux_loss):
    """TRL's text-only log-prob forward (fused LM head, completion labels) with the rows' routes replayed."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    extra = {"output_router_logits": True} if compute_aux_loss else {}
    with trainer.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                    **{ROUTES_KWARG: routes.transpose(0, 1).long()}, **extra)
    entropy = out.entropy[:, -logits_to_keep:] if compute_entropy else None
    return out.log_probs[:, -logits_to_keep:], entropy, (out.aux_loss if compute_aux_loss else None)
