"""Fit the job simulator's per-event costs to a runtime run's own records: its --metrics lines and checkpoint folder."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.traces.model import JobCosts

__all__ = ["RuntimeCalibration", "read_metrics", "calibrate", "iteration_work_units"]

# The runtime's checkpoint folder (recycle.runtime.state.checkpoint): DIR/step000005/stage{s}/shard.json is written
# last by a stage's writer (its shard is complete), DIR/step000005/recycle.json by the coordinator's merge (the
# checkpoint is complete and `latest` may point at it). Their modification times are the runtime's record of when.
_STEP_DIR = re.compile(r"^step(\d{6,})$")
_SHARD_DONE = "shard.json"
_MERGED = "recycle.json"


@dataclass(frozen=True)
class RuntimeCalibration:
    """Per-event costs as one runtime run measured them (seconds; counts say how many events each mean is over)."""

    failure_pause_s: float  # failure -> first actions of the new plan (detection, plan lookup, new groups)
    failures: int
    join_pause_s: float  # survivors stop at a boundary -> first actions with the re-joined worker
    joins: int
    restore_pause_s: float  # a stage lost every replica -> first actions after the checkpoint restore
    restores: int
    redo_fraction: float  # mean share of the global batch thrown away before a failure, redone afterwards
    checkpoint_every_steps: int  # 0: unknown (no checkpoint folder and none given)
    checkpoint_write_s: float  # step end -> the slowest stage's shard written (median)
    checkpoint_latency_s: float  # step end -> the checkpoint merged, restorable (median)
    checkpoints: int  # checkpoints the latencies are measured over

    def costs(self, base: JobCosts = JobCosts()) -> JobCosts:
        """`base` with ReCycle's event costs replaced by these. The simulator charges a failure detect_s +
        plan_switch_s and a join plan_switch_s, so plan_switch_s is the join pause and detect_s the rest of the
        failure pause; a restore costs restart_s (no plan switch on top). Events of a kind the run did not have
        keep `base`'s value."""
        switch = self.join_pause_s if self.joins else base.plan_switch_s
        fields: dict[str, Any] = {"plan_switch_s": switch, "redo_fraction": self.redo_fraction}
        if self.failures:
            fields["detect_s"] = max(0.0, self.failure_pause_s - switch)
        if self.restores:
            fields["restart_s"] = self.restore_pause_s
        if self.checkpoint_every_steps:
            fields["checkpoint_every_steps"] = float(self.checkpoint_every_steps)
            fields["checkpoint_latency_s"] = self.checkpoint_latency_s
        return replace(base, **fields)

    def describe(self) -> str:
        ckpt = (f"checkpoint every {self.checkpoint_every_steps} steps, write {self.checkpoint_write_s:.3f} s, "
                f"restorable {self.checkpoint_latency_s:.3f} s after its step (median of {self.checkpoints})"
                if self.checkpoint_every_steps else "no checkpoint timing")
        return (f"failure pause {self.failure_pause_s:.3f} s (mean of {self.failures}), re-join pause "
                f"{self.join_pause_s:.3f} s ({self.joins}), restore pause {self.restore_pause_s:.3f} s "
                f"({self.restores}), redone {self.redo_fraction:.3f} of an iteration per failure; {ckpt}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `recycle train --metrics FILE` (one JSON object a line; a line cut by a crash is skipped)."""
    records = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the runtime metrics {str(path)!r}: {e.strerror or e}; pass the file "
                          "`recycle train --metrics FILE` wrote") from None
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    if not any("event" not in r and isinstance(r.get("step"), int) for r in records):
        raise ConfigError(f"{path}: no step records; pass the file `recycle train --metrics FILE` wrote")
    return records


def iteration_work_units(config: Config) -> float:
    """Busy time of one whole iteration over all workers, in config time units: every micro-batch's forward and
    backward on every stage (the work a redone share is a fraction of)."""
    c = config.costs
    per_mb = sum(c.forward[s] + c.backward_input[s] + c.backward_weight[s] for s in range(config.num_stages))
    return config.num_replicas * config.num_microbatches * per_mb


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _redone_share(recovery: dict[str, Any], steps: list[dict[str, Any]], iteration_work_s: float) -> float:
    """The share of one iteration that a failure threw away before it happened: the iteration's progress at the
    failure (time since the last step ended / that step's period) capped by the work the record says was redone
    (redone_s / the iteration's work). Work redone after the failure, while the survivors went on until they
    noticed (a hang), is inside the failure's pause already."""
    t = float(recovery["failure_time"])
    before = [s for s in steps if s["end_time"] <= t]
    if not before:
        return 0.0
    last = max(before, key=lambda s: s["end_time"])
    period = float(last.get("period_s") or 0.0)
    progress = min(1.0, (t - last["end_time"]) / period) if period > 0 else 0.0
    if iteration_work_s <= 0:
        return progress
    return min(progress, float(recovery.get("redone_s", 0.0)) / iteration_work_s)


