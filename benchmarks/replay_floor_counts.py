"""How much of a cold replay the 1F1B floor decides, counted (the same on a loaded machine): ReCycle's planned keys
whose period is at or below the floor, ReCycle+'s partition searches skipped there (`settled_at_floor`), how many
keys' first-rule estimate is under the floor (the keys a replay now settles without a plan:
`ThroughputModel.period_cap`, docs/planner.md "An upper bound from the first rule schedule") and whether any of
those is planned above it (the proof there says never; this counts it on a real trace).

Run: nice -n 10 .venv/bin/python benchmarks/replay_floor_counts.py [--trace long-400|NAME|SPEC]

Job: as benchmarks/bench_replay.py's cold column (the config sized to the trace, every default system, the paper's
1F1B reference, the plan cache in a fresh temporary folder). The first rule's list schedule is made on the side for
each planned key (it is not the replay's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import recycle.traces.repartition as repartition
import recycle.traces.throughput as throughput
from recycle.config import load_config
from recycle.planner.heuristic import VARIANTS, list_schedule
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import routing_candidates
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, find_traces_dir, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.plan_cache import PlanCache
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
LONG_SPEC = "poisson:nodes=80,hours=48,mtbf_h=18,repair_h=0.5,seed=0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--trace", default="long-400", help="long-400, a shipped trace's name, or a --generate spec")
    args = parser.parse_args(argv)
    if args.trace == "long-400" or ":" in args.trace:
        trace = parse_generate_spec(LONG_SPEC if args.trace == "long-400" else args.trace)
    else:
        folder = find_traces_dir(ROOT)
        if folder is None:
            print("no ../shared/data/traces beside the checkout", file=sys.stderr)
            return 2
        trace = read_trace(folder / f"{args.trace}.csv")
    keys: list[tuple[tuple[int, ...], float, float, float]] = []  # (key, planned period, first-rule estimate, floor)
    real_period = throughput.ThroughputModel.period

    def period(self, key):
        key = tuple(key)
        if key not in self._cache and self.floor_period is not None:
            planned = float(self.period_fn(key))
            config, options = self.config, PlannerOptions()
            first = list_schedule(config, key, routing_candidates(config, key)[0], options.decoupled,
                                  options.staggered, memory_cap(config, options), VARIANTS[0])
            keys.append((key, planned, first.estimate, self.floor_period))
        return real_period(self, key)

    searches = {"asked": 0, "settled": 0}
    real_choice = repartition.PartitionModel.choice

    def choice(self, key):
        key = tuple(key)
        if key not in self._choice and any(key):
            searches["asked"] += 1
            searches["settled"] += self.settled_at_floor(key)
        return real_choice(self, key)

    throughput.ThroughputModel.period = period
    repartition.PartitionModel.choice = choice
    with tempfile.TemporaryDirectory(prefix="replay-floor-") as tmp:
        cpu = time.process_time()
        result = run_job(load_config(args.config), trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"),
                         plan_cache=PlanCache(Path(tmp) / "plans"))
        cpu = time.process_time() - cpu
    under = [k for k in keys if k[2] <= k[3]]
    print(f"trace {args.trace}: D={result.extra['num_replicas']}, {cpu:.1f} CPU s (with the side schedules)")
    print(f"ReCycle's planned keys: {len(keys)}, planned period at or below the 1F1B floor: "
          f"{sum(k[1] <= k[3] for k in keys)}")
    print(f"ReCycle+'s partition choices: {searches['asked']}, settled at the floor (no search): {searches['settled']}")
    print(f"first rule's estimate at or below the floor: {len(under)} keys, of them planned above it (a "
          f"counter-example to the upper bound): {sum(k[1] > k[3] for k in under)}")
    if keys:
        print(f"largest planned period / first-rule estimate: {max(k[1] / k[2] for k in keys)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
