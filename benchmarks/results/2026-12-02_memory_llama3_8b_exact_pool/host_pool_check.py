"""Offload's page-locked host buffers on a GPU: registered in place at the size asked, copied both ways
asynchronously, and what torch's pinned allocator takes for the same request.

    python benchmarks/host_pool_check.py [--gib 8]
"""

import argparse
import time

import torch

from hf_prefixflow.core.offload import HostPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=8.0)
    nbytes = int(parser.parse_args().gib * 2**30)
    pool = HostPool(pin=True)
    start = time.perf_counter()
    buffer = pool.take(nbytes)
    register_s = time.perf_counter() - start
    device = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    buffer.copy_(device, non_blocking=True)
    queued_ms = (time.perf_counter() - start) * 1e3  # an asynchronous copy returns at once
    torch.cuda.synchronize()
    to_host_s = time.perf_counter() - start
    device.zero_()
    start = time.perf_counter()
    device.copy_(buffer, non_blocking=True)
    torch.cuda.synchronize()
    to_device_s = time.perf_counter() - start
    print(f"pool buffer: pinned {buffer.is_pinned()}, {buffer.numel()} bytes for {nbytes} asked, pool "
          f"{pool.allocated_bytes} bytes, registered in {register_s:.2f} s; device->host queued in {queued_ms:.2f} ms, "
          f"{nbytes / to_host_s / 1e9:.1f} GB/s; host->device {nbytes / to_device_s / 1e9:.1f} GB/s; round trip "
          f"exact: {bool((device == 7).all())}; fallbacks {pool.pin_fallbacks}")
    pool.give(buffer)
    pool.close()
    start = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    print(f"torch's pinned allocator: {time.perf_counter() - start:.2f} s, holds "
          f"{torch.cuda.host_memory_stats()['allocated_bytes.current']} bytes for {nbytes} asked")


if __name__ == "__main__":
    main()
