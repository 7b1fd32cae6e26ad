"""Plan digests: the SHA-256 of the plan JSON for a fixed set of (config, failures, options); a speed change must not
move one byte.

Run: nice -n 15 .venv/bin/python benchmarks/plan_digest.py --write before.json [--skip-1024]
     (change the planner)
     nice -n 15 .venv/bin/python benchmarks/plan_digest.py --check before.json [--skip-1024]

Cases: the shipped configs under several options and failure sets (make_plan, traffic and canonical routing); every
case of the quality screen (benchmarks/bench_planner_quality.py, seed 0: schedule_heuristic, make_plan); uniform
shapes on each side of the heuristic's size thresholds up to D=64, S=16, M=128. Each plan's simulated result is
digested with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from recycle.config import Config, load_config, uniform_config
from recycle.ir.plan import Plan
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.failures import normalize
from recycle.planner.heuristic import schedule_heuristic
from recycle.planner.options import PlannerOptions
from recycle.sim.simulator import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner_quality import draw_cases  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {
    "default": PlannerOptions(),
    "fused": PlannerOptions(decoupled=False),
    "coupled": PlannerOptions(staggered=False),
    "fused-coupled": PlannerOptions(decoupled=False, staggered=False),
    "no-search": PlannerOptions(search=False),
}


def digest(plan: Plan, config: Config) -> str:
    sim = simulate(plan, config).to_dict()
    return hashlib.sha256((plan.to_json() + json.dumps(sim, sort_keys=True)).encode()).hexdigest()


def shipped_cases() -> Iterator[tuple[str, Callable[[], tuple[Plan, Config]]]]:
    for name in ("toy", "gpt3-6.7b-a100", "tiny-gpt"):
        config = load_config(ROOT / "configs" / f"{name}.toml")
        D, S = config.num_replicas, config.num_stages
        rng = random.Random(name)
        workers = [(p, s) for p in range(D) for s in range(S)]
        sets = [(), ((1 % D, S - 1),), ((0, 0), (0, S - 1)), ((0, 0), (1 % D, S - 1))]
        for _ in range(6):
            failed = tuple(sorted(rng.sample(workers, rng.randint(1, min(3, D * S - S)))))
            if all(sum(1 for _, s in failed if s == st) < D for st in range(S)):
                sets.append(failed)
        for failed in sets:
            for oname, options in OPTIONS.items():
                for routing in ("traffic", "canonical"):
                    yield (f"{name} {failed} {oname} {routing}",
                           lambda c=config, f=failed, o=options, r=routing: (make_plan(c, f, o, routing=r), c))


def screen_cases() -> Iterator[tuple[str, Callable[[], tuple[Plan, Config]]]]:
    for i, case in enumerate(draw_cases(300, 0)):
        config = case.config()
        key = normalize(case.failed, case.D, case.S).key
        yield f"screen #{i} heuristic", lambda c=config, k=key, o=case.options: (schedule_heuristic(c, k, o), c)
        yield f"screen #{i} make_plan", lambda c=config, f=case.failed, o=case.options: (make_plan(c, f, o), c)


def uniform_cases(skip_1024: bool) -> Iterator[tuple[str, Callable[[], tuple[Plan, Config]]]]:
    shapes = [(4, 4, 8, (1,)), (8, 8, 16, (1, 5)), (16, 8, 32, (0, 3, 6)), (16, 16, 64, (1, 5, 9)),
              (32, 16, 64, (1, 5, 9, 14))]
    if not skip_1024:
        shapes.append((64, 16, 128, (1, 3, 5, 7, 9, 11, 13, 15)))
    for D, S, M, stages in shapes:
        config = uniform_config(D, S, M, optimizer=3.0, name=f"uniform-{D}x{S}x{M}")
        failed = tuple(((7 * i + 3) % D, s) for i, s in enumerate(stages))
        large = D * S > 256
        for oname, options in OPTIONS.items():
            if large and oname not in ("default", "fused-coupled"):
                continue
            for routing in ("traffic", "canonical"):
                if D == 64 and (routing == "canonical" or oname != "default"):
                    continue
                yield (f"uniform {D}x{S}x{M} {failed} {oname} {routing}",
                       lambda c=config, f=failed, o=options, r=routing: (make_plan(c, f, o, routing=r), c))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write the digests to this JSON file")
    group.add_argument("--check", type=Path, help="compare with the digests in this JSON file")
    parser.add_argument("--skip-1024", action="store_true", help="leave out D=64, S=16, M=128")
    parser.add_argument("--skip-screen", action="store_true", help="leave out the quality screen's cases")
    args = parser.parse_args(argv)
    cases = [*shipped_cases(), *([] if args.skip_screen else screen_cases()), *uniform_cases(args.skip_1024)]
    began = time.perf_counter()
    digests = {}
    for name, make in cases:
        clear_cache()
        plan, config = make()
        digests[name] = digest(plan, config)
    elapsed = time.perf_counter() - began
    if args.write:
        args.write.write_text(json.dumps(digests, indent=1))
        print(f"wrote {len(digests)} digests to {args.write} ({elapsed:.0f} s)")
        return 0
    want = json.loads(args.check.read_text())
    compared = [n for n in digests if n in want]
    differ = [n for n in compared if digests[n] != want[n]]
    for n in differ:
        print(f"DIFFERS: {n}")
    print(f"{len(compared)} plans compared ({len(digests) - len(compared)} not in {args.check}), "
          f"{len(differ)} differ ({elapsed:.0f} s)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
