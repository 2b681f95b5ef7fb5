"""torch.compile'd decoder layers: one compiled graph serves every layer, and training equals the full-sequence path."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile

import hf_prefixflow
from equivalence import prefixflow_backward, random_group, train_side_by_side
from hf_prefixflow.core import recompute
from hf_prefixflow.core.attention import RECOMPILE_LIMIT
from hf_prefixflow.core.access import decoder_of
from hf_prefixflow.core.recompute import decoder_layers
from models import build

LAYERS = 10  # more than torch.compile's recompile limit (8): a graph per layer would send layers back to eager


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    # Past the limit dynamo logs one warning and runs the remaining calls eagerly; here that fails the test.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def poisoned_discard(monkeypatch):
    """The recompute's discarded projection returns NaN: a layer that read it would poison the gradients."""
    forward = recompute._DiscardedProduct.forward

    def poisoned(ctx, x, weight, bias):
        return torch.full_like(forward(ctx, x, weight, bias), float("nan"))

    monkeypatch.setattr(recompute._DiscardedProduct, "forward", staticmethod(poisoned))


def compiled(offload: bool, prefix_recompute: float | None = None):
    def prepare(model):
        for layer in decoder_layers(decoder_of(model)):
            layer.compile(backend="aot_eager")  # dynamo and autograd as inductor sees them, no C++ toolchain needed
        hf_prefixflow.apply_prefixflow(model, offload=offload, prefix_recompute=prefix_recompute)

    return prepare


# offload: False, True or the share of prefix layers recomputed. qwen3 recomputes half: the others' Phase-A calls
# then differ from a Phase-C recompute only in the discarded projection's class. Frozen embeddings (the first
# layer's input needs no gradient, its weights do, as with PEFT adapters) and a recompute share below 1 need more
# variants of one graph than torch's default limit (see `attention.RECOMPILE_LIMIT`, which the trainer sets).
@pytest.mark.parametrize("family,offload,frozen_embeddings,raised_limit", [
    ("llama", False, False, False), ("qwen3", 0.5, False, True), ("qwen3_moe", True, False, False),
    ("llama", True, True, True)])
def test_compiled_layers_train_like_the_full_sequence(family, offload, frozen_embeddings, raised_limit, fresh_dynamo,
                                                      monkeypatch, poisoned_discard):
    gen = torch.Generator().manual_seed(3)
    groups = [random_group(gen, prefix=(8, 16), suffix=(3, 6), n=(3, 4)) for _ in range(2)]  # the 2nd reuses graphs
    plans = [[("padded", list(range(len(group.suffixes))))] for group in groups]
    model = build(family, num_hidden_layers=LAYERS).train()
    model.get_input_embeddings().weight.requires_grad_(not frozen_embeddings)
    limit = RECOMPILE_LIMIT if raised_limit else torch._dynamo.config.recompile_limit
    hf_prefixflow.apply_prefixflow(build(family, num_hidden_layers=LAYERS))  # its probe's eager layers, run before
    eager_runs = _count_eager_runs(monkeypatch, model)
    # With offload, the recomputed prefix layers are PrefixFlow's own recompute, compiled like the rest.
    share = offload if offload not in (False, True) else None
    with torch._dynamo.config.patch(recompile_limit=limit):
        train_side_by_side(model, groups, plans, prepare=compiled(bool(offload), share))
    rows = sum(len(g.suffixes) for g in groups)
    assert eager_runs == {"reference": LAYERS * rows, "prefixflow": 0}  # the reference runs eagerly: the count works


def _count_eager_runs(monkeypatch, reference) -> dict:
    """Eager calls of the decoder layers' MLP forward, in `reference` and in its copies; inside a compiled graph,
    dynamo only traced the forward."""
    counts = {"reference": 0, "prefixflow": 0}
    layers = decoder_layers(decoder_of(reference))
    mlps = {id(layer.mlp) for layer in layers}
    mlp_type = type(layers[0].mlp)
    forward = mlp_type.forward

    def counting(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            counts["reference" if id(self) in mlps else "prefixflow"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(mlp_type, "forward", counting)
    return counts


def test_compiled_recompute_leaves_out_the_last_projection(fresh_dynamo, monkeypatch):
    """Phase C's recompute of a compiled Llama layer runs one matrix multiply fewer than the plain recompute: the MLP's
    down projection, whose output only feeds the discarded layer output."""
    gen = torch.Generator().manual_seed(5)
    group = random_group(gen, prefix=(12, 12), suffix=(4, 4), n=(2, 2))
    model = build("llama", num_hidden_layers=3).train()
    compiled(offload=True)(model)

    def phase_c_matmuls() -> int:
        scope = hf_prefixflow.prefix_group(model, group.prefix)
        scope.__enter__()(torch.stack(group.suffixes)).logits.sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            scope.__exit__(None, None, None)  # Phase C
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))

    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        leaner = [phase_c_matmuls() for _ in range(2)][-1]  # the first group also compiles
        monkeypatch.setattr(recompute, "RESIDUAL_MLP_LAYERS", frozenset())
        assert [phase_c_matmuls() for _ in range(2)][-1] - leaner == 3


