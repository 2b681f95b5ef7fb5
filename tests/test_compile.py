"""torch.compile'd decoder layers: one compiled graph serves every layer, and gradients equal the full-sequence path."""

import contextlib
import copy

import pytest
import torch

import hf_prefixflow
from equivalence import assert_same_gradients, full_sequence_backward, gradients, prefixflow_backward, random_group
from models import build

LAYERS = 10  # more than torch.compile's recompile limit (8): a graph per layer would send layers back to eager


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    # Failing is the only visible sign: past the limit, dynamo silently runs the remaining calls eagerly.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family,offload", [("llama", False), ("qwen3", True), ("qwen3_moe", False)])
def test_compiled_layers_train_like_the_full_sequence(family, offload, fresh_dynamo):
    gen = torch.Generator().manual_seed(3)
    reference = build(family, num_hidden_layers=LAYERS).train()
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")  # dynamo and autograd as inductor sees them, without a C++ toolchain
    hf_prefixflow.apply_prefixflow(model, offload=offload)
    for _ in range(2):  # the second group runs on what the first compiled
        group = random_group(gen, prefix=(8, 16), suffix=(3, 6), n=(3, 4))
        plan = [("padded", list(range(len(group.suffixes))))]
        full_sequence_backward(reference, group)
        # Offload checkpoints the prefix layers, which dynamo then runs uncompiled: said, not silent.
        with pytest.warns(UserWarning, match="run uncompiled") if offload else contextlib.nullcontext():
            prefixflow_backward(model, group, plan)
        assert_same_gradients(gradients(model), gradients(reference))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
