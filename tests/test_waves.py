"""Automatic suffix waves: exact gradients for any budget, wave sizes that follow the budget, clear errors."""

import contextlib

import pytest
import torch

import hf_prefixflow
from equivalence import assert_same_gradients, gradients, prefixflow_backward, random_group
from hf_prefixflow import AutoWaves, PrefixFlowError
from models import build


def _plan(auto: AutoWaves, group) -> list[tuple[str, list[int]]]:
    lengths = [len(s) for s in group.suffixes]
    return [("padded", rows) for rows in auto.waves(lengths, len(group.prefix), "cpu")]


def test_auto_waves_give_the_one_wave_gradients():
    gen = torch.Generator().manual_seed(0)
    model = hf_prefixflow.apply_prefixflow(build("qwen3").train())
    group = random_group(gen, prefix=(10, 16), n=(5, 6))
    widest = max(len(s) for s in group.suffixes)
    auto = AutoWaves(row_bytes=1000.0, reference=(widest, len(group.prefix)), budget_bytes=2500.0)
    plan = _plan(auto, group)
    assert len(plan) >= 2 and sorted(r for _, rows in plan for r in rows) == list(range(len(group.suffixes)))
    prefixflow_backward(model, group, plan)
    split = gradients(model)
    model.zero_grad(set_to_none=True)
    prefixflow_backward(model, group, [("padded", list(range(len(group.suffixes))))])
    assert_same_gradients(split, gradients(model))


def test_wave_sizes_follow_the_budget():
    lengths, prefix = [8, 3, 8, 5, 2, 8, 7, 1], 20
    counts = []
    for budget in (150, 250, 450, 1e9):
        auto = AutoWaves(row_bytes=100.0, reference=(8, prefix), budget_bytes=budget)
        waves = list(auto.waves(lengths, prefix, "cpu"))
        assert [len(w) for w in waves] == auto.sizes
        assert sorted(r for w in waves for r in w) == list(range(len(lengths)))
        assert [lengths[w[0]] for w in waves] == sorted((lengths[w[0]] for w in waves), reverse=True)
        counts.append(len(waves))
    assert counts[0] > counts[1] > counts[2] > counts[3] == 1
    # a longer prefix (or wider rows) costs proportionally more per row, so waves shrink
    assert len(list(AutoWaves(100.0, (8, prefix), budget_bytes=250).waves(lengths, 2 * prefix, "cpu"))) > counts[1]


def test_budget_below_one_row_and_missing_numbers_are_errors():
    with pytest.raises(PrefixFlowError, match="one suffix row needs"):
        list(AutoWaves(row_bytes=100.0, reference=(8, 20), budget_bytes=50).waves([8, 8], 20, "cpu"))
    with pytest.raises(PrefixFlowError, match="measure a row on CUDA"):
        list(AutoWaves(budget_bytes=1e9).waves([4, 3], 10, "cpu"))
    assert list(AutoWaves().waves([4], 10, "cpu")) == [[0]]  # one row: nothing to plan
    with pytest.raises(PrefixFlowError, match="reference"):
        AutoWaves(row_bytes=100.0)


def test_calibration_measures_the_second_single_row_wave(monkeypatch):
    measured = []

    @contextlib.contextmanager
    def fake_measured(device, record):
        measured.append(device)
        yield
        record(1000)

    monkeypatch.setattr(hf_prefixflow.core.waves, "_measured", fake_measured)
    auto = AutoWaves(budget_bytes=2500.0)
    waves = list(auto.waves([6, 6, 6, 6, 6, 6, 6], 10, "cuda"))  # a device object only: nothing runs on it
    assert [len(w) for w in waves] == [1, 1, 2, 2, 1] and len(measured) == 1
    assert auto.row_bytes == 1000 and auto.reference == (6, 10)
