"""Read a run's metrics (`recycle train --metrics FILE`, or `metrics_path=` in recycle.train) into a plot: loss (and
the held-out loss of [training] eval_every) and tokens/s per step, recoveries marked. Headless (matplotlib's Agg
backend).

    python examples/plot_metrics.py METRICS.jsonl [METRICS.jsonl ...] [--out metrics.png]     (a few seconds)

With several files (e.g. the rounds of examples/train_loop.py) the steps are plotted in file order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(paths: list[str]) -> tuple[list[dict], list[dict], list[dict]]:
    """(step records, recovery records, evaluation records with a loss) of JSON-lines metrics files, in order (chaos
    events are left out)."""
    steps, recoveries, evaluations = [], [], []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            event = record.get("event")
            if event is None:
                steps.append(record)
            elif event == "recovery":
                recoveries.append(record)
            elif event == "eval" and record.get("loss") is not None:
                evaluations.append(record)
    return steps, recoveries, evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="JSON-lines metrics file(s)")
    parser.add_argument("--out", default="out/examples/metrics.png")
    args = parser.parse_args()
    steps, recoveries, evaluations = read_metrics(args.metrics)
    if not steps:
        raise SystemExit(f"error: no step records in {', '.join(args.metrics)}; pass the file of a run's --metrics")
    x = [s["step"] for s in steps]
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    loss_ax.plot(x, [s["loss"] for s in steps], marker="o", label="train")
    if evaluations:
        loss_ax.plot([e["step"] for e in evaluations], [e["loss"] for e in evaluations], marker="s",
                     color="tab:orange", label="held-out")
        loss_ax.legend()
    loss_ax.set_ylabel("loss")
    speed_ax.plot(x, [s["tokens_per_s"] for s in steps], marker="o", color="tab:green")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    for recovery in recoveries:
        for ax in (loss_ax, speed_ax):
            ax.axvline(recovery.get("step", 0), color="tab:red", linestyle="--", linewidth=1)
    fig.suptitle(f"{len(steps)} steps, {len(recoveries)} recoveries")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"{len(steps)} steps (loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}), {len(recoveries)} "
          f"recoveries; wrote {out}")


if __name__ == "__main__":
    main()
