"""Your own training loop around the API: build a config in Python, train in rounds, look at each round's metrics,
and change course between rounds (here: a worker is marked down for the second round, resuming from the checkpoint).

    python examples/train_loop.py [--out out/examples/train_loop]     (~1 min on a laptop CPU; 4 worker processes)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import recycle

CONFIG = {
    "name": "example-loop",
    "topology": {"num_replicas": 2, "num_stages": 2},
    "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 16},
    "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
    "model": {"preset": "tiny"},
    "training": {"steps": 4, "lr": 3e-3, "seed": 0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/examples/train_loop")
    parser.add_argument("--set", action="append", default=[], help="section.key=value, e.g. training.lr=1e-2")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = recycle.config_from_dict(CONFIG, args.set)
    checkpoints = out / "checkpoints"
    rounds = [(2, []), (4, ["1:1"])]  # (train up to this step, workers down in that round)
    for number, (until, down) in enumerate(rounds, 1):
        result = recycle.train(config, down=down, steps=until, checkpoint_dir=str(checkpoints), checkpoint_every=1,
                               resume_dir=str(checkpoints) if number > 1 else "",
                               metrics_path=str(out / f"metrics-round{number}.jsonl"), progress=None,
                               recover=False)
        losses = ", ".join(f"{m.loss:.4f}" for m in result.steps)
        print(f"round {number}: steps {result.start_step + 1}..{result.end_step} "
              f"(workers down: {' '.join(down) or 'none'}) losses {losses}")
    print(f"wrote {out}/metrics-round1.jsonl, metrics-round2.jsonl")


if __name__ == "__main__":
    main()
