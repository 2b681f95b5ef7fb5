"""The training-time KV cache: gK/gV accumulate across waves in the model's gradient precision and reach Phase C once."""

import weakref

import torch

from hf_prefixflow.core.kv_cache import TrainingKVCache, delayed_backward


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


def test_one_wave_keeps_its_gradient_as_autograd_made_it_and_a_second_sums_in_fp32():
    """A single bf16 contribution needs no fp32 copy (the same value in half the bytes, which is what lets a long
    prefix in one wave fit); the second one promotes the sum to fp32 exactly as an fp32 accumulator would."""
    gen = torch.Generator().manual_seed(5)
    live = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True).bfloat16()
    waves = [torch.randn(4, 8, generator=gen).bfloat16() for _ in range(3)]
    cache = TrainingKVCache(4)
    cache.capture(0, live, live * 2)
    key = cache.layers[0].key
    key.leaf.backward(waves[0])
    assert key.grad.dtype == torch.bfloat16 and torch.equal(key.grad, waves[0])
    handed = []
    delayed_backward([cache], lambda outputs, grads: handed.extend(grads))
    assert handed[0] is not None and torch.equal(handed[0], waves[0]) and handed[0].dtype == torch.bfloat16

    cache.capture(1, live, live * 2)
    key = cache.layers[1].key
    for grad in waves:
        key.leaf.backward(grad)
    expected = waves[0].float() + waves[1].float() + waves[2].float()
    assert key.grad.dtype == torch.float32 and torch.equal(key.grad, expected)


def test_a_bf16_sum_dtype_adds_waves_in_bf16_one_rounding_each():
    """With bf16 trainable weights the baseline's `param.grad` sums microbatches in bf16; gK/gV then do the same:
    each wave rounds once into a bf16 sum (not fp32, not a wider value in disguise)."""
    gen = torch.Generator().manual_seed(6)
    live = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True).bfloat16()
    waves = [torch.randn(4, 8, generator=gen).bfloat16() for _ in range(4)]
    cache = TrainingKVCache(4, grad_dtype=torch.bfloat16)
    cache.capture(0, live, live * 2)
    key = cache.layers[0].key
    for grad in waves:
        key.leaf.backward(grad)
    expected = waves[0].clone()
    for grad in waves[1:]:
        expected += grad
    assert key.grad.dtype == torch.bfloat16 and torch.equal(key.grad, expected)
    assert not torch.equal(key.grad.float(), sum(w.float() for w in waves))  # these draws round differently in fp32
