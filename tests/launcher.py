"""Run a test worker script on several CPU processes (gloo) with torch.distributed.run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` on `tests/<script>`, one thread per process; returns the finished run."""
    path = os.pathsep.join(p for p in [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), os.path.join(HERE, script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def finish_worker() -> None:
    """End a worker process once its results are written: leave the process group and skip the interpreter's
    teardown, where gloo's threads can abort the exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
