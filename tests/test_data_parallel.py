"""DDP on CPU (two gloo processes): PrefixFlowGRPOTrainer gives the stock trainer's weights, identical on every rank."""

import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(name: str, out: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), env_path()]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), os.path.join(HERE, "ddp_worker.py"), name, out]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp"))
    for name in ("stock", "prefixflow"):
        _launch(name, out)
    return {(name, rank): torch.load(os.path.join(out, f"{name}_rank{rank}.pt"))
            for name in ("stock", "prefixflow") for rank in (0, 1)}


def test_ddp_matches_the_stock_trainer(runs):
    stock, pf = runs[("stock", 0)], runs[("prefixflow", 0)]
    for name in stock:
        torch.testing.assert_close(pf[name], stock[name], rtol=0, atol=1e-5, msg=name)


def test_ranks_hold_identical_weights(runs):
    for name, weight in runs[("prefixflow", 0)].items():
        assert torch.equal(weight, runs[("prefixflow", 1)][name]), name