def test_a_layer_that_reads_its_mlp_output_is_not_discardable(fresh_dynamo, monkeypatch, poisoned_discard):
    """Gemma2 normalises the MLP output before the residual sum: listed as discardable, its recompute would read the
    (poisoned) discarded projection, and training must then differ from the full-sequence path."""
    gen = torch.Generator().manual_seed(6)
    groups = [random_group(gen, prefix=(8, 12), suffix=(3, 5), n=(2, 3))]
    model = build("gemma2", num_hidden_layers=2).train()
    monkeypatch.setattr(recompute, "RESIDUAL_MLP_LAYERS",
                        frozenset({("transformers.models.gemma2.modeling_gemma2", "Gemma2DecoderLayer")}))
    with pytest.raises(AssertionError, match="nan"), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        train_side_by_side(model, groups, [[("padded", list(range(len(groups[0].suffixes))))]],
                           prepare=compiled(offload=True))


@pytest.mark.parametrize("autocast", [False, True])
def test_discarded_linear_has_the_linear_s_gradients(autocast):
    """Everything but the output's values: its shape and dtype, and the gradients of input, weight and bias, also
    under autocast with fp32 weights (the linear's inputs cast as autocast casts them)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    linear = torch.nn.Linear(8, 4)
    results = []
    for cls in (torch.nn.Linear, recompute.DiscardedLinear):
        linear.__class__ = cls
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = linear(x)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out.dtype)
        grads = torch.autograd.grad(out, [x, linear.weight, linear.bias], grad)
        results.append((out.shape, out.dtype, grads))
    (shape, dtype, expected), (shape_d, dtype_d, actual) = results
    assert (shape_d, dtype_d) == (shape, dtype)
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_recompute_runs_under_phase_a_autocast(fresh_dynamo):
    """fp32 weights under bf16 autocast, Phase C outside it (as the trainer runs it): the recompute runs under Phase
    A's autocast again, so offload gives the gradients PrefixFlow gives without it (to bf16 rounding)."""
    gen = torch.Generator().manual_seed(9)
    group = random_group(gen, prefix=(10, 10), suffix=(4, 4), n=(2, 2))
    model = build("llama", dtype=torch.float32, num_hidden_layers=2).train()

    def gradients(offload: bool) -> dict:
        candidate = copy.deepcopy(model)
        compiled(offload)(candidate)
        scope = hf_prefixflow.prefix_group(candidate, group.prefix)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = scope.__enter__()(torch.stack(group.suffixes)).logits  # Phase A and the wave
        logits.float().square().mean().backward()
        scope.__exit__(None, None, None)  # Phase C
        return {name: p.grad for name, p in candidate.named_parameters()}

    expected, actual = gradients(offload=False), gradients(offload=True)
    for name, grad in expected.items():  # the paper's bf16 tolerance, relative to the expected value
        torch.testing.assert_close(actual[name], grad, rtol=1e-2, atol=1e-3, msg=name)


def test_compiled_recompute_replays_with_phase_a_kernel(fresh_dynamo, monkeypatch):
    """Phase C's context may pick another attention kernel than Phase A's (a user's `sdpa_kernel` block around the
    waves only): the replay still runs the backward of the kernel whose output and log-sum-exp it replays."""
    from hf_prefixflow.core import split_attention

    gen = torch.Generator().manual_seed(4)
    group = random_group(gen, prefix=(10, 14), suffix=(3, 5), n=(2, 3))
    plans = [[("padded", list(range(len(group.suffixes))))]]
    kernel_for, in_phase_c = split_attention.kernel_for, []

    def another_in_phase_c(query, key, value):
        kernel = kernel_for(query, key, value)
        if not in_phase_c or kernel is None:
            return kernel

        def refuse(*args):
            raise AssertionError("the replay ran another kernel's backward than Phase A's")

        return split_attention.Kernel("other", kernel.forward, refuse)

    close = hf_prefixflow.GroupSession.close
    monkeypatch.setattr(split_attention, "kernel_for", another_in_phase_c)
    monkeypatch.setattr(hf_prefixflow.GroupSession, "close",
                        lambda self, *a, **k: in_phase_c.append(True) or close(self, *a, **k))
    train_side_by_side(build("llama", num_hidden_layers=2).train(), [group], plans, prepare=compiled(offload=True))


@pytest.mark.parametrize("compile_layers", [False, True])
def test_recompute_draws_phase_a_dropout_masks(compile_layers, fresh_dynamo):
    """LoRA dropout in the recomputed prefix layers: Phase C's recompute must draw Phase A's masks again, or the
    prefix gradients belong to another forward than the one the suffixes read. Offload's gradients then equal those
    without it (same seed), for torch.utils.checkpoint's recompute and PrefixFlow's own (compiled layers)."""
    gen = torch.Generator().manual_seed(10)
    group = random_group(gen, prefix=(10, 14), suffix=(3, 5), n=(2, 3))
    plan = [("padded", list(range(len(group.suffixes))))]
    model = build("llama", num_hidden_layers=2).train()
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5,
                                             init_lora_weights=False)).double()

    def gradients(offload: bool) -> dict:
        candidate = copy.deepcopy(model)
        for layer in decoder_layers(decoder_of(candidate)) if compile_layers else []:
            layer.compile(backend="aot_eager")
        hf_prefixflow.apply_prefixflow(candidate, offload=offload)
        torch.manual_seed(0)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            prefixflow_backward(candidate, group, plan)
        return {name: p.grad for name, p in candidate.named_parameters() if p.grad is not None}

    expected, actual = gradients(offload=False), gradients(offload=True)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-10, atol=0, msg=name)
