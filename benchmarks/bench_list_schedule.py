"""Rule schedules: CPU seconds of the heuristic's list schedules (every rule on every routing, as schedule_heuristic
runs them) on a fixed set of keys, this tree against a commit's, alternating in one run, with their schedules
checked identical.

Run: nice -n 10 .venv/bin/python benchmarks/bench_list_schedule.py --compare-with COMMIT [--rounds 3] [--replicas 8]

Keys: GPT-3 6.7B (configs/gpt3-6.7b-a100.toml) at D = --replicas (8: the shipped bamboo-ec2-p3 replay's), every
failure key of one or two failed workers. Per key, the rules schedule_heuristic list-schedules before its search
(VARIANTS, the random restarts and the first-stage rule on the first routing, VARIANTS on the others) and the waiting
rules (which it adds when a key stays above the bound), on its routing candidates. Each tree runs in a child
interpreter (the commit's src/ from `git archive`); rounds alternate between the two, and the best round counts
(the machine is shared). Identical: the SHA-256 of every schedule's entries and estimate is the same in both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The child's program: times every rule schedule of the keys, prints {"cpu_s", "schedules", "digest"} as JSON.
CHILD = r"""
import hashlib, itertools, json, sys, time
from recycle.config import load_config
from recycle.planner import heuristic as h
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import routing_candidates

config_path, replicas = sys.argv[1], int(sys.argv[2])
config = load_config(config_path).with_topology(num_replicas=replicas)
options = PlannerOptions()
caps = memory_cap(config, options)
S = config.num_stages
keys = [k for k in itertools.product(range(3), repeat=S) if 1 <= sum(k) <= 2]
first = (*h.VARIANTS, *(h.Variant(f"random-{seed}", seed=seed) for seed in range(h.RANDOM_RESTARTS)),
         *h.FIRST_STAGE_VARIANTS, *h.WAITING_VARIANTS)
work = [(key, host, variant) for key in keys for r, host in enumerate(routing_candidates(config, key))
        for variant in (first if r == 0 else (*h.VARIANTS, *h.WAITING_VARIANTS))]
digest = hashlib.sha256()
began = time.process_time()
timed = [h.list_schedule(config, key, host, options.decoupled, options.staggered, caps, v) for key, host, v in work]
cpu = time.process_time() - began
for t in timed:
    digest.update(repr((t.entries, t.estimate)).encode())
print(json.dumps({"cpu_s": cpu, "schedules": len(work), "keys": len(keys), "digest": digest.hexdigest()}))
"""


def source_of(commit: str, folder: Path) -> Path:
    """The commit's src/ extracted into `folder`."""
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def run_child(src: Path, config: str, replicas: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, config, str(replicas)], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(src)})
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-with", metavar="COMMIT", required=True, help="the commit to time against")
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-list-schedule-") as tmp:
        trees = {args.compare_with: source_of(args.compare_with, Path(tmp)), "this tree": ROOT / "src"}
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, src in trees.items():
                result = run_child(src, args.config, args.replicas)
                if name not in best or result["cpu_s"] < best[name]["cpu_s"]:
                    best[name] = result
    old, new = best[args.compare_with], best["this tree"]
    print(f"{new['schedules']} rule schedules ({new['keys']} keys, D={args.replicas}), best of {args.rounds} rounds, "
          f"CPU s: {args.compare_with} {old['cpu_s']:.2f}, this tree {new['cpu_s']:.2f}, "
          f"ratio {old['cpu_s'] / new['cpu_s']:.2f}x; identical: {'yes' if old['digest'] == new['digest'] else 'NO'}")
    return 0 if old["digest"] == new["digest"] else 1


if __name__ == "__main__":
    sys.exit(main())
