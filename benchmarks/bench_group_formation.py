"""Forming the next generation after a pure loss, on gloo: splitting the survivors out of the previous world
(`ProcessGroup.split_group`, which only the survivors call) against a full initialisation of a new group of the
survivors, at 4, 8, 16 and 32 processes, side by side in one run. The "lost" process stays alive and does nothing
(a frozen peer). Both rendezvous through a loopback TCPStore: `split_group` clones its store (`Store::clone`),
which c10d does not forward to a store written in Python such as the job's authenticated store (runtime/store):
"Tried to call pure virtual function ::c10d::Store::clone" (torch 2.13). So the runtime cannot split on gloo
at all; this measures what it would gain if it could.

Run: .venv/bin/python benchmarks/bench_group_formation.py [--sizes 4,8,16,32] [--repeats 5]

Reported per size: the median over repeats of the slowest survivor's time from the start barrier until its new
group has completed one all-reduce (the time the generation is usable everywhere). torch.distributed's Python
`split_group` refuses gloo on CPU ("No device associated with the default pg") and `shrink_group` is unsupported
on gloo (ProcessGroupGloo.supports_shrinking is False), so the split goes through the C++ method on a world built
by hand, the way `init_process_group` builds one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=60)


def _world(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def _barrier(store, name: str, size: int) -> None:
    store.add(name, 1)
    while int(store.get(name)) < size:  # a counter: every process arrives, then all go
        time.sleep(0.001)


def member(rank: int, size: int, port: int, repeats: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    world = _world(dist.PrefixStore("world", store), rank, size)
    world.allreduce([torch.ones(1)]).wait()
    survivors = list(range(size - 1))  # the last rank is lost: alive, silent
    x = torch.ones(1)
    for rep in range(repeats):
        for method in (("split", "init") if rep % 2 == 0 else ("init", "split")):
            _barrier(store, f"go/{rep}/{method}", size)
            if rank == size - 1:
                continue
            started = time.perf_counter()
            if method == "split":
                group = world.split_group(survivors, timeout=TIMEOUT, group_name=f"split{rep}")
                group.allreduce([x]).wait()
            else:
                backend = dist.ProcessGroupGloo(dist.PrefixStore(f"init{rep}", store), rank, size - 1, TIMEOUT)
                backend.allreduce([x]).wait()
            store.set(f"t/{rep}/{method}/{rank}", repr(time.perf_counter() - started))
    _barrier(store, "done", size)


def measure(size: int, repeats: int, limit_s: float = 300.0) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    context = mp.get_context("forkserver")
    procs = [context.Process(target=member, args=(r, size, store.port, repeats), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    while any(p.exitcode is None for p in procs):
        bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if bad or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise SystemExit(f"at {size} processes: {len(bad)} failed (exit codes {bad})" if bad else
                             f"at {size} processes: not done within {limit_s:g} s")
        time.sleep(0.05)
    out = {}
    for method in ("split", "init"):
        slowest = [max(float(store.get(f"t/{rep}/{method}/{r}")) for r in range(size - 1)) for rep in range(repeats)]
        out[method] = statistics.median(slowest)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8,16,32", help="world sizes before the loss (default 4,8,16,32)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        print(f"error: --sizes {args.sizes!r} must be comma-separated integers >= 2, e.g. 4,8,16", file=sys.stderr)
        raise SystemExit(2) from None
    if any(s < 2 for s in sizes) or args.repeats < 1:
        print("error: every size must be >= 2 and --repeats >= 1", file=sys.stderr)
        raise SystemExit(2)
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    rows = {}
    print(f"{'processes':>9} {'split (s)':>10} {'re-init (s)':>12} {'split / re-init':>16}")
    for size in sizes:
        result = measure(size, args.repeats)
        rows[size] = result
        print(f"{size:>9} {result['split']:>10.4f} {result['init']:>12.4f} {result['split'] / result['init']:>16.2f}",
              flush=True)
    print(json.dumps({"repeats": args.repeats, "seconds": rows}))


if __name__ == "__main__":
    main()
