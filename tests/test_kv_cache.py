"""The training-time KV cache: gK/gV accumulate in fp32 across waves and are handed to Phase C once."""

import weakref

import torch

from hf_prefixflow.kv_cache import TrainingKVCache, delayed_backward


def test_phase_c_drops_each_accumulator_as_it_casts_it():
    """Phase C feeds gK/gV in the live dtype; the fp32 accumulators must be gone by then, or every layer's
    accumulator and its bf16 copy would share the device through the whole prefix backward."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    cache = TrainingKVCache(3)
    cache.capture(0, (x * 2).bfloat16(), (x * 3).bfloat16())
    for _ in range(2):  # two waves, each reading both leaves
        for tensor in cache.tensors():
            tensor.leaf.backward(torch.ones_like(tensor.leaf))
    accumulators = [weakref.ref(t.grad) for t in cache.tensors()]
    assert all(r().dtype == torch.float32 and torch.equal(r(), torch.full((3, 4), 2.0)) for r in accumulators)
    alive_during_backward = []

    def backward(outputs, grads):
        alive_during_backward.extend(r() is not None for r in accumulators)
        torch.autograd.backward(outputs, grads)

    assert delayed_backward([cache], backward) == 2
    assert alive_during_backward == [False, False]
    assert torch.equal(x.grad, torch.full((3, 4), 2.0 * 2 + 2.0 * 3, dtype=torch.float64))
