"""MoE rollout routing replay: record each token's top-k experts, replay them with the router's own gate weights.

One prefix forward can stand for N trajectories only if every prefix token picks the same experts in each of them.
Recording keeps the top-k indices the router chose (e.g. during generation); replay forces those indices while the
gate weights still come from the router's own logits, turned into weights for the replayed experts as that router
family does (`ADAPTERS`), so the router keeps its gradient and expert choice no longer depends on batch composition.

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

from .. import _compat as compat
from ..errors import PrefixFlowError

ROUTES_KWARG = "prefixflow_routes"


@dataclass(frozen=True)
class RouterAdapter:
    """How a router family turns its logits into the gate weights of given experts, as its own forward does, so
    that replaying the experts it would pick reproduces its output.

    Attributes:
        gates: `gates(router, logits [T, E], experts [T, k], hidden) -> weights [T, k]`, with `hidden` the
            router's input, the weights in the dtype the router's own forward returns.
        jitter_attribute: the MoE block's noise knob, which replay requires off in training, or None.
    """

    gates: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    jitter_attribute: str | None = None


def softmax_gates(normalize: Callable[[torch.nn.Module], bool], in_logit_dtype: bool) -> Callable:
    """A `RouterAdapter.gates` for softmax routers (Qwen-MoE, OLMoE, Mixtral): a float32 softmax over every expert,
    gathered at the experts and renormalised over them where `normalize` says so.

    Args:
        normalize: `normalize(router)`: whether to renormalise over the chosen experts.
        in_logit_dtype: return the weights in the logits' dtype; else float32.

    Returns:
        The gates function.
    """

    def gates(router, logits, experts, hidden):
        scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if normalize(router):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores.to(logits.dtype) if in_logit_dtype else scores

    return gates


def _chosen_softmax_gates(router, logits, experts, hidden):
    # GraniteMoE: a softmax over the chosen experts' logits only, in the hidden states' dtype.
    return torch.softmax(logits.gather(-1, experts), dim=-1).type_as(hidden)


def _chosen_softmax_in_logit_dtype(router, logits, experts, hidden):
    # gpt-oss: the same in the logits' dtype (its logits carry the router's bias).
    return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=logits.dtype)


def _sigmoid_gates(router, logits, experts, hidden):
    # DeepSeek-V3: sigmoid scores of the chosen experts, renormalised, scaled. Its grouped choice over bias-corrected
    # scores only picks the experts, which replay gives.
    weights = logits.sigmoid().gather(-1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


_QWEN = softmax_gates(lambda r: bool(r.norm_topk_prob), in_logit_dtype=True)
ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen3MoeTopKRouter": RouterAdapter(_QWEN),
    "Qwen2MoeTopKRouter": RouterAdapter(_QWEN),
    "OlmoeTopKRouter": RouterAdapter(_QWEN),
    "MixtralTopKRouter": RouterAdapter(softmax_gates(lambda r: True, in_logit_dtype=False),
                                       jitter_attribute="jitter_noise"),
    "GraniteMoeTopKRouter": RouterAdapter(_chosen_softmax_gates),
    "GptOssTopKRouter": RouterAdapter(_chosen_softmax_in_logit_dtype),
    "DeepseekV3TopkRouter": RouterAdapter(_sigmoid_gates),
}
# Routers replay cannot reproduce, and why.
NO_REPLAY = {
    "PhimoeTopKRouter": "sparsemixer samples experts (Gumbel) and estimates their gradient with random Heun masks in "
                        "training: forced experts have no gate weight of its own to reproduce",
}

_published: dict[int, tuple] = {}  # layer -> (routes or None, logits sink or None) for the router about to run
_recorders: list["RoutingRecorder"] = []
PUBLISHES = "_prefixflow_publishes_routes"  # set on the attention modules of layers with a router


def register_router(class_name: str, adapter: RouterAdapter) -> None:
    """Teach replay a new router class (a few lines per family: its gate weights for given experts).

    Args:
        class_name: the router module's class name; modules of it are found by `routers`.
        adapter: its gate weights for given experts.
    """
    ADAPTERS[class_name] = adapter


def publish(layer_idx: int, routes: torch.Tensor | None, sink: Callable | None = None) -> None:
    """Called by the attention function of `layer_idx`: the routes (or None) its MoE block must use next, and
    where to hand that block's router logits.

    Args:
        layer_idx: the decoder layer.
        routes: the forward's `[layers, B, T, k]` routes, or None (the router routes itself).
        sink: `sink(layer_idx, logits [B*T, E])`, for the load-balancing loss, or None.
    """
    flat = None if routes is None else routes[layer_idx].reshape(-1, routes.shape[-1])
    _published[layer_idx] = (flat, sink)


def _replay(router, adapter: RouterAdapter, hidden: torch.Tensor, output: tuple, routes: torch.Tensor) -> tuple:
    """The router's output with its experts replaced by `routes` ([tokens, k]; -1: not recorded, keep its own) and
    gate weights recomputed for them from its own logits, which keep their gradient."""
    logits, own = output[0], output[2]
    if routes.shape[0] != own.shape[0]:
        raise PrefixFlowError(
            f"routing replay data covers {routes.shape[0]} tokens but this forward routes {own.shape[0]}; the "
            "routes must be aligned with the forward's input tokens."
        )
    if routes.shape[1] != own.shape[-1]:
        raise PrefixFlowError(f"routing replay data must hold {own.shape[-1]} expert indices per token.")
    experts = torch.where(routes < 0, own, routes.to(own.device))
    return logits, adapter.gates(router, logits, experts, hidden), experts


@compat.dynamo_disable  # keyed by layer index: compiled inline, each layer would be a graph of its own
def _router_hook(router: torch.nn.Module, args: tuple, output: tuple):
    # A module-level hook that receives the router: deep copies of the model (reference models) keep working.
    routes, sink = _published.pop(router._prefixflow_layer, (None, None))
    if routes is not None:
        output = _replay(router, ADAPTERS[type(router).__name__], args[0], output, routes)
    else:
        for recorder in _recorders:
            recorder.add(router._prefixflow_layer, output[2])
    if sink is not None:
        sink(router._prefixflow_layer, output[0])
    return output


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, RouterAdapter]]:
    """The known MoE routers of `model` (classes in `ADAPTERS`).

    Returns:
        `(layer_idx, router, adapter)` per router, in module order.

    Raises:
        PrefixFlowError: a router whose module name holds no `layers.<i>.`.
    """
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
    """Make every known router replay published routes and report to recorders (idempotent). The router's own
    forward still runs; a forward hook swaps in the replayed output.

    Args:
        model: the unwrapped transformers model.

    Returns:
        How many routers there are (0 for a dense model).
    """
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
    """Refuse what replay cannot make exact: token-dropping capacity limits and router jitter in training.

    Raises:
        PrefixFlowError: the config sets a capacity factor or expert capacity, or a module in training mode has
            its jitter knob above 0.
    """
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
    """Check that replay data names existing experts (one check per group or wave, not per router call).

    Args:
        model: the unwrapped transformers model.
        routes: integer expert indices of any shape; -1 marks a token not recorded.

    Raises:
        PrefixFlowError: the model has no supported router, or an index is outside `-1 .. num_experts - 1`.
    """
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

    A prefix computed once for n rows enters with weight n, exactly as its n copies enter the full-sequence batch;
    the expert counts come from the logits' own top-k, as in transformers, not from replayed routes.

    Args:
        parts: `(router logits per layer {layer_idx: [T, E]}, token weights [T])` per token set (T may differ
            between sets; weight 0 drops a token, e.g. padding).
        num_experts: E.
        top_k: experts per token.

    Returns:
        A scalar float32 tensor.
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
    """Routes of wave inputs `[p_last, s_0 .. s_{L-2}]`: the prefix's last token keeps the shared prefix route.

    Args:
        prefix_routes: `[layers, P, k]`.
        suffix_routes: one `[layers, L_i, k]` per suffix, aligned with its tokens.

    Returns:
        One `[layers, L_i, k]` per suffix, aligned with its wave inputs.
    """
    last = prefix_routes[:, -1:]
    return [torch.cat([last, routes[:, :-1]], dim=1) for routes in suffix_routes]


class RoutingRecorder:
    """Collects each router call's top-k indices, per layer, in call order."""

    def __init__(self):
        self.calls: dict[int, list[torch.Tensor]] = {}

    def add(self, layer_idx: int, indices: torch.Tensor) -> None:
        """Record one router call's top-k indices `[B*t, k]` for `layer_idx` (detached)."""
        self.calls.setdefault(layer_idx, []).append(indices.detach())

    def gap(self, batch_size: int, layers: list[int] | None = None) -> str | None:
        """Why the recording cannot be read as forwards of `batch_size` rows through `layers`, or None if it can.

        Args:
            batch_size: B, the rows every recorded call should have run.
            layers: the layers whose routers should have run (e.g. those `routers` finds); None: any that did.

        Returns:
            A sentence naming the gap (no router ran, some layers' routers did not, a call routed a token count
            that is not a multiple of B, or the layers' routers ran different token counts), or None.
        """
        if not self.calls:
            return "no router ran while recording"
        missing = sorted(set(layers or ()) - set(self.calls))
        if missing:
            return f"the routers of layers {missing} did not run while recording"
        counts = {tuple(c.shape[0] for c in calls) for calls in self.calls.values()}
        if any(n % batch_size for ns in counts for n in ns):
            return "a router call routed a token count that is not a multiple of the rows"
        if len(counts) > 1:
            return "the layers' routers ran different token counts while recording"
        return None

    def routes(self, batch_size: int, num_layers: int) -> torch.Tensor:
        """The recorded routes, each call's tokens reshaped to `[B, t, k]` and joined along T (prefill, then one
        call per decoded token).

        Args:
            batch_size: B, the rows every recorded call ran.
            num_layers: the decoder's layer count.

        Returns:
            int64 `[num_layers, B, T, k]`; layers whose router recorded nothing (dense layers) hold -1 (route
            afresh).

        Raises:
            PrefixFlowError: no router ran while recording, or the calls cannot be read as `batch_size` rows
                (`gap`).
        """
        if not self.calls:
            raise PrefixFlowError("no router ran while recording; is this an MoE model with a supported router?")
        gap = self.gap(batch_size)
        if gap is not None:
            raise PrefixFlowError(f"the recorded routing cannot be read as {batch_size} rows: {gap}.")
        per_layer = {l: torch.cat([c.reshape(batch_size, -1, c.shape[-1]) for c in calls], dim=1)
                     for l, calls in self.calls.items()}
        sample = next(iter(per_layer.values()))
        out = sample.new_full((num_layers, *sample.shape), -1)
        for layer_idx, routes in per_layer.items():
            out[layer_idx] = routes
        return out


@contextmanager
def record_routing():
    """Record the routing of every replay-enabled router that runs inside the block (without replay).

    Yields:
        A `RoutingRecorder`; read `recorder.routes(batch_size, num_layers)` after the block.
    """
    recorder = RoutingRecorder()
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)
