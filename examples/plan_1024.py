"""Plan and simulate a 1,024-GPU job from Python: D=64 pipelines x S=16 stages, 8 workers down, then a day of
generated failures replayed for ReCycle and checkpoint-restart. No processes, no torch.

    python examples/plan_1024.py      (~30 s on a laptop CPU)
"""

from __future__ import annotations

import random
import time

import recycle

# GPT-3-like per-stage costs in microseconds for one micro-batch (F, input-gradient B, weight-gradient W).
CONFIG = {
    "name": "gpt-1024",
    "time_unit": "us",
    "topology": {"num_replicas": 64, "num_stages": 16},
    "workload": {"num_microbatches": 128, "microbatch_size": 1, "seq_len": 2048},
    "costs": {"forward": 10_000, "backward_input": 10_000, "backward_weight": 9_000, "optimizer": 20_000},
}


def main() -> None:
    config = recycle.config_from_dict(CONFIG)
    rng = random.Random(0)
    failed = [(replica, rng.randrange(config.num_stages)) for replica in rng.sample(range(64), 8)]
    started = time.perf_counter()
    plan = recycle.plan(config, failed)
    planned = time.perf_counter() - started
    result = recycle.simulate(plan, config)
    baseline = recycle.simulate(recycle.schedule(config, "1f1b"), config)
    print(f"{config.topology.num_workers} workers, {len(failed)} down "
          f"({' '.join(f'{r}:{s}' for r, s in sorted(failed))}): planned {plan.num_actions:,} actions in "
          f"{planned:.1f} s")
    print(f"iteration {result.period / 1e6:.3f} s vs fault-free 1F1B {baseline.period / 1e6:.3f} s "
          f"({result.period / baseline.period:.3f}x)")
    trace = recycle.load_trace(config, generate="poisson:nodes=1024,hours=24,mtbf_h=2000,repair_h=4,seed=1")
    job = recycle.simulate_trace(config, trace, systems=["recycle", "checkpoint-restart"], period_model="estimate")
    for name, run in sorted(job.runs.items()):
        print(f"{name:20s} goodput {run.goodput:6.1%}")


if __name__ == "__main__":
    main()