def _checkpoint_times(root: Path, steps: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """(checkpointed steps, write latencies, restorable latencies) from the checkpoint folder's files."""
    done, writes, merges = [], [], []
    for folder in sorted(root.iterdir()):
        match = _STEP_DIR.match(folder.name)
        if not match or folder.is_symlink() or not (folder / _MERGED).is_file():
            continue
        step = int(match.group(1))
        merged = (folder / _MERGED).stat().st_mtime
        shards = [p.stat().st_mtime for p in folder.glob(f"stage*/{_SHARD_DONE}") if p.is_file()]
        # The step's end as the run that wrote this checkpoint reported it (a restore re-runs and re-reports steps).
        ends = [s["end_time"] for s in steps if s["step"] == step and s["end_time"] <= merged]
        done.append(step)
        if ends and shards:
            writes.append(max(shards) - max(ends))
            merges.append(merged - max(ends))
    return done, writes, merges


def calibrate(records: list[dict[str, Any]], iteration_work_s: float = 0.0, checkpoint_dir: str | Path = "",
              checkpoint_every: int = 0) -> RuntimeCalibration:
    """Fit the per-event costs to a run's records: pauses are the means of its recoveries' `resumed_s` by kind, the
    redone share the mean of `_redone_share` over its failures, the checkpoint interval `checkpoint_every` (else the
    greatest common divisor of the checkpointed steps in `checkpoint_dir`), and the checkpoint latencies the medians
    over `checkpoint_dir`'s checkpoints. `iteration_work_s`: one iteration's busy seconds over all workers
    (`iteration_work_units` x seconds per unit); 0 caps the redone share by progress alone."""
    if not (math.isfinite(iteration_work_s) and iteration_work_s >= 0):
        raise ConfigError(f"iteration_work_s = {iteration_work_s} must be a number of seconds >= 0")
    try:
        return _calibrate(records, iteration_work_s, checkpoint_dir, checkpoint_every)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"the runtime's records are not as `recycle train --metrics` writes them ({type(e).__name__}: "
                          f"{e}); pass that file unchanged") from None


def _calibrate(records: list[dict[str, Any]], iteration_work_s: float, checkpoint_dir: str | Path,
               checkpoint_every: int) -> RuntimeCalibration:
    steps = [r for r in records if "event" not in r and isinstance(r.get("step"), int)]
    recoveries = [r for r in records if r.get("event") == "recovery"]
    restores = [r for r in recoveries if r.get("restored_step") is not None]
    failures = [r for r in recoveries if r["workers"] and r.get("restored_step") is None]
    joins = [r for r in recoveries if r.get("joined") and not r["workers"] and r.get("restored_step") is None]
    every, write_s, latency_s, count = checkpoint_every, 0.0, 0.0, 0
    if checkpoint_dir:
        if not Path(checkpoint_dir).is_dir():
            raise ConfigError(f"checkpoint folder {str(checkpoint_dir)!r} is not a directory; pass the run's "
                              "--checkpoint-dir (--calibrate-checkpoints DIR)")
        done, writes, merges = _checkpoint_times(Path(checkpoint_dir), steps)
        if not every and done:
            every = math.gcd(*done)
        if merges:
            write_s, latency_s, count = statistics.median(writes), statistics.median(merges), len(merges)
    return RuntimeCalibration(
        failure_pause_s=_mean([r["resumed_s"] for r in failures]), failures=len(failures),
        join_pause_s=_mean([r["resumed_s"] for r in joins]), joins=len(joins),
        restore_pause_s=_mean([r["resumed_s"] for r in restores]), restores=len(restores),
        redo_fraction=_mean([_redone_share(r, steps, iteration_work_s) for r in failures]),
        checkpoint_every_steps=every, checkpoint_write_s=max(0.0, write_s), checkpoint_latency_s=max(0.0, latency_s),
        checkpoints=count)
