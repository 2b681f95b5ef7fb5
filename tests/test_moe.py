"""MoE rollout routing replay: with the same replayed masks PrefixFlow equals the full sequence, router included."""

import copy

import pytest
import torch

import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_prefixflow import _compat
import hf_prefixflow
from equivalence import assert_rel_close, assert_same_gradients, gradients, pad, random_group, token_loss
from hf_prefixflow import PrefixFlowError
from hf_prefixflow.core import moe
from hf_prefixflow.models import tiny as tiny_copy
from hf_prefixflow.core.moe import record_routing
from models import FAMILIES, build

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# Every router with a replay adapter: the suite's own families (tests/models.py), and tiny random models of the
# others from transformers' default configs (DeepSeek-V3: one dense layer, then an MoE one).
MOE = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "olmoe", "granitemoe", "deepseek_v3"]


def moe_model(family: str) -> torch.nn.Module:
    if family in FAMILIES:
        return build(family)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    return tiny_copy.build_tiny(model_cls, AutoConfig.for_model(family), "sdpa")


def router_gradients(model, grads: dict) -> list[torch.Tensor]:
    names = [name for name, module in model.named_modules() if type(module).__name__ in moe.ADAPTERS]
    return [grad for name, grad in grads.items() if any(name.startswith(f"{router}.") for router in names)]


def rollout_routes(model, group):
    """Routes as an inference engine would record them: from a slightly different copy of the weights, so the
    replayed experts are not the ones the trained model would pick. The prefix mask comes from the first rollout."""
    engine = copy.deepcopy(model)
    with torch.no_grad():
        for param in engine.parameters():
            param.add_(0.05 * torch.randn_like(param))
    hf_prefixflow.apply_prefixflow(engine)
    routes = []
    for suffix in group.suffixes:
        with torch.no_grad(), record_routing() as recorder:
            engine(torch.cat([group.prefix, suffix])[None])
        routes.append(recorder.routes(1, model.config.num_hidden_layers)[:, 0])
    p = len(group.prefix)
    return routes[0][:, :p], [r[:, p:] for r in routes]


def full_sequence(model, group, prefix_routes, suffix_routes):
    p, total = len(group.prefix), 0.0
    for suffix, routes, weights in zip(group.suffixes, suffix_routes, group.weights):
        replay = None if prefix_routes is None else torch.cat([prefix_routes, routes], dim=1)[:, None]
        logits = model(torch.cat([group.prefix, suffix])[None], prefixflow_routes=replay).logits
        loss = token_loss(logits[0, p - 1 : p - 1 + len(suffix)], suffix, weights)
        loss.backward()
        total += loss.item()
    return total


def prefixflow(model, group, prefix_routes, suffix_routes, gen):
    total, rows = 0.0, list(range(len(group.suffixes)))
    with hf_prefixflow.prefix_group(model, group.prefix, routes=prefix_routes) as g:
        padded, packed = rows[: len(rows) // 2 + 1], rows[len(rows) // 2 + 1 :]
        ids, mask = pad([group.suffixes[i] for i in padded], gen)
        routes = None
        if prefix_routes is not None:
            routes = torch.zeros(*prefix_routes.shape[:1], len(padded), ids.shape[1], prefix_routes.shape[-1],
                                 dtype=torch.long)
            for r, i in enumerate(padded):
                routes[:, r, : len(group.suffixes[i])] = suffix_routes[i]
        logits = g(ids, attention_mask=mask, routes=routes).logits
        loss = sum(token_loss(logits[r, : len(group.suffixes[i])], group.suffixes[i], group.weights[i])
                   for r, i in enumerate(padded))
        if packed:
            out = g.packed([group.suffixes[i] for i in packed],
                           routes=None if prefix_routes is None else [suffix_routes[i] for i in packed])
            loss = loss + sum(token_loss(lg, group.suffixes[i], group.weights[i])
                              for lg, i in zip(out.split(out.logits), packed))
        loss.backward()
        total += loss.item()
    return total


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_replayed_routes_match_the_full_sequence(family, checkpointing):
    gen = torch.Generator().manual_seed(2)
    reference = moe_model(family).train()
    if checkpointing:
        _compat.enable_checkpointing(reference)
    hf_prefixflow.apply_prefixflow(reference)
    candidate = copy.deepcopy(reference)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (reference, candidate)]
    for step in range(3):
        group = random_group(gen, prefix=(6, 20), n=(2, 5))
        prefix_routes, suffix_routes = rollout_routes(reference, group)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ref_loss = full_sequence(reference, group, prefix_routes, suffix_routes)
        pf_loss = prefixflow(candidate, group, prefix_routes, suffix_routes, gen)
        assert_rel_close(pf_loss, ref_loss, f"step {step} loss")
        expected = gradients(reference)
        assert any(g.abs().max() > 0 for g in router_gradients(reference, expected)), "the router must get gradient"
        assert_same_gradients(gradients(candidate), expected)
        for opt in opts:
            opt.step()
        for (name, a), (_, b) in zip(reference.named_parameters(), candidate.named_parameters()):
            assert_rel_close(b - start[name], a - start[name], f"step {step} update {name}")


