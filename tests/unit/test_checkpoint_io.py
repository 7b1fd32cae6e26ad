"""Writing checkpoints (issue 21 item 4): a failed shard write is one error line and leaves no temporary shard
(DCP's CheckpointException derives from BaseException), steps the coordinator skipped are merged or removed, and
--keep-checkpoints N keeps the newest N complete checkpoints."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_safety import TOML, config, write_checkpoint

from recycle.cli import main
from recycle.errors import ConfigError, OutputError
from recycle.runtime.control import preflight
from recycle.runtime.options import CheckpointOptions
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.worker.stage import build_stage


def _stage_state(stage: int, step: int) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    cfg = config()
    built = build_stage(cfg, stage)
    return built.layout, checkpoint.shard_entries(StageState(
        built.module, make_optimizer(built.module, cfg.training), stage, IterationPosition(step - 1)))


@pytest.mark.parametrize("where", ["write_data", "finish"])
def test_a_full_disk_during_a_shard_write_is_one_line_and_leaves_no_temporary_shard(
        tmp_path: Path, monkeypatch, where: str) -> None:
    """Before: `CheckpointException ranks:dict_keys([0])` and a traceback (it derives from BaseException, so
    `except Exception` missed it), and a half-written .tmp shard folder left on the full disk."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, where, full)
    layout, state = _stage_state(0, 2)
    with pytest.raises(OutputError) as info:
        checkpoint.save_shard(tmp_path, 2, 0, layout, state)
    message = str(info.value)
    assert isinstance(info.value, Exception) and "\n" not in message
    assert f"the checkpoint of step 2 (stage 0) could not be written to {checkpoint.shard_dir(tmp_path, 2, 0)}" \
        in message and f"no space left in {tmp_path}" in message
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_another_write_failure_names_the_file_and_the_cause(tmp_path: Path, monkeypatch) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/ck/step000002/stage0/__0_0.distcp")

    monkeypatch.setattr(FileSystemWriter, "finish", denied)
    layout, state = _stage_state(0, 2)
    with pytest.raises(OutputError, match=r"could not be written to .*stage0 \(/ck/step000002/stage0/__0_0.distcp\): "
                                          "Permission denied; check that the --checkpoint-dir is writable"):
        checkpoint.save_shard(tmp_path, 2, 0, layout, state)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_an_interrupt_during_a_shard_write_is_not_swallowed(tmp_path: Path) -> None:
    layout, state = _stage_state(0, 2)

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_shard(tmp_path, 2, 0, layout, state, before_write=interrupt)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def _shards(root: Path, step: int, stages=(0, 1)) -> None:
    for stage in stages:
        layout, state = _stage_state(stage, step)
        checkpoint.save_shard(root, step, stage, layout, state)


def test_mark_latest_merges_the_steps_it_skipped_and_removes_those_that_cannot_complete(tmp_path: Path) -> None:
    """Before: the coordinator marks only the newest complete step of a poll, so every step whose shards all came in
    during one poll (six after a 10 s SIGSTOP of the launcher; a few in any run on a busy machine) stayed an
    unmerged folder no resume could use."""
    cfg = config()
    old = tmp_path / "step000001"  # another run's leftover: written before this run's run.json
    _shards(tmp_path, 1)
    past = time.time() - 100
    for path in old.rglob("*"):
        os.utime(path, (past, past))
    write_checkpoint(tmp_path, 2)  # this run's first checkpoint (run.json written now)
    for step in (3, 4, 5):  # complete, never marked
        _shards(tmp_path, step)
    _shards(tmp_path, 6, stages=(0,))  # stage 1's writer died: can never complete
    busy = checkpoint.shard_dir(tmp_path, 7, 1).with_name(f"stage1.{checkpoint._writer_tag()}.tmp")
    _shards(tmp_path, 7, stages=(0,))
    busy.mkdir()  # a live writer (this process) is still writing stage 1 of step 7
    _shards(tmp_path, 8)
    assert checkpoint.mark_latest(tmp_path, 8, cfg.num_stages)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step"))
    assert names == [f"step{s:06d}" for s in (2, 3, 4, 5, 7, 8)]
    for step in (3, 4, 5):
        assert preflight._check_step(tmp_path, step, preflight.expected_stages(cfg),
                                     preflight.run_fingerprint(cfg), []) is None
        assert checkpoint.read_manifest(checkpoint.step_dir(tmp_path, step))["step"] == step
    assert busy.is_dir() and not (checkpoint.step_dir(tmp_path, 7) / checkpoint.MANIFEST).exists()
    # Its writer dies: the temporary folder now names a process that is gone, so it is a leftover to remove.
    os.rmdir(busy)
    busy.with_name(busy.name.replace(f".{os.getpid()}.", ".999999999.")).mkdir()
    _shards(tmp_path, 9)
    assert checkpoint.mark_latest(tmp_path, 9, cfg.num_stages)
    assert not checkpoint.step_dir(tmp_path, 7).exists()
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".deleting"))]


