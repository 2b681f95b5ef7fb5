"""Prefix activation offload: gradients with it on equal those with it off; buffers return to the pool."""

import gc
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_prefixflow import _compat
import hf_prefixflow
from equivalence import gradients, prefixflow_backward, random_group, random_plan
from models import build


def _setup(family, lora=False, checkpointing=False):
    model = build(family).train()
    if checkpointing:
        _compat.enable_checkpointing(model)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).double()
    return hf_prefixflow.apply_prefixflow(model)


@pytest.mark.parametrize("family,lora,checkpointing", [("llama", False, False), ("gemma2", False, False),
                                                       ("qwen3", True, False), ("mistral", False, True),
                                                       ("llama", False, True)])  # every layer's attention replayed
def test_offload_changes_nothing_but_where_tensors_wait(family, lora, checkpointing, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    model = _setup(family, lora, checkpointing)
    group = random_group(gen, prefix=(12, 24), n=(2, 5))
    plan = random_plan(gen, len(group.suffixes))
    prefixflow_backward(model, group, plan)
    expected = gradients(model)
    model.zero_grad(set_to_none=True)

    offloads = []
    original = hf_prefixflow.core.scheduler.PrefixGroup._offloader
    monkeypatch.setattr(hf_prefixflow.core.scheduler.PrefixGroup, "_offloader",
                        lambda self: offloads.append(original(self)) or offloads[-1])
    hf_prefixflow.apply_prefixflow(model, offload=True, prefix_recompute=0.5)  # one path per layer: copied, recomputed
    prefixflow_backward(model, group, plan)
    for name, grad in gradients(model).items():
        assert torch.equal(grad, expected[name]), name  # restored tensors: same values, same layouts
    (offload,) = offloads
    assert offload.offloaded_bytes > 0 and not offload.entries
    pool = hf_prefixflow.core.access.unwrap(model)._prefixflow_pool
    assert pool.free and pool.allocated_bytes >= offload.offloaded_bytes


def _recorded_packs(monkeypatch) -> list:
    """(saved tensor, what the offloader packed it as) for every save while the hooks are on."""
    packs = []
    pack = hf_prefixflow.core.offload.PrefixOffload.pack
    monkeypatch.setattr(hf_prefixflow.core.offload.PrefixOffload, "pack",
                        lambda self, t: packs.append((t, pack(self, t))) or packs[-1][1])
    return packs


def test_offload_skips_parameters_and_the_cached_kv_and_copies_shared_saves_once(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    model = hf_prefixflow.apply_prefixflow(build("llama").train(), offload=True, prefix_recompute=0)
    group = random_group(gen, prefix=(10, 16), n=(2, 3))
    packs = _recorded_packs(monkeypatch)
    with hf_prefixflow.prefix_group(model, group.prefix) as g:
        live = {id(t.live) for t in g.cache.tensors()}
        params = {id(p) for p in model.parameters()}
        offloaded = [(t, e) for t, e in packs if isinstance(e, hf_prefixflow.core.offload.Offloaded)]
        assert offloaded and not any(id(t) in live | params for t, _ in offloaded)
        copies = {id(e): e for _, e in offloaded}
        assert len(copies) < len(offloaded)
        assert any(e.saves >= 3 for e in copies.values())  # q, k and v projections read one layer input
        g(group.suffixes[0][None]).logits.sum().backward()
    second = hf_prefixflow.core.access.unwrap(model)._prefixflow_pool.allocated_bytes
    with hf_prefixflow.prefix_group(model, group.prefix) as g:  # the same shapes reuse the pool's buffers
        g(group.suffixes[0][None]).logits.sum().backward()
    assert hf_prefixflow.core.access.unwrap(model)._prefixflow_pool.allocated_bytes == second


def test_an_exception_returns_every_buffer():
    gen = torch.Generator().manual_seed(2)
    model = hf_prefixflow.apply_prefixflow(build("qwen2").train(), offload=True)
    group = random_group(gen, prefix=(10, 16), n=(2, 3))
    with pytest.raises(RuntimeError, match="boom"):
        with hf_prefixflow.prefix_group(model, group.prefix) as g:
            g(group.suffixes[0][None]).logits.sum().backward()
            raise RuntimeError("boom")
    pool = hf_prefixflow.core.access.unwrap(model)._prefixflow_pool
    assert pool.allocated_bytes > 0 and g.offload.entries == []
    assert sum(b.numel() for b in pool.free) == pool.allocated_bytes


def test_autocast_weight_copies_stay():
    model = build("llama", dtype=torch.float32).train()
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"))
    weight = model.lm_head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = weight.to(torch.bfloat16)
        activation = torch.randn(4, 4, requires_grad=True) * 2
    assert not offload._eligible(cast) and not offload._eligible(weight) and offload._eligible(activation)


def test_checkpointed_layer_inputs_are_offloaded(monkeypatch):
    """Non-reentrant checkpointing saves each layer's input outside its own hooks, so the prefix hooks see them."""
    gen = torch.Generator().manual_seed(3)
    model = _setup("llama", checkpointing=True)
    group = random_group(gen, prefix=(12, 16), n=(2, 3))
    plan = random_plan(gen, len(group.suffixes))
    prefixflow_backward(model, group, plan)
    expected = gradients(model)
    model.zero_grad(set_to_none=True)

    hf_prefixflow.apply_prefixflow(model, offload=True)
    inputs, packed = [], []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]) if args else None)
    pack = hf_prefixflow.core.offload.PrefixOffload.pack
    monkeypatch.setattr(hf_prefixflow.core.offload.PrefixOffload, "pack",
                        lambda self, t: packed.append((t, self._eligible(t))) or pack(self, t))
    prefixflow_backward(model, group, plan)
    layers = len(model.model.layers)
    phase_a_inputs = inputs[:layers]  # Phase A runs first; later entries are waves and Phase C recomputes
    offloaded = {id(t) for t, eligible in packed if eligible}
    assert len(phase_a_inputs) == layers and all(id(t) in offloaded for t in phase_a_inputs)
    for name, grad in gradients(model).items():
        assert torch.equal(grad, expected[name]), name


