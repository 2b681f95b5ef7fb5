"""MoE rollout routing replay: record each token's top-k experts, replay them with the router's own gate weights.

One prefix forward can stand for N trajectories only if every prefix token picks the same experts in each of them.
Recording keeps the top-k indices the router chose (e.g. during generation); replay forces those indices while the
gate weights still come from the router's fresh logits (softmax, gather at the replayed experts, renormalised as
the model does), so the router keeps its gradient and expert choice no longer depends on batch composition.

Routes travel as a model kwarg, `prefixflow_routes`, a LongTensor `[num_layers, B, T, k]` aligned with the forward's
tokens; -1 marks a token generation never ran (a completion's last token), which the router then routes itself. The
PrefixFlow attention function publishes its layer's slice just before that layer's MoE block runs; the router
consumes it. Activation checkpointing recomputes attention before the MLP too, so recompute replays.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import _compat as compat
from .errors import PrefixFlowError

ROUTES_KWARG = "prefixflow_routes"


@dataclass(frozen=True)
class RouterAdapter:
    """How a router family turns logits into gate weights: which experts count, and the dtype it returns."""

    normalize: Callable[[torch.nn.Module], bool]
    scores_in_logit_dtype: bool
    jitter_attribute: str | None = None  # the MoE block's noise knob, which replay requires off


ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen3MoeTopKRouter": RouterAdapter(lambda r: bool(r.norm_topk_prob), scores_in_logit_dtype=True),
    "MixtralTopKRouter": RouterAdapter(lambda r: True, scores_in_logit_dtype=False, jitter_attribute="jitter_noise"),
}

_published: dict[int, tuple] = {}  # layer -> (routes or None, logits sink or None) for the router about to run
_recorders: list["RoutingRecorder"] = []
PUBLISHES = "_prefixflow_publishes_routes"  # set on the attention modules of layers with a router


def register_router(class_name: str, adapter: RouterAdapter) -> None:
    """Teach replay a new router class (a few lines per family)."""
    ADAPTERS[class_name] = adapter


def publish(layer_idx: int, routes: torch.Tensor | None, sink: Callable | None = None) -> None:
    """Called by the attention function of `layer_idx`: the routes (or None) its MoE block must use next, and
    where to hand that block's router logits (`sink(layer_idx, logits)`, for the load-balancing loss)."""
    flat = None if routes is None else routes[layer_idx].reshape(-1, routes.shape[-1])
    _published[layer_idx] = (flat, sink)


def _replay(router, adapter: RouterAdapter, hidden: torch.Tensor, indices: torch.Tensor):
    hidden = hidden.reshape(-1, router.weight.shape[1])
    if indices.shape[0] != hidden.shape[0]:
        raise PrefixFlowError(
            f"routing replay data covers {indices.shape[0]} tokens but this forward routes {hidden.shape[0]}; the "
            "routes must be aligned with the forward's input tokens."
        )
    if indices.shape[1] != router.top_k:
        raise PrefixFlowError(f"routing replay data must hold {router.top_k} expert indices per token.")
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    indices = indices.to(logits.device)
    indices = torch.where(indices < 0, torch.topk(probs, router.top_k, dim=-1).indices, indices)  # -1: not recorded
    scores = probs.gather(-1, indices)
    if adapter.normalize(router):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    if adapter.scores_in_logit_dtype:
        scores = scores.to(logits.dtype)
    return logits, scores, indices


@compat.dynamo_disable  # keyed by layer index: compiled inline, each layer would be a graph of its own
def _router_hook(router: torch.nn.Module, args: tuple, output: tuple):
    # A module-level hook that receives the router: deep copies of the model (reference models) keep working.
    routes, sink = _published.pop(router._prefixflow_layer, (None, None))
    if routes is not None:
        output = _replay(router, ADAPTERS[type(router).__name__], args[0], routes)
    else:
        for recorder in _recorders:
            recorder.add(router._prefixflow_layer, output[2])
    if sink is not None:
        sink(router._prefixflow_layer, output[0])
    return output


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, RouterAdapter]]:
    """The known MoE routers of `model` with their decoder layer index."""
    found = []
    for name, module in model.named_modules():
        adapter = ADAPTERS.get(type(module).__name__)
        if adapter is None:
            continue
        match = re.search(r"layers\.(\d+)\.", name)
        if match is None:
            raise PrefixFlowError(f"cannot tell which decoder layer router {name} belongs to.")
        found.append((int(match.group(1)), module, adapter))
    return found


