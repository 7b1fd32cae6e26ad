"""Hand-off latency on gloo between two processes: the receiver's wait for a 128 KiB message (a small-preset
activation of 4 x 64 tokens), its receive posted at the point of need or before its compute (what the executor's
posted receives do). Both compute first (the sender ~COMPUTE_MS of CPU, the receiver 1.2x that, so the message is
sent before it is needed); the two ways alternate per exchange.

    .venv/bin/python benchmarks/bench_gloo_handoff.py [EXCHANGES=200] [COMPUTE_MS=5]
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("at need", "posted ahead")


def busy(ms: float) -> None:
    """About `ms` of this thread's CPU in small matrix products."""
    until = time.thread_time() + ms / 1e3
    a = torch.randn(64, 64)
    while time.thread_time() < until:
        a = a @ a
        a = a / a.norm()


def worker(rank: int, port: int, exchanges: int, compute_ms: float, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.distributed_c10d._get_default_group()
    message = torch.randn(4, 64, 128)
    waits: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(exchanges):
        way = WAYS[i % 2]
        dist.barrier()
        if rank == 0:
            busy(compute_ms)
            group.send([message], 1, i).wait()
        else:
            buffer = torch.empty_like(message)
            posted = group.recv([buffer], 0, i) if way == "posted ahead" else None
            busy(compute_ms * 1.2)
            started = time.perf_counter()
            (posted if posted is not None else group.recv([buffer], 0, i)).wait()
            if i >= 4:  # the first exchanges set up the connection
                waits[way].append((time.perf_counter() - started) * 1e6)
    if rank == 1:
        results.put({way: (statistics.median(w), statistics.mean(w), max(w)) for way, w in waits.items()})
    dist.barrier()
    os._exit(0)


def main() -> int:
    exchanges = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    compute_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [context.Process(target=worker, args=(r, port, exchanges, compute_ms, results)) for r in range(2)]
    for p in procs:
        p.start()
    waits = results.get(timeout=300)
    for p in procs:
        p.join(10)
    print(f"{exchanges} exchanges, ~{compute_ms:g} ms of compute before each, {os.cpu_count()} CPUs")
    for way, (median, mean, most) in waits.items():
        print(f"{way:13s} receiver's wait: median {median:7.1f} us, mean {mean:7.1f} us, max {most:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
