"""`offload_kv`: the prefix K/V and gK/gV on the host, streamed in per layer; training equals full sequences."""

import functools
import gc
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import hf_prefixflow
from hf_prefixflow import _compat
from hf_prefixflow.core.kv_cache import StreamedTensor
from equivalence import (assert_rel_close, assert_same_gradients, full_sequence_backward, gradients,
                         prefixflow_backward, random_group, random_plan, train_side_by_side)
from models import build


SELECTIVE = functools.partial(create_selective_checkpoint_contexts,
                              [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default])


def _model(family: str, lora: bool = False, checkpointing: bool | str = False):
    model = build(family).train()
    if checkpointing == "selective":  # torch's selective checkpointing: matrix multiplies' outputs kept
        _compat.enable_checkpointing(model, context_fn=SELECTIVE)
    elif checkpointing:
        _compat.enable_checkpointing(model)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).double()
    return model


@pytest.mark.parametrize("family,lora,checkpointing,suffix_checkpointing", [
    ("llama", False, False, True), ("qwen3", True, True, True), ("mistral", False, True, False),
    ("gemma2", False, True, True)])
def test_streamed_kv_trains_like_full_sequences(family, lora, checkpointing, suffix_checkpointing):
    gen = torch.Generator().manual_seed(11)
    model = _model(family, lora, checkpointing)
    groups = [random_group(gen, prefix=(8, 24), n=(2, 5)) for _ in range(3)]
    plans = [random_plan(gen, len(g.suffixes)) for g in groups]
    train_side_by_side(model, groups, plans, prepare=functools.partial(
        hf_prefixflow.apply_prefixflow, offload_kv=True, suffix_checkpointing=suffix_checkpointing))


@pytest.mark.parametrize("offload", [{"offload": True, "prefix_recompute": 0.5}, {"offload_kv": True}])
def test_offload_under_selective_checkpointing(offload):
    """Selective checkpointing replays every op of a layer's forward in its recompute and refuses different ones;
    the host copies (replayed attention's, streamed K/V's) stay outside it."""
    gen = torch.Generator().manual_seed(12)
    model = _model("llama", checkpointing="selective")
    groups = [random_group(gen, prefix=(8, 24), n=(2, 4)) for _ in range(2)]
    plans = [random_plan(gen, len(g.suffixes)) for g in groups]
    train_side_by_side(model, groups, plans, prepare=functools.partial(hf_prefixflow.apply_prefixflow, **offload))


def test_streamed_kv_leaves_no_kv_on_the_device_between_waves(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    model = hf_prefixflow.apply_prefixflow(build("llama", num_hidden_layers=4).train(), offload_kv=True)
    assert hf_prefixflow.core.access.config_of(model).offload  # implied
    group = random_group(gen, prefix=(12, 16), n=(3, 3))
    loads = []
    load = hf_prefixflow.core.offload.PrefixOffload.load
    monkeypatch.setattr(hf_prefixflow.core.offload.PrefixOffload, "load",
                        lambda self, p: loads.append(p) or load(self, p))
    with hf_prefixflow.prefix_group(model, group.prefix) as g:
        streamed = [t for t in g.cache.tensors() if isinstance(t, StreamedTensor)]
        assert len(streamed) == 2 * model.config.num_hidden_layers
        assert all(t.live.shape == () and t.value.device_copy is None for t in streamed)
        for suffix in group.suffixes:
            g(suffix[None]).logits.sum().backward()
            assert all(t.grad is not None for t in streamed)
            # between waves only prefetched copies wait on the device: one layer's K/V, one layer's sums
            assert sum(t.value.device_copy is not None for t in streamed) <= 2
            assert sum(t.grad.device_copy is not None for t in streamed) <= 2
    # each wave reads every layer's K and V once (no recompute here), every wave but the first brings each sum in to
    # add to it, and Phase C brings each sum in once
    assert len(loads) == len(streamed) * (len(group.suffixes) + len(group.suffixes) - 1 + 1)


def test_scoring_reads_streamed_kv_without_a_graph():
    gen = torch.Generator().manual_seed(4)
    model = hf_prefixflow.apply_prefixflow(build("qwen3").train(), offload_kv=True)
    group = random_group(gen, prefix=(10, 14), n=(2, 2))
    with torch.no_grad():
        reference = model(torch.cat([group.prefix, group.suffixes[0]])[None]).logits[0, len(group.prefix) - 1:-1]
        with hf_prefixflow.prefix_group(model, group.prefix) as g:
            logits = g(group.suffixes[0][None]).logits[0]
    assert_rel_close(logits, reference, "scoring logits")


class _DroppedWave(StreamedTensor):
    """Broken: the host sum keeps only the latest wave's gradient."""

    def accumulate(self, grad):
        self.grad = None
        super().accumulate(grad)


class _NoPhaseC(StreamedTensor):
    """Broken: Phase C emits zeros instead of the waves' sum."""

    def emit(self):
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


@pytest.mark.parametrize("broken", [_DroppedWave, _NoPhaseC])
def test_broken_streaming_fails_the_check(broken, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    model = _model("llama", checkpointing=True)
    group = random_group(gen, prefix=(10, 16), n=(3, 4))
    plan = [("padded", [i]) for i in range(len(group.suffixes))]
    full_sequence_backward(model, group)
    expected = gradients(model)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(hf_prefixflow.core.kv_cache, "StreamedTensor", broken)
    hf_prefixflow.apply_prefixflow(model, offload_kv=True)
    prefixflow_backward(model, group, plan)
    with pytest.raises(AssertionError):
        assert_same_gradients(gradients(model), expected)


def test_parallel_rules_that_move_kv_refuse_it():
    from hf_prefixflow.distributed import pipeline, placement, ulysses

    model = hf_prefixflow.apply_prefixflow(build("llama").train(), offload_kv=True)
    prefix = torch.arange(6)
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="offload_kv is not available with Ulysses"):
        ulysses.check_model(model, 2)
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="offload_kv is not available with pipeline stages"):
        pipeline.train_group(model, prefix, prefix[None], torch.ones(1, 6), lambda *a: None, 1)
    with hf_prefixflow.GroupSession(model) as session, \
            pytest.raises(hf_prefixflow.PrefixFlowError, match="offload_kv is not available with groups split"):
        placement.open_split(session, prefix, [0, 1])


