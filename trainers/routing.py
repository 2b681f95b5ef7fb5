"""Rollout routing replay for TRL batches: record routes during generation, align them with the batch, replay them.

Routes ride in the batch as `prefixflow_routes`, an int16 tensor `[B, layers, prompt width + completion width, k]`
laid out like `cat(prompt_ids, completion_ids)`, so TRL's shuffles and splits carry them with their rows. Every
completion of a prompt replays the prompt routes of the group's first rollout: one prefix mask per group. Tokens
generation did not route here (tool results and the turns after them) carry -1 and route afresh; a batch generated
elsewhere (custom rollouts, vLLM, continuous batching) carries None: all its rows route afresh, as in the stock trainer.
"""

from __future__ import annotations

import torch

from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.moe import ROUTES_KWARG, RoutingRecorder

BATCH_KEY = "prefixflow_routes"
UNRECORDED = "unrecorded"  # the trainer's routes while a batch generated without recording is scored or trained


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
    later token (tool results, the turns after them) gets -1. `width`: the batch's final completion width."""
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
