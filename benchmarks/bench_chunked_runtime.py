"""A fault-free two-chunk V plan against the one-chunk ZB-H1 plan, trained for real side by side (--emulate-costs).

Run: nice -n 10 .venv/bin/python benchmarks/bench_chunked_runtime.py [--stages 4] [--microbatches 8] [--steps 8]
     [--slot-ms 40] [--rounds 2]

The same tiny GPT (8 layers, float64, D=1, unit costs F=B=W=1, optimizer 0) is trained by `recycle.train` twice per
round, alternating: with one stage per worker on ZB-H1 (staggered optimizer), and with chunks_per_worker = 2 on the
chunked planner's fault-free V plan (staggered). Every action is padded to its config cost (a chunk's F, B, W to half
its worker's stage cost), so the step period follows the plan; the runtime's overheads (messages, the V's local
hand-off, Python) come on top. Printed: each plan's simulated period in slots, its measured median step period (the
first step left out: it holds start-up) in slots of --slot-ms, and the V/ZB-H1 ratios of both, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from recycle.api import select_plan, train  # noqa: E402
from recycle.config import Config, parse_config  # noqa: E402
from recycle.runtime.worker.emulate import Emulation  # noqa: E402
from recycle.sim.simulator import simulate  # noqa: E402


def config_for(stages: int, microbatches: int, steps: int, chunks: int) -> Config:
    config = parse_config({
        "time_unit": "slot",
        "topology": {"num_replicas": 1, "num_stages": stages},
        "workload": {"num_microbatches": microbatches, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1, "optimizer": 0},
        "model": {"preset": "tiny", "n_layer": 2 * stages},
        "training": {"steps": steps, "lr": 0.01, "dtype": "float64", "seed": 3},
    }, name="bench-chunked-runtime")
    if chunks == 1:
        return config
    return replace(config, topology=replace(config.topology, chunks_per_worker=chunks, chunk_layout="v"))


def measured_period_slots(config: Config, slot_ms: float) -> tuple[float, float]:
    """(simulated period, measured median step period) in slots."""
    plan = select_plan(config)
    simulated = simulate(plan, config).period
    result = train(config, plan, recover=False, emulation=Emulation(slot_ms=slot_ms), progress=None)
    periods = [s.period_s for s in result.steps[1:]]
    return simulated, statistics.median(periods) * 1e3 / slot_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slot-ms", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    S, M = args.stages, args.microbatches
    print(f"D=1, S={S}, M={M}, tiny GPT with {2 * S} layers, float64, unit costs, {args.steps} steps, "
          f"{args.slot_ms:g} ms per slot, {args.rounds} round(s) alternating")
    rows: dict[str, list[tuple[float, float]]] = {"zb-h1 (1 chunk)": [], "v (2 chunks)": []}
    for _ in range(args.rounds):
        for name, chunks in (("zb-h1 (1 chunk)", 1), ("v (2 chunks)", 2)):
            rows[name].append(measured_period_slots(config_for(S, M, args.steps, chunks), args.slot_ms))
    print(f"{'plan':<18}{'simulated':>10}{'measured (median of rounds)':>30}   per round")
    summary = {}
    for name, runs in rows.items():
        simulated, measured = runs[0][0], statistics.median(m for _, m in runs)
        summary[name] = (simulated, measured)
        print(f"{name:<18}{simulated:>10.2f}{measured:>30.2f}   {', '.join(f'{m:.2f}' for _, m in runs)}")
    (s1, m1), (s2, m2) = summary["zb-h1 (1 chunk)"], summary["v (2 chunks)"]
    print(f"V / ZB-H1: simulated {s2 / s1:.3f}, measured {m2 / m1:.3f}")


if __name__ == "__main__":
    main()
