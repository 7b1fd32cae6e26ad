"""bench_control_plane.py of any checkout, with the coordinator process's resident memory watched: after each recovery
its RSS and the store's key count, and whenever the RSS has grown by PROBE_STEP_MB (default 300) since the last
report, every thread's stack and the sizes of the store's and the supervisor's tables (where memory grows, and in
what). The way to compare trees whose benchmark does not report its memory (the tree before this probe's own fix).

Run: PROBE_STEP_MB=500 prlimit --as=12000000000 .venv/bin/python benchmarks/control_plane_memory_probe.py TREE \\
         --ranks 16384 --failures 5 --silent-failures 1 --no-join
TREE: the checkout whose src/ and benchmarks/ run; the rest are bench_control_plane.py's own arguments.
PROBE_MAX_MB (default 7000): exit at once past it. PROBE_COUNTS=1: the Python object types that grew since the last
recovery (gc.get_objects: slow at scale); PROBE_KEYS=1: the store's keys by kind after each recovery.
Each death the coordinator declares is printed too (the first 30, then every 100th).
"""

from __future__ import annotations

import collections
import gc
import os
import re
import sys
import threading
import time
import traceback
from typing import Any

if __name__ == "__main__":
    TREE = sys.argv[1]
    sys.path.insert(0, os.path.join(TREE, "src"))
    sys.path.insert(0, os.path.join(TREE, "benchmarks"))

STEP_MB = float(os.environ.get("PROBE_STEP_MB", "300"))
MAX_MB = float(os.environ.get("PROBE_MAX_MB", "7000"))


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next((int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS")), 0.0)


class Probe:
    """Wraps the benchmark module's cluster start, failure and provider, and the coordinator's deaths."""

    def __init__(self, bench: Any) -> None:
        from recycle.runtime.control.coordinator import Coordinator

        self.bench, self.clusters, self.peak, self.failures, self.deaths = bench, [], 0.0, 0, 0
        self.last_counts: collections.Counter[str] = collections.Counter()
        start, failure, on_death = bench._Cluster.start, bench._failure, Coordinator.on_death
        probe = self

        def started(cluster: Any) -> Any:
            probe.clusters.append(cluster)
            return start(cluster)

        def failed(cluster: Any, rank: int, command: str) -> Any:
            row = failure(cluster, rank, command)
            probe.after_failure(cluster, command)
            return row

        def died(coordinator: Any, rank: int, cause: str, now: float, *args: Any, **kwargs: Any) -> Any:
            probe.deaths += 1
            if probe.deaths <= 30 or probe.deaths % 100 == 0:
                state = coordinator.state
                print(f"PROBE death #{probe.deaths} rank {rank}: {cause} (generation {state.generation}, live "
                      f"{len(state.live)}, failed {len(state.failed)}) at {time.strftime('%H:%M:%S')}", flush=True)
            return on_death(coordinator, rank, cause, now, *args, **kwargs)

        bench._Cluster.start, bench._failure, Coordinator.on_death = started, failed, died

    def after_failure(self, cluster: Any, command: str) -> None:
        self.failures += 1
        server = cluster.server
        line = (f"PROBE failure {self.failures} ({command}): rss {rss_mb():.0f} MB, peak {self.peak:.0f} MB; store "
                f"keys {server.data.num_keys():,}, connections {len(server._conns)}")
        if os.environ.get("PROBE_COUNTS") == "1":
            counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
            if self.last_counts:
                grew = sorted(((counts[k] - self.last_counts[k], k) for k in counts), reverse=True)[:8]
                line += " | grew: " + ", ".join(f"{k} +{d}" for d, k in grew if d > 0)
            self.last_counts = counts
        if os.environ.get("PROBE_KEYS") == "1":
            with server.data.lock:
                keys = list(server.data._data)
            kinds = collections.Counter(re.sub(rb"[0-9]+", b"N", key).decode() for key in keys)
            line += " | keys by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common(8))
        print(line, flush=True)

    def sizes(self) -> str:
        if not self.clusters:
            return "-"
        cluster = self.clusters[-1]
        server, supervisor, data = cluster.server, cluster.supervisor, cluster.server.data
        conns = sorted((len(c.out), len(c.reader.buffer), c.identity) for c in list(server._conns.values()))
        values = sum(len(v) for v in list(data._data.values()))
        return " | ".join([
            f"connections' out/in buffers {conns}", f"keys {len(data._data):,} ({values / 1e6:.0f} MB of values)",
            f"waiters {len(data._waiters)}, deadlines {len(server._deadlines)}",
            f"feed {len(supervisor.feed._keys)}, touched {len(supervisor.feed._touched)}",
            f"arrived {len(supervisor.arrived)}, held steps {len(supervisor.held.records)}",
            f"digested {len(supervisor.digested)}, resumed_in {len(supervisor.resumed_in)}",
            f"published {[(g, len(k)) for g, k in supervisor.published.items()]}",
            f"steps reported {len(supervisor.reporter.steps)}"])

    def watch(self) -> None:
        """Every 0.1 s: the peak; at each STEP_MB of growth, the stacks and the tables; past MAX_MB, exit."""
        shown = rss_mb()
        while True:
            now = rss_mb()
            self.peak = max(self.peak, now)
            if now > shown + STEP_MB:
                shown = now
                print(f"PROBE grew: rss {now:.0f} MB at {time.strftime('%H:%M:%S')}", flush=True)
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    if ident != threading.get_ident():
                        stack = traceback.extract_stack(frame)[-6:]
                        print(f"PROBE   thread {names.get(ident)}: " + " <- ".join(
                            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)),
                            flush=True)
                try:
                    print("PROBE   sizes: " + self.sizes(), flush=True)
                except Exception as exc:  # noqa: BLE001 (another tree's tables may differ)
                    print(f"PROBE   sizes: not read ({exc})", flush=True)
                if now > MAX_MB:
                    print(f"PROBE   past {MAX_MB:g} MB: exiting", flush=True)
                    os._exit(3)
            time.sleep(0.1)


def main() -> int:
    import bench_control_plane

    probe = Probe(bench_control_plane)
    threading.Thread(target=probe.watch, daemon=True, name="probe").start()
    print(f"PROBE start: rss {rss_mb():.0f} MB", flush=True)
    code = bench_control_plane.main(sys.argv[2:])
    print(f"PROBE end: rss {rss_mb():.0f} MB, peak {probe.peak:.0f} MB", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
