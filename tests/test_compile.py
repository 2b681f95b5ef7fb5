"""torch.compile'd decoder layers: one compiled graph serves every layer, and training equals the full-sequence path."""

import pytest
import torch

import hf_prefixflow
from equivalence import random_group, train_side_by_side
from hf_prefixflow.attention import RECOMPILE_LIMIT
from hf_prefixflow.model import decoder_of
from hf_prefixflow.recompute import decoder_layers
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
        for layer in decoder_layers(decoder_of(model)):
            layer.compile(backend="aot_eager")  # dynamo and autograd as inductor sees them, no C++ toolchain needed
        hf_prefixflow.apply_prefixflow(model, offload=offload)

    return prepare


@pytest.mark.parametrize("family,offload,frozen_embeddings", [("llama", False, False), ("qwen3", True, False),
                                                              ("qwen3_moe", True, False), ("llama", True, True)])
def test_compiled_layers_train_like_the_full_sequence(family, offload, frozen_embeddings, fresh_dynamo, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    groups = [random_group(gen, prefix=(8, 16), suffix=(3, 6), n=(3, 4)) for _ in range(2)]  # the 2nd reuses graphs
    plans = [[("padded", list(range(len(group.suffixes))))] for group in groups]
    model = build(family, num_hidden_layers=LAYERS).train()
    # Frozen embeddings: the first layer's input needs no gradient, but its weights do (as with PEFT adapters); more
    # variants of one graph than torch's default limit (see `attention.RECOMPILE_LIMIT`, which the trainer sets).
    model.get_input_embeddings().weight.requires_grad_(not frozen_embeddings)
    limit = RECOMPILE_LIMIT if frozen_embeddings else torch._dynamo.config.recompile_limit
    eager_runs = _count_eager_runs(monkeypatch, model)
    # With offload, every prefix layer is recomputed in Phase C: by PrefixFlow's own recompute, compiled like the rest.
    with torch._dynamo.config.patch(recompile_limit=limit):
        train_side_by_side(model, groups, plans, prepare=compiled(offload))
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
