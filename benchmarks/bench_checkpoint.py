"""Checkpoint cost on the training step's critical path, side by side in one run: no checkpoint, a synchronous DCP
save, recycle's background writer (copy the state, a thread saves it), and torch's `dcp.async_save` (DCP stages
the state, a thread saves it). The model is the `small` preset as one stage with AdamW, training on one process;
every mode checkpoints every K steps (each background mode has one save in flight, as the workers do).
"blocked" is the median time the training thread spends in a checkpoint call; "mean step" is the mean wall time of
a step including the checkpoint calls and the compute a background save competes with.

Run: .venv/bin/python benchmarks/bench_checkpoint.py [--steps N] [--every K] [--preset small]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from recycle.config import ModelSpec, Training
from recycle.data import builtin_windows
from recycle.models.gpt import full_model
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState


class _Mode:
    """One way to checkpoint: `save(step)` is what the training thread calls; `finish()` waits for the rest."""

    def __init__(self, root: Path, model: torch.nn.Module, optimizer: Any) -> None:
        self.root, self.model, self.optimizer = root, model, optimizer
        self.pending: list[Any] = []

    def state(self, step: int, copy: bool) -> dict[str, torch.Tensor]:
        state = StageState(self.model, self.optimizer, 0, IterationPosition(step - 1))
        return checkpoint.shard_entries(state, copy=copy)

    def save(self, step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        for item in self.pending:
            item.result() if hasattr(item, "result") else item()
        self.pending.clear()


class _None(_Mode):
    def save(self, step: int) -> None:
        pass


class _Sync(_Mode):
    def save(self, step: int) -> None:
        checkpoint.save_shard(self.root, step, 0, (0, 0), self.state(step, copy=False))


class _Writer(_Mode):
    """What the workers do: runtime.checkpoint_writer's copy-then-thread, without the store."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)

    def save(self, step: int) -> None:
        for future in self.pending:  # at most one in flight, as in the workers
            future.result()
        state = self.state(step, copy=True)
        self.pending = [self.pool.submit(checkpoint.save_shard, self.root, step, 0, (0, 0), state)]


class _DcpAsync(_Mode):
    def save(self, step: int) -> None:
        where = checkpoint.shard_dir(self.root, step, 0)
        where.mkdir(parents=True, exist_ok=True)
        for future in self.pending:  # DCP allows one async save in flight per checkpointer
            future.result()
        self.pending = [dcp.async_save(self.state(step, copy=False), storage_writer=dcp.FileSystemWriter(where),
                                       no_dist=True)]


def run(mode_cls: type, preset: str, steps: int, every: int, root: Path) -> tuple[float, float, float]:
    """(mean step s, median blocked s, total wall s) of `steps` steps with a checkpoint every `every`."""
    torch.manual_seed(0)
    spec = ModelSpec(preset=preset)
    training = Training(lr=1e-3)
    model = full_model(spec, 64, seed=0, dtype="float32")
    optimizer = make_optimizer(model, training)
    load = builtin_windows(8, 64)
    mode = mode_cls(root, model, optimizer)
    step_times, blocked = [], []
    started = time.perf_counter()
    for step in range(steps + 1):
        t0 = time.perf_counter()
        tokens, targets = load(step, 0)
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        t1 = time.perf_counter()
        if (step + 1) % every == 0:
            mode.save(step + 1)
            blocked.append(time.perf_counter() - t1)
        if step > 0:  # the first step warms up
            step_times.append(time.perf_counter() - t0)
    mode.finish()
    return statistics.mean(step_times), statistics.median(blocked), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = full_model(ModelSpec(preset=args.preset), 64, seed=0)
    params = sum(p.numel() for p in model.parameters())
    print(f"preset {args.preset}: {params / 1e6:.2f} M parameters, AdamW (state {3 * params * 4 / 1e6:.1f} MB in "
          f"float32), micro-batch 8 x 64 tokens, {args.steps} steps, a checkpoint every {args.every}, 1 thread")
    modes: dict[str, Callable[..., Any]] = {"no checkpoint": _None, "synchronous dcp.save": _Sync,
                                            "recycle writer (copy + thread)": _Writer,
                                            "dcp.async_save (no_dist)": _DcpAsync}
    print(f"{'mode':32s} {'mean step ms':>12s} {'blocked ms':>11s} {'wall s':>7s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in modes.items():
            results[name] = run(cls, args.preset, args.steps, args.every, Path(tmp) / name.split()[0])
            step, blocked, wall = results[name]
            print(f"{name:32s} {step * 1e3:12.1f} {blocked * 1e3:11.2f} {wall:7.2f}")
    sync = results["synchronous dcp.save"][1]
    for name in ("recycle writer (copy + thread)", "dcp.async_save (no_dist)"):
        print(f"{name}: blocks the step {results[name][1] / sync:.3f}x as long as the synchronous save "
              f"({results[name][1] * 1e3:.2f} ms vs {sync * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