def test_a_streamed_group_leaves_nothing_behind(monkeypatch):
    """Each streamed tensor's Phase-C handle refers back to it through its autograd node: freed with the group, after
    Phase C or after a failed wave."""
    created = []
    init = StreamedTensor.__init__
    monkeypatch.setattr(StreamedTensor, "__init__",
                        lambda self, *args: init(self, *args) or created.append(weakref.ref(self)))
    gen = torch.Generator().manual_seed(8)
    model = hf_prefixflow.apply_prefixflow(build("qwen3", num_hidden_layers=3).train(), offload_kv=True)
    group = random_group(gen, prefix=(12, 16), n=(2, 3))
    prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    with pytest.raises(RuntimeError, match="a wave fails"):
        with hf_prefixflow.prefix_group(model, group.prefix) as g:
            g(group.suffixes[0][None])
            raise RuntimeError("a wave fails")
    gc.collect()
    assert len(created) == 12 and not [r for r in created if r() is not None]
    pool = hf_prefixflow.core.access.unwrap(model)._prefixflow_pool
    assert pool._out == 0  # every parked buffer returned


def test_the_host_sum_widens_with_a_wider_gradient_and_refuses_a_late_one():
    """A bf16 sum that meets an fp32 gradient (mixed kernels under autocast) goes on in fp32, as the device-resident
    sum does; a wave whose backward comes after its group closed is refused, not lost."""
    host = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"))
    live = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True) * 1
    streamed = StreamedTensor(live, torch.bfloat16, host, [])
    for grad in (torch.ones(1, 2, 3, 4, dtype=torch.bfloat16), torch.full((1, 2, 3, 4), 1e-3)):
        streamed.accumulate(grad)
    total = host.load(streamed.grad)
    assert total.dtype == torch.float32 and torch.equal(total, torch.ones(1, 2, 3, 4) + 1e-3)  # not rounded to bf16
    streamed.release()
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="after its prefix group closed"):
        streamed.accumulate(torch.ones(1, 2, 3, 4))
    host.release()


def test_the_planner_counts_the_kv_a_wave_keeps_with_its_activations():
    from hf_prefixflow.planning import planner

    tokens = planner.token_bytes(build("llama", num_hidden_layers=4).config, dtype=torch.bfloat16)
    args = (tokens, 0.0, 4096, 256, 2, "full", True, 1.0)
    offloaded = planner.prefixflow_peaks(*args, False)[3]
    streamed_kept = planner.prefixflow_peaks(*args, False, True)[3]
    streamed = planner.prefixflow_peaks(*args, True, True)[3]
    assert streamed_kept["prefix"] == offloaded["prefix"] > streamed["prefix"]
