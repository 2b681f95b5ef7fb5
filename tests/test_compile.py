"""torch.compile'd decoder layers: one compiled graph serves every layer, and training equals the full-sequence path."""

import pytest
import torch

import hf_prefixflow
from equivalence import random_group, train_side_by_side
from models import build

LAYERS = 10  # more than torch.compile's recompile limit (8): a graph per layer would send layers back to eager


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    # Failing is the only visible sign: past the limit, dynamo silently runs the remaining calls eagerly.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def compiled(offload: bool):
    def prepare(model):
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")  # dynamo and autograd as inductor sees them, no C++ toolchain needed
        hf_prefixflow.apply_prefixflow(model, offload=offload)

    return prepare


@pytest.mark.parametrize("family,offload", [("llama", False), ("qwen3", True), ("qwen3_moe", True)])
def test_compiled_layers_train_like_the_full_sequence(family, offload, fresh_dynamo, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    groups = [random_group(gen, prefix=(8, 16), suffix=(3, 6), n=(3, 4)) for _ in range(2)]  # the 2nd reuses graphs
    plans = [[("padded", list(range(len(group.suffixes))))] for group in groups]
    model = build(family, num_hidden_layers=LAYERS).train()
    eager_runs = _count_eager_runs(monkeypatch, model)
    # With offload, every prefix layer is recomputed in Phase C: by PrefixFlow's own recompute, compiled like the rest.
    train_side_by_side(model, groups, plans, prepare=compiled(offload))
    rows = sum(len(g.suffixes) for g in groups)
    assert eager_runs == {"reference": LAYERS * rows, "prefixflow": 0}  # the reference runs eagerly: the count works


def _count_eager_runs(monkeypatch, reference) -> dict:
    """Eager calls of the decoder layers' MLP forward, in `reference` and in its copies; inside a compiled graph,
    dynamo only traced the forward."""
    counts = {"reference": 0, "prefixflow": 0}
    mlps = {id(layer.mlp) for layer in reference.model.layers}
    mlp_type = type(reference.model.layers[0].mlp)
    forward = mlp_type.forward

    def counting(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            counts["reference" if id(self) in mlps else "prefixflow"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(mlp_type, "forward", counting)
    return counts
