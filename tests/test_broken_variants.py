"""The equivalence checks can fail: deliberately broken schedules must be caught."""

import pytest
import torch

import hf_prefixflow
from hf_prefixflow.core import layouts, scheduler
from equivalence import random_group, random_plan, train_side_by_side
from models import build


@pytest.fixture(autouse=True)
def probed_before_breaking():
    """Apply (and so probe) each family before a test breaks the schedule: the checks under test are the
    equivalence checks, not `apply_prefixflow`'s probe, which would refuse the broken schedule first."""
    for family in ("mistral", "llama", "llama_eager", "qwen3"):
        hf_prefixflow.apply_prefixflow(build(family))


def _run(family="mistral", seed=0, layouts_=("padded", "packed")):
    gen = torch.Generator().manual_seed(seed)
    groups = [random_group(gen, prefix=(8, 24), n=(2, 5), suffix=(2, 9)) for _ in range(2)]
    plans = [random_plan(gen, len(g.suffixes), layouts_) for g in groups]
    train_side_by_side(build(family).train(), groups, plans)


def test_unbroken_baseline_passes():
    _run()


def test_skipping_phase_c_is_caught(monkeypatch):
    monkeypatch.setattr(scheduler, "delayed_backward", lambda caches, *args: 0)
    with pytest.raises(AssertionError, match="grad"):
        _run()


def test_positions_restarting_at_zero_are_caught(monkeypatch):
    def restarted(make):
        def build_wave(*args):
            wave = make(*args)
            wave.position_ids = wave.position_ids - wave.cached_length
            return wave

        return build_wave

    monkeypatch.setattr(scheduler, "padded_wave", restarted(layouts.padded_wave))
    monkeypatch.setattr(scheduler, "packed_wave", restarted(layouts.packed_wave))
    with pytest.raises(AssertionError):
        _run("llama")


def test_packed_suffixes_seeing_each_other_are_caught(monkeypatch):
    build_mask = layouts.Wave._build

    def leaky(self, window):  # every packed token in one segment: suffixes attend across each other
        merged = layouts.Wave(
            self.input_ids, self.position_ids, torch.zeros_like(self.segment_ids), self.cached_length, True,
            self.position_offset
        )
        return build_mask(merged, window)

    monkeypatch.setattr(layouts.Wave, "_build", leaky)
    with pytest.raises(AssertionError):
        _run("llama_eager", layouts_=("packed",))


def test_ignoring_the_sliding_window_is_caught(monkeypatch):
    monkeypatch.setattr(layouts.Wave, "visible", lambda self, window: self._build(None))
    with pytest.raises(AssertionError):
        _run("mistral")


def test_dropping_earlier_waves_gk_is_caught(monkeypatch):
    original = scheduler.PrefixGroup.run_wave

    def forgetful(self, wave, **kwargs):
        for tensor in self.cache.tensors():
            tensor.grad = None
        return original(self, wave, **kwargs)

    monkeypatch.setattr(scheduler.PrefixGroup, "run_wave", forgetful)
    with pytest.raises(AssertionError):
        _run("qwen3", seed=3)