def test_restored_tensors_die_after_use(monkeypatch):
    """Restored tensors must not outlive their last use: held until the end of Phase C, they would put the whole
    prefix activation stack back on the device at once."""
    gen = torch.Generator().manual_seed(2)
    model = hf_prefixflow.apply_prefixflow(build("llama").train(), offload=True, prefix_recompute=0)
    group = random_group(gen, prefix=(12, 16), n=(2, 3))
    restored, alive_at_release, offloads = [], [], []
    offload_cls = hf_prefixflow.core.offload.PrefixOffload
    unpack, release = offload_cls.unpack, offload_cls.release

    def tracking_unpack(self, packed):
        out = unpack(self, packed)
        if isinstance(packed, hf_prefixflow.core.offload.Offloaded):
            restored.append((weakref.ref(out), packed))
        return out

    def checking_release(self):
        offloads.append(self)
        # A copy shared by saves whose backward never runs (the last layer's query path) waits for release.
        alive_at_release.extend(ref for ref, entry in restored if ref() is not None and entry.consumed)
        release(self)

    monkeypatch.setattr(offload_cls, "unpack", tracking_unpack)
    monkeypatch.setattr(offload_cls, "release", checking_release)
    prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    (offload,) = offloads
    assert restored and offload.offloaded_bytes > 0
    assert not alive_at_release, f"{len(alive_at_release)} of {len(restored)} restored tensors outlived Phase C"