@pytest.mark.parametrize("family", MOE)
def test_replay_actually_forces_the_recorded_experts(family):
    """Replaying routes recorded elsewhere changes the result; training without replay would diverge from it."""
    gen = torch.Generator().manual_seed(4)
    model = hf_prefixflow.apply_prefixflow(moe_model(family).train())
    group = random_group(gen, prefix=(10, 20), n=(3, 4))
    prefix_routes, suffix_routes = rollout_routes(model, group)
    full_sequence(model, group, prefix_routes, suffix_routes)
    replayed = gradients(model)
    model.zero_grad(set_to_none=True)
    prefixflow(model, group, None, [None] * len(group.suffixes), gen)  # no replay: the model routes afresh
    fresh = gradients(model)
    worst = max(((fresh[n] - replayed[n]).abs().max() / replayed[n].abs().max()).item() for n in replayed)
    assert worst > 1e-3


@pytest.mark.parametrize("family", MOE)
def test_replaying_the_routers_own_choice_changes_nothing(family):
    """Each adapter's gate weights, normalisation and dtype are the router's own: replaying the experts it picks
    gives its loss and gradients (router included) to the last bit of float64."""
    gen = torch.Generator().manual_seed(7)
    model = hf_prefixflow.apply_prefixflow(moe_model(family).train())
    ids = torch.randint(0, 97, (1, 12), generator=gen)
    weights = torch.randn(11, generator=gen, dtype=torch.float64)
    with torch.no_grad(), record_routing() as recorder:
        model(ids)
    own = recorder.routes(1, model.config.num_hidden_layers)
    results = []
    for routes in (None, own):
        model.zero_grad(set_to_none=True)
        loss = token_loss(model(ids, prefixflow_routes=routes).logits[0, :-1], ids[0, 1:], weights)
        loss.backward()
        results.append((loss.item(), gradients(model)))
    (plain_loss, plain), (replayed_loss, replayed) = results
    assert replayed_loss == plain_loss
    assert router_gradients(model, plain) and all(g.abs().max() > 0 for g in router_gradients(model, plain))
    assert_same_gradients(replayed, plain, rtol=1e-12)


def test_missing_or_mismatched_replay_data_is_an_error():
    gen = torch.Generator().manual_seed(5)
    model = hf_prefixflow.apply_prefixflow(build("qwen3_moe").train())
    group = random_group(gen, prefix=(8, 12), n=(2, 2))
    prefix_routes, suffix_routes = rollout_routes(model, group)
    with pytest.raises(PrefixFlowError, match="missing"):
        with hf_prefixflow.prefix_group(model, group.prefix, routes=prefix_routes) as g:
            g(group.suffixes[0][None])
    with pytest.raises(PrefixFlowError, match="prefix routes must be"):
        hf_prefixflow.prefix_group(model, group.prefix, routes=prefix_routes[:, :-1])
    with pytest.raises(PrefixFlowError, match="tokens"):
        model(torch.cat([group.prefix, group.suffixes[0]])[None], prefixflow_routes=prefix_routes[:, None])


def test_router_jitter_is_refused_under_replay():
    gen = torch.Generator().manual_seed(6)
    model = hf_prefixflow.apply_prefixflow(build("mixtral", router_jitter_noise=0.1).train())
    group = random_group(gen, prefix=(8, 12), n=(2, 2))
    prefix_routes, _ = rollout_routes(model.eval(), group)
    model.train()
    with pytest.raises(PrefixFlowError, match="router_jitter_noise"):
        hf_prefixflow.prefix_group(model, group.prefix, routes=prefix_routes).__enter__()
