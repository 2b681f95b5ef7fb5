"""Data parallel on CPU (two gloo processes): DDP and DeepSpeed ZeRO-1/2/3 give the stock trainer's weights."""

import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
ENGINES = {"ddp": [], "zero1": ["1"], "zero2": ["2"], "zero3": ["3"]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(name: str, out: str, engine: str) -> None:
    path = os.pathsep.join(p for p in [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), os.path.join(HERE, "ddp_worker.py"), name, out, *ENGINES[engine]]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module", params=list(ENGINES))
def run(request, tmp_path_factory):
    engine = request.param
    out = str(tmp_path_factory.mktemp(engine))
    for name in ("stock", "prefixflow"):
        _launch(name, out, engine)
    return engine, out


def test_matches_the_stock_trainer(run):
    engine, out = run
    stock, pf = (torch.load(os.path.join(out, f"{name}_rank0.pt")) for name in ("stock", "prefixflow"))
    assert stock.keys() == pf.keys()
    for name in stock:
        torch.testing.assert_close(pf[name], stock[name], rtol=0, atol=1e-5, msg=name)
    if engine == "ddp":  # every rank holds full weights, and they must be the same (ZeRO's are gathered above)
        ranks = [torch.load(os.path.join(out, f"prefixflow_rank{rank}_params.pt")) for rank in (0, 1)]
        for name, weight in ranks[0].items():
            assert torch.equal(weight, ranks[1][name]), name