@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("share,recomputed", [(0.0, []), (0.25, [3]), (0.5, [1, 3]), (1.0, [0, 1, 2, 3])])
def test_a_share_of_prefix_layers_is_recomputed_not_copied_back(share, recomputed, offload):
    """Phase C recomputes the chosen layers (the last one first), from their offloaded inputs or, without offload,
    from their inputs on the device, with the same gradients; the other layers' activations come back from the host
    (or stay), and the layers are restored after Phase A. With offload the recompute replays each layer's attention
    from Phase A (the kernel runs once per layer); without, it reruns it."""
    gen = torch.Generator().manual_seed(int(share * 8))
    model = hf_prefixflow.apply_prefixflow(build("qwen3", num_hidden_layers=4).train())
    group = random_group(gen, prefix=(12, 20), n=(2, 4))
    plan = random_plan(gen, len(group.suffixes))
    prefixflow_backward(model, group, plan)
    expected = gradients(model)
    model.zero_grad(set_to_none=True)

    hf_prefixflow.apply_prefixflow(model, offload=offload, prefix_recompute=share)
    calls, prefix_kernel_runs = [], []
    for index, layer in enumerate(model.model.layers):  # a recompute reruns the layer's forward, not its hooks
        layer.self_attn.k_proj.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
    cpu = hf_prefixflow.core.split_attention.CPU

    def counting_forward(q, k, v, causal, scale):
        if causal and q.shape[0] == 1 and q.shape[2] == k.shape[2] == len(group.prefix) - 1:
            prefix_kernel_runs.append(len(calls))
        return cpu.forward(q, k, v, causal, scale)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_prefixflow.core.split_attention, "CPU", hf_prefixflow.core.split_attention.Kernel(
            "counting", counting_forward, cpu.backward))
        prefixflow_backward(model, group, plan)
    layers = len(model.model.layers)
    waves = len(plan)
    assert calls[:layers] == list(range(layers))  # Phase A
    assert calls[layers * (1 + waves):] == recomputed[::-1]  # Phase C: only the recomputed layers, last one first
    replayed = recomputed if offload else []  # the layers whose Phase-A attention ran through the kept kernel
    assert len(prefix_kernel_runs) == len(replayed) and all(run <= layers for run in prefix_kernel_runs)
    assert not any(layer.gradient_checkpointing or "_gradient_checkpointing_func" in vars(layer)
                   for layer in model.model.layers)
    for name, grad in gradients(model).items():
        assert torch.equal(grad, expected[name]), name


def test_recomputed_layers_leave_fewer_bytes_to_copy():
    """A recomputed layer leaves only its input on the host: the more layers recomputed, the fewer bytes move."""
    moved = []
    for share in (0.0, 0.5, 1.0):
        gen = torch.Generator().manual_seed(5)
        model = hf_prefixflow.apply_prefixflow(build("llama", num_hidden_layers=4).train(), offload=True,
                                               prefix_recompute=share)
        group = random_group(gen, prefix=(16, 17), n=(2, 3))
        offloads = []
        original = hf_prefixflow.core.scheduler.PrefixGroup._offloader
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hf_prefixflow.core.scheduler.PrefixGroup, "_offloader",
                          lambda self: offloads.append(original(self)) or offloads[-1])
            prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
        moved.append(offloads[0].offloaded_bytes)
    assert moved[0] > moved[1] > moved[2] > 0


def test_recompute_share_out_of_range_is_refused():
    with pytest.raises(hf_prefixflow.PrefixFlowError, match=r"prefix_recompute.*\[0, 1\]"):
        hf_prefixflow.apply_prefixflow(build("llama").train(), offload=True, prefix_recompute=1.5)


def test_prefetch_runs_about_two_layers_ahead():
    """Phase C brings back about `PREFETCH_LAYERS` layers' worth ahead of need, not the whole stack: a fixed byte
    window held every layer input of a short prefix on the device at once (the SP=2 memory trace)."""
    gen = torch.Generator().manual_seed(6)
    model = hf_prefixflow.apply_prefixflow(build("llama", num_hidden_layers=6).train(), offload=True,
                                           prefix_recompute=0)
    group = random_group(gen, prefix=(20, 24), n=(2, 3))
    ahead, offloads = [], []
    offload_cls = hf_prefixflow.core.offload.PrefixOffload
    unpack = offload_cls.unpack

    def measuring_unpack(self, packed):
        out = unpack(self, packed)
        offloads.append(self)
        ahead.append(sum(e.host.numel() for e in self.entries if e.device_copy is not None and not e.unpacked))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload_cls, "unpack", measuring_unpack)
        prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    offload = offloads[0]
    layer_bytes = offload.offloaded_bytes / 6
    assert ahead and max(ahead) > 0
    # the window, the rest of the current layer, and saves that autograd unpacks a little out of reverse order
    assert max(ahead) <= (hf_prefixflow.core.offload.PREFETCH_LAYERS + 2) * layer_bytes < offload.offloaded_bytes