def enable_replay(model: torch.nn.Module) -> int:
    """Make every known router replay published routes and report to recorders (idempotent); returns how many
    routers there are. The router's own forward still runs; the hook swaps in the replayed output."""
    found = routers(model)
    for layer_idx, router, _ in found:
        if not hasattr(router, "_prefixflow_layer"):
            router._prefixflow_layer = layer_idx
            router.register_forward_hook(_router_hook)
    routed = {layer_idx for layer_idx, _, _ in found}
    for module in model.modules():  # their attention publishes; a dense layer's has no router to hand routes to
        if getattr(module, "layer_idx", None) in routed:
            setattr(module, PUBLISHES, True)
    return len(found)


def check_replay_supported(model: torch.nn.Module) -> None:
    """Refuse what replay cannot make exact: token-dropping capacity limits and router jitter in training."""
    config = getattr(model, "config", None)
    if getattr(config, "capacity_factor", None) or getattr(config, "expert_capacity", None):
        raise PrefixFlowError("capacity-limited (token-dropping) MoE routing cannot be replayed; use dropless MoE.")
    knobs = {a.jitter_attribute for a in ADAPTERS.values() if a.jitter_attribute}
    for module in model.modules():
        for knob in knobs:
            if module.training and getattr(module, knob, 0):
                raise PrefixFlowError(
                    f"{type(module).__name__}.{knob} adds random noise before routing; set config.router_jitter_noise"
                    " = 0.0 to replay routes."
                )


def check_routes(model: torch.nn.Module, routes: torch.Tensor) -> None:
    """Replay data must name existing experts (one check per group or wave, not per router call)."""
    experts = getattr(model, "_prefixflow_num_experts", None)
    if experts is None:
        found = routers(model)
        if not found:
            raise PrefixFlowError("routes were given but the model has no supported MoE router (see moe.ADAPTERS).")
        experts = model._prefixflow_num_experts = found[0][1].weight.shape[0]
    if routes.numel() and (int(routes.min()) < -1 or int(routes.max()) >= experts):
        raise PrefixFlowError(f"routing replay data names experts outside 0..{experts - 1} (-1: not recorded).")


def load_balancing_loss(parts: list[tuple[dict[int, torch.Tensor], torch.Tensor]], num_experts: int,
                        top_k: int) -> torch.Tensor:
    """transformers' Switch load-balancing loss (`load_balancing_loss_func`) over weighted token sets.

    `parts` holds (router logits per layer `[T, E]`, token weights `[T]`). A prefix computed once for n rows enters
    with weight n, exactly as its n copies enter the full-sequence batch; the expert counts come from the logits'
    own top-k, as in transformers, not from replayed routes.
    """
    tokens = probs_sum = rows = 0.0
    for per_layer, weights in parts:
        weights = weights.float()
        for logits in per_layer.values():
            probs = torch.softmax(logits, dim=-1)
            chosen = torch.topk(probs, top_k, dim=-1).indices
            counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
            tokens = tokens + counts.scatter_add_(0, chosen.reshape(-1), weights.repeat_interleave(top_k))
            probs_sum = probs_sum + (probs.float() * weights[:, None]).sum(dim=0)
            rows = rows + weights.sum()
    return torch.sum((tokens / rows) * (probs_sum / rows)) * num_experts


def wave_routes(prefix_routes: torch.Tensor, suffix_routes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Routes of wave inputs `[p_last, s_0 .. s_{L-2}]` from the prefix's `[layers, P, k]` and each suffix's
    `[layers, L_i, k]`: the prefix's last token keeps the shared prefix route."""
    last = prefix_routes[:, -1:]
    return [torch.cat([last, routes[:, :-1]], dim=1) for routes in suffix_routes]


class RoutingRecorder:
    """Collects each router call's top-k indices, per layer, in call order."""

    def __init__(self):
        self.calls: dict[int, list[torch.Tensor]] = {}

    def add(self, layer_idx: int, indices: torch.Tensor) -> None:
        self.calls.setdefault(layer_idx, []).append(indices.detach())

    def routes(self, batch_size: int, num_layers: int) -> torch.Tensor:
        """`[num_layers, B, T, k]`: each call's tokens reshaped to `[B, t, k]` and joined along T (prefill, then
        one call per decoded token). Layers without a router hold zeros."""
        if not self.calls:
            raise PrefixFlowError("no router ran while recording; is this an MoE model with a supported router?")
        per_layer = {l: torch.cat([c.reshape(batch_size, -1, c.shape[-1]) for c in calls], dim=1)
                     for l, calls in self.calls.items()}
        sample = next(iter(per_layer.values()))
        out = sample.new_zeros((num_layers, *sample.shape))
        for layer_idx, routes in per_layer.items():
            out[layer_idx] = routes
        return out


@contextmanager
def record_routing():
    """Record the routing of every replay-enabled router that runs inside the block (without replay)."""
    recorder = RoutingRecorder()
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)
