"""Checkpoint shards: a round trip of a stage's state, and `latest` only after the coordinator's merge."""

from __future__ import annotations

import torch

from recycle.models.gpt import build_stages
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.worker.process import parameter_digest


def test_checkpoint_round_trip_and_latest(tiny_config, tmp_path) -> None:
    config = tiny_config()
    stage = build_stages(config.model, 2, seed=1, dtype="float64", seq_len=8)[1]
    opt = make_optimizer(stage, config.training)
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    checkpoint.save_shard(tmp_path, 3, 1, (2, 4), checkpoint.shard_entries(StageState(stage, opt, 1,
                                                                                       IterationPosition(2))))
    checkpoint.save_shard(tmp_path, 3, 0, (0, 2), checkpoint.shard_entries(StageState(
        build_stages(config.model, 2, seed=1, dtype="float64", seq_len=8)[0], make_optimizer(stage, config.training),
        0, IterationPosition(2))))
    assert not (tmp_path / "latest").exists()  # only the coordinator's merge makes a step complete
    checkpoint.mark_latest(tmp_path, 3, 2)
    assert checkpoint.latest_step(tmp_path) == 3
    assert not [p for p in tmp_path.rglob("*.tmp")]  # atomic: no temp files left behind

    fresh = build_stages(config.model, 2, seed=2, dtype="float64", seq_len=8)[1]
    fresh_opt = make_optimizer(fresh, config.training)
    position = IterationPosition(snapshot=5)
    checkpoint.load_stage(tmp_path, 3, StageState(fresh, fresh_opt, 1, position))
    assert parameter_digest(fresh) == parameter_digest(stage)
    assert fresh_opt.steps == 3  # the schedule's position is the checkpoint's step
    assert position == IterationPosition(applied=2, snapshot=None)  # and so is the iteration position
    ours, theirs = fresh_opt.state_dict()["optimizer"]["state"], opt.state_dict()["optimizer"]["state"]
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


def test_a_save_survives_the_process_group_going_away_under_it(tiny_config, tmp_path, monkeypatch) -> None:
    """The writer thread saves while the main thread may destroy the process group (a recovery): DCP's call logging
    then saw is_initialized() true and get_rank() failing (chaos soak). Stand-in: a 'group' that is initialized
    but has no default group behind it; the save must still complete."""
    import torch.distributed as dist

    config = tiny_config()
    stage = build_stages(config.model, 2, seed=1, dtype="float64", seq_len=8)[0]
    opt = make_optimizer(stage, config.training)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    checkpoint.save_shard(tmp_path, 2, 0, (0, 2), checkpoint.shard_entries(StageState(stage, opt, 0,
                                                                                       IterationPosition(1))))
    assert (checkpoint.shard_dir(tmp_path, 2, 0) / checkpoint.SHARD_MANIFEST).exists()


def test_clearing_dead_writers_removes_only_the_shards_of_writers_that_are_gone(tmp_path) -> None:
    """A run that failed while a worker was writing: once its workers are stopped, their temporary shard folders
    go; a live writer's (this process's) and other hosts' stay, and a merged shard is never touched."""
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)
    host = socket.gethostname()
    step = checkpoint.step_dir(tmp_path, 4)
    dead = step / f"stage0.{host}.{dead_pid}.1.tmp"
    live = step / f"stage1.{host}.{os.getpid()}.1.tmp"
    foreign = step / f"stage1.old.another-host.{dead_pid}.1.tmp"
    done = checkpoint.shard_dir(tmp_path, 4, 2)
    for folder in (dead, live, foreign, done):
        folder.mkdir(parents=True)
    checkpoint.clear_dead_writers(tmp_path)
    assert not dead.exists()
    assert live.exists() and foreign.exists() and done.exists()
    checkpoint.clear_dead_writers(tmp_path / "missing")  # no checkpoint folder yet: nothing to do