def test_prefetch_window_counts_layers_when_only_some_are_copied():
    """With some layers recomputed, a copied layer holds most of the bytes: every unpack must already have started
    the next `PREFETCH_LAYERS` layers' copies (a window of average layer bytes fell short of one copied layer) and
    nothing beyond them."""
    gen = torch.Generator().manual_seed(7)
    model = hf_prefixflow.apply_prefixflow(build("llama", num_hidden_layers=8).train(), offload=True,
                                           prefix_recompute=0.5)
    group = random_group(gen, prefix=(20, 24), n=(2, 3))
    offload_cls = hf_prefixflow.core.offload.PrefixOffload
    unpack, checked = offload_cls.unpack, []
    window = hf_prefixflow.core.offload.PREFETCH_LAYERS

    def checking_unpack(self, packed):
        out = unpack(self, packed)
        if isinstance(packed, hf_prefixflow.core.offload.Offloaded):
            reached = min(e.layer for e in self.entries if e.unpacked)
            waiting = [e for e in self.entries[:packed.index] if not e.consumed]
            assert all(e.device_copy is not None for e in waiting if e.layer >= packed.layer - window)
            assert all(e.layer >= reached - window for e in waiting if e.device_copy is not None)
            checked.append(packed.layer)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload_cls, "unpack", checking_unpack)
        prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    assert len(set(checked)) >= 6


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_a_group_leaves_no_prefix_graph_behind(share, monkeypatch):
    """Saves the offloader passes through (small ones, on a GPU below 1 MiB) must not pin the prefix graph: a node
    that saves its own output (rsqrt) and got that output back from the pack hook formed a cycle through C++, so
    every group leaked the graph's unexecuted tail, with Phase C's recomputed tensors (0.86 GiB a group measured at
    10k tokens on an H200)."""
    eligible = hf_prefixflow.core.offload.PrefixOffload._eligible
    monkeypatch.setattr(hf_prefixflow.core.offload.PrefixOffload, "_eligible",
                        lambda self, t: eligible(self, t) and t.numel() >= 64)  # as a GPU's size threshold
    packed = []
    pack = hf_prefixflow.core.offload.PrefixOffload.pack
    monkeypatch.setattr(hf_prefixflow.core.offload.PrefixOffload, "pack",
                        lambda self, t: packed.append(pack(self, t)) or packed[-1])
    gen = torch.Generator().manual_seed(7)
    model = hf_prefixflow.apply_prefixflow(build("qwen3", num_hidden_layers=3).train(), offload=True,
                                           prefix_recompute=share)
    group = random_group(gen, prefix=(16, 24), n=(2, 3))
    prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    entries = [weakref.ref(p) for p in packed if isinstance(p, hf_prefixflow.core.offload.Offloaded)]
    passed = [p for p in packed if isinstance(p, hf_prefixflow.core.offload.Stayed)]
    assert entries and passed  # both paths ran
    del packed[:], passed
    gc.collect()
    assert not [r for r in entries if r() is not None], "offloaded saves outlived their group"


def test_a_restored_tensor_keeps_its_layout():
    """Saved tensors come back with the strides they left with (a kernel's backward may read its output only in the
    layout its forward returned), or contiguous when their elements do not fill their span."""
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"))
    base = torch.randn(2, 5, 3, 4)
    for tensor in (base.transpose(1, 2), base.permute(3, 0, 2, 1)):
        restored = offload.unpack(offload.pack(tensor))
        assert torch.equal(restored, tensor) and restored.stride() == tensor.stride() and not restored.is_contiguous()
    expanded = base[:, :, :1].expand(2, 5, 3, 4)
    restored = offload.unpack(offload.pack(expanded))
    assert torch.equal(restored, expanded) and restored.is_contiguous()