def test_keep_checkpoints_keeps_the_newest_n_complete_ones(tmp_path: Path) -> None:
    cfg = config()
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step)
    _shards(tmp_path, 5, stages=(0,))  # newer than latest, in progress: never touched
    write_checkpoint(tmp_path, 4, latest=False)
    assert checkpoint.mark_latest(tmp_path, 4, cfg.num_stages, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step"))
    assert names == ["step000003", "step000004", "step000005"]
    assert (tmp_path / "latest").read_text() == "step000004\n"
    assert preflight.find_resume_point(cfg, tmp_path).step == 4
    assert checkpoint.mark_latest(tmp_path, 4, cfg.num_stages, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step000004", "step000005"]


@pytest.mark.parametrize("argv,expected", [
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0 must be an integer >= 1"),
    (["--keep-checkpoints", "-3"], "--keep-checkpoints -3 must be an integer >= 1"),
    (["--keep-checkpoints", "2", "--no-checkpoint-dir"], "--keep-checkpoints 2 needs --checkpoint-dir DIR"),
])
def test_keep_checkpoints_is_validated_before_any_worker(tmp_path: Path, capsys, argv: list[str],
                                                         expected: str) -> None:
    (tmp_path / "cfg.toml").write_text(TOML)
    common = ["train", "--config", str(tmp_path / "cfg.toml")]
    if "--no-checkpoint-dir" in argv:
        argv = [a for a in argv if a != "--no-checkpoint-dir"]
    else:
        common += ["--checkpoint-dir", str(tmp_path / "ck")]
    assert main(common + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err and "Traceback" not in err
    assert not (tmp_path / "ck").exists()


def test_keep_checkpoints_reaches_the_launch_options() -> None:
    from recycle.cli import build_parser
    from recycle.commands.train import _launch_options, node_role

    args = build_parser().parse_args(["train", "--config", "x.toml", "--checkpoint-dir", "ck",
                                      "--keep-checkpoints", "3"])
    options = _launch_options(args, node_role(args, {}), [], [])
    assert options.checkpoint.keep == 3 and CheckpointOptions().keep is None
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        CheckpointOptions(dir="ck", every=1, keep=0)


def test_settled_steps_are_looked_at_again_by_a_new_run_and_every_few_marks(tmp_path: Path, monkeypatch) -> None:
    """mark_latest skips the steps it found merged before (a run keeping thousands of checkpoints scans none of
    them again), but a new run (a new run.json) and every _FULL_SWEEP_EVERY-th mark look again."""
    cfg = config()
    monkeypatch.setattr(checkpoint, "_FULL_SWEEP_EVERY", 3)
    write_checkpoint(tmp_path, 1)  # writes run.json: the run starts
    write_checkpoint(tmp_path, 2, fingerprint=False)  # step 1 is settled now
    dead = checkpoint.step_dir(tmp_path, 1) / "stage0.somehost.1.1.tmp"  # e.g. a fenced writer that woke up
    dead.mkdir()
    dead.rename(dead.with_name(f"stage0.{checkpoint.socket.gethostname()}.999999999.1.tmp"))
    write_checkpoint(tmp_path, 3, fingerprint=False)  # mark 3 of this run: step 1 is not looked at
    assert len(list(checkpoint.step_dir(tmp_path, 1).glob("*.tmp"))) == 1
    write_checkpoint(tmp_path, 4, fingerprint=False)  # mark 4: a full sweep removes the dead writer's leftover
    assert not list(checkpoint.step_dir(tmp_path, 1).glob("*.tmp"))
    import shutil

    shutil.rmtree(checkpoint.step_dir(tmp_path, 2))  # a new run in the same folder, with step 2 written unmerged
    time.sleep(0.01)
    write_checkpoint(tmp_path, 5, latest=False)  # (rewrites run.json first)
    _shards(tmp_path, 2)
    assert checkpoint.mark_latest(tmp_path, 5, cfg.num_stages)
    assert checkpoint.read_manifest(checkpoint.step_dir(tmp_path, 2))["step"] == 2
