import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))  # synthetic tasks
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny float64 models run fastest on one intra-op thread: more only add synchronisation on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "native_dtypes: run without float64_throughout (tests/test_states.py)")