def test_replayed_attention_gets_its_output_in_phase_a_layout(monkeypatch):
    """Restored contiguous (as offload once restored every tensor), Phase A's attention output still reaches the
    kernel's backward in the layout that kernel's forward returned."""
    monkeypatch.setattr(hf_prefixflow.core.offload, "_layout", lambda tensor: torch.empty(tensor.shape).stride())
    gen = torch.Generator().manual_seed(8)
    model = hf_prefixflow.apply_prefixflow(build("llama", num_hidden_layers=3).train())
    group = random_group(gen, prefix=(12, 20), n=(2, 3))
    prefix = len(group.prefix) - 1  # the cached tokens: Phase A's attention runs over these
    forward_strides, forward_shapes, backward_strides = set(), [], []
    cpu = hf_prefixflow.core.split_attention.CPU

    def recording_forward(q, k, v, causal, scale):
        out, lse, state = cpu.forward(q, k, v, causal, scale)
        if q.shape[2] == prefix:
            forward_strides.add(out.stride())
            forward_shapes.append((out.shape, out.stride()))
        return out, lse, state

    def recording_backward(grad, q, k, v, out, lse, causal, scale, state):
        if q.shape[2] == prefix:
            backward_strides.append(out.stride())
        return cpu.backward(grad, q, k, v, out, lse, causal, scale, state)

    monkeypatch.setattr(hf_prefixflow.core.split_attention, "CPU",
                        hf_prefixflow.core.split_attention.Kernel("recording", recording_forward, recording_backward))
    hf_prefixflow.apply_prefixflow(model, offload=True)
    prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
    # the last layer's prefix attention feeds only the prefix output, which nothing reads: no backward
    assert len(backward_strides) == len(model.model.layers) - 1
    assert set(backward_strides) <= forward_strides and all(
        stride != torch.empty(shape).stride() for shape, stride in forward_shapes)  # a layout the patch would lose


def test_the_pool_reuses_buffers_that_fit_and_frees_the_unused():
    """Prompts of changing lengths: a tensor takes the smallest free buffer it fills at least half of; once every
    buffer is back, those no tensor took in the last two trims are freed, so the pool neither grows without bound nor
    reallocates each group (or each turn of two configurations)."""
    pool = hf_prefixflow.core.offload.HostPool(pin=False)
    small, large = pool.take(100), pool.take(300)
    pool.give(large)
    pool.give(small)
    pool.trim()
    assert pool.allocated_bytes == 400 and [b.numel() for b in pool.free] == [100, 300]
    assert pool.take(80) is small and pool.take(200) is large  # best fit, at most twice the request
    extra = pool.take(90)  # nothing free fits: a new buffer
    assert extra.numel() == 90 and pool.allocated_bytes == 490
    pool.give(small)
    pool.give(large)
    pool.trim()  # `extra` is still out (another group of the session is open): nothing is freed
    assert pool.allocated_bytes == 490 and len(pool.free) == 2
    pool.give(extra)
    pool.trim()  # all three were taken since the last trim
    assert pool.allocated_bytes == 490
    taken = pool.take(60)
    assert taken is extra  # the smallest that holds it
    pool.give(taken)
    pool.trim()  # `small` and `large` went untaken in one trim: kept
    assert pool.allocated_bytes == 490
    pool.give(pool.take(70))
    pool.trim()  # and in a second: freed
    assert [b.numel() for b in pool.free] == [90] and pool.allocated_bytes == 90


def test_groups_closed_one_by_one_keep_each_other_s_buffers():
    gen = torch.Generator().manual_seed(8)
    model = hf_prefixflow.apply_prefixflow(build("qwen3").train(), offload=True, prefix_recompute=0.5)
    groups = [random_group(gen, prefix=(18, 18), suffix=(3, 3), n=(2, 2)) for _ in range(2)]
    pool_bytes, offloaded = [], []
    for _ in range(2):
        with hf_prefixflow.GroupSession(model) as session:
            opened = [session.open(group.prefix) for group in groups]
            for group, prefix_group in zip(groups, opened):
                prefix_group(torch.stack(group.suffixes)).logits.sum().backward()
            for prefix_group in opened:  # closed one by one
                session.close([prefix_group])
        pool_bytes.append(hf_prefixflow.core.access.unwrap(model)._prefixflow_pool.allocated_bytes)
        offloaded.append(sum(g.offload.offloaded_bytes for g in opened))
    assert pool_bytes[0] >= offloaded[0] > 0  # both groups' buffers stay for the next round
    assert pool_bytes[1] == pool_bytes[0]  # which reuses them


