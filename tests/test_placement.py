"""A rollout group split across two gloo processes (`hf_prefixflow/distributed/placement.py`) trains exactly."""

import json
import os

import pytest
from launcher import torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("placement"))
    result = torchrun("placement_worker.py", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"rank{rank}.json"))) for rank in (0, 1)]


def test_split_group_gradients_equal_one_process_full_sequences(results):
    # Group A split 2/3 across the ranks, group B held by rank 1 alone (rank 0 joins with dummies), group C local.
    for rank in results:
        assert rank["exact"] <= 1e-5, rank


def test_skipping_the_gk_gv_reduce_is_caught(results):
    for rank in results:
        assert rank["broken"] > 1e-2, rank


def test_a_failure_on_one_rank_raises_on_every_rank(results):
    assert all(rank["mismatch_raised_everywhere"] for rank in results), results