def test_groups_of_changing_prompt_lengths_keep_the_pool_bounded():
    gen = torch.Generator().manual_seed(9)
    model = hf_prefixflow.apply_prefixflow(build("qwen3").train(), offload=True, prefix_recompute=0.5)
    sizes = []
    for length in (24, 20, 23, 17, 24, 21, 8, 7):
        group = random_group(gen, prefix=(length, length), n=(2, 2))
        prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
        sizes.append(hf_prefixflow.core.access.unwrap(model)._prefixflow_pool.allocated_bytes)
    assert max(sizes[2:6]) <= 2 * sizes[0], sizes  # shorter prompts reuse the first group's buffers
    assert sizes[-1] < sizes[5] / 2, sizes  # prompts under half as long: the long ones' buffers are freed


def test_a_failed_pack_still_returns_its_buffer(monkeypatch):
    pool = hf_prefixflow.core.offload.HostPool(pin=False)
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"), pool)
    monkeypatch.setattr(hf_prefixflow.core.offload.Offloaded, "host_view", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        offload.pack(torch.randn(4))
    offload.release()
    assert pool._out == 0 and len(pool.free) == 1


def test_a_layer_replayed_twice_is_refused():
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"))
    replay = hf_prefixflow.core.recompute.AttentionReplay({0}, offload)
    out, lse = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    replay.keep(0, out, lse, (), None)
    assert torch.equal(replay.take(0)[0], out)
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="ran again after its Phase-C replay"):
        replay.keep(0, out, lse, (), None)


@pytest.mark.parametrize("min_bytes", [0, 1 << 30])  # copied to the host, or left where it is
def test_a_saved_tensor_modified_in_place_is_refused(min_bytes):
    """Autograd refuses a saved tensor modified in place before its backward; the hooks bypass its check, so the
    offloader makes its own (the host copy would be stale, or on a GPU race the in-place write)."""
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"), min_bytes=min_bytes)
    x = torch.randn(8, requires_grad=True)
    with offload.hooks():
        y = x * 2
        z = y.sin()  # saves y
    y.add_(0.0)  # an in-place op: y's version moves, its values do not
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="modified by an in-place operation"):
        z.sum().backward()


def test_conjugate_views_are_not_shared_copies():
    offload = hf_prefixflow.core.offload.PrefixOffload(torch.device("cpu"))
    x = torch.randn(4, dtype=torch.complex64)
    first, second = offload.pack(x), offload.pack(x.conj())
    assert first is not second
    assert torch.equal(offload.unpack(second), x.conj()) and torch.equal(offload.unpack(first), x)


def test_page_locked_buffers_are_the_size_asked_and_go_back_to_the_host(monkeypatch):
    """Pinned buffers are plain host memory registered in place (torch's pinned allocator rounds every request up to
    a power of two and keeps it cached): page-aligned, whole pages, unregistered when trimmed or closed."""
    page = hf_prefixflow.core.offload.PAGE_BYTES
    registered = {}

    def register(buffer):
        registered[buffer.data_ptr()] = buffer.numel()
        return 0

    monkeypatch.setattr(hf_prefixflow._compat, "register_host_memory", register)
    monkeypatch.setattr(hf_prefixflow._compat, "unregister_host_memory", lambda buffer: registered.pop(
        buffer.data_ptr()) and 0)
    pool = hf_prefixflow.core.offload.HostPool(pin=True)
    first, second = pool.take(5 * page - 7), pool.take(3 * page)
    assert [first.numel(), second.numel()] == [5 * page, 3 * page]  # not 8 and 4 pages
    assert {first.data_ptr() % page, second.data_ptr() % page} == {0}  # no page shared by two registrations
    assert registered == {first.data_ptr(): 5 * page, second.data_ptr(): 3 * page}
    assert pool.allocated_bytes == pool.peak_bytes == 10 * page  # a page of alignment slack each
    pool.give(first)
    pool.give(second)
    pool.trim()
    assert pool.take(3 * page) is second and len(registered) == 2
    pool.give(second)
    pool.trim()
    pool.give(pool.take(3 * page))
    pool.trim()  # `first` went untaken in two trims: unregistered and freed
    assert registered == {second.data_ptr(): 3 * page} and pool.allocated_bytes == 4 * page
    taken = pool.take(page)
    pool.close()  # a buffer still taken is unregistered too, and forgotten when given back
    assert registered == {} and pool.allocated_bytes == 0 and pool.peak_bytes == 10 * page
    pool.give(taken)
    assert pool.free == [] and pool.pin_fallbacks == 0


def test_a_failed_registration_falls_back_to_torch_s_pinned_buffers(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(hf_prefixflow._compat, "register_host_memory", lambda buffer: calls.append(buffer) or 2)
    monkeypatch.setattr(hf_prefixflow.core.offload, "_pinned_by_torch",
                        lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    pool = hf_prefixflow.core.offload.HostPool(pin=True)
    with caplog.at_level("WARNING", logger="hf_prefixflow.core.offload"):
        first, second = pool.take(3000), pool.take(5000)
    assert "cudaHostRegister failed (CUDA error 2)" in caplog.text
    assert len(calls) == 1 and pool.pin_fallbacks == 2  # tried once, then torch's allocator for every buffer
    assert [first.numel(), second.numel()] == [3000, 5000] and pool.allocated_bytes == 4096 + 8192  # its rounding


@pytest.mark.parametrize("cgroup_limit, expected", [(None, 1000 * 1024), ("max", 1000 * 1024),
                                                   (str(600 * 1024), 500 * 1024)])
def test_available_host_memory_reads_the_container_s_limit(tmp_path, monkeypatch, cgroup_limit, expected):
    """MemAvailable is the node's; a container's cgroup caps what the process may take (limit less use)."""
    (tmp_path / "meminfo").write_text("MemTotal: 4000 kB\nMemFree: 900 kB\nMemAvailable: 1000 kB\n")
    monkeypatch.setattr(hf_prefixflow.core.offload, "MEMINFO", str(tmp_path / "meminfo"))
    files = (str(tmp_path / "memory.max"), str(tmp_path / "memory.current"))
    monkeypatch.setattr(hf_prefixflow.core.offload, "CGROUP_MEMORY", (files,))
    if cgroup_limit is not None:
        (tmp_path / "memory.max").write_text(cgroup_limit + "\n")
        (tmp_path / "memory.current").write_text(str(100 * 1024) + "\n")
    assert hf_prefixflow.core.offload.available_host_bytes() == expected
    monkeypatch.setattr(hf_prefixflow.core.offload, "MEMINFO", str(tmp_path / "absent"))
    assert hf_prefixflow.core.offload.available_host_bytes() is None


def test_a_failed_registration_leaves_no_cuda_error_pending(monkeypatch):
    """torch raises a CUDA error a failed call left pending at its next kernel launch, whichever: the failed
    registration consumes it at once."""
    consumed = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("Runtime", (), {
        "cudaHostRegister": staticmethod(lambda ptr, size, flags: 801),
        "cudaHostUnregister": staticmethod(lambda ptr: 0)}))
    monkeypatch.setattr(_compat, "consume_cuda_error", lambda: consumed.append(1))
    assert _compat.register_host_memory(torch.empty(4096, dtype=torch.uint8)) == 801 and consumed == [1]
    assert _compat.unregister_host_memory(torch.empty(4096, dtype=torch.uint8)) == 0 and consumed == [1]


def test_an_empty_request_is_not_registered_and_a_collected_pool_unregisters(monkeypatch):
    registered = set()
    monkeypatch.setattr(_compat, "register_host_memory", lambda buffer: registered.add(buffer.data_ptr()) or 0)
    monkeypatch.setattr(_compat, "unregister_host_memory", lambda buffer: registered.discard(buffer.data_ptr()) or 0)
    pool = hf_prefixflow.core.offload.HostPool(pin=True)
    assert pool.take(0).numel() == 0 and not registered and pool.pin_fallbacks == 0  # CUDA refuses zero bytes
    pool.take(5000)
    assert len(registered) == 1
    del pool
    gc.collect()
    assert not registered
