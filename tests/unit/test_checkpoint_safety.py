"""Checkpoints as untrusted input (issue 11, items 2 and 5): a pickle that would run code is refused unexecuted; a
resume is validated before any worker starts (completeness, shapes, run fingerprint) and falls back to the newest
intact checkpoint with a warning."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from recycle.cli import main
from recycle.config import parse_config
from recycle.errors import CheckpointError, ConfigError
from recycle.runtime import checkpoint, preflight
from recycle.runtime.launcher import LaunchOptions, _check_options
from recycle.runtime.optim import AdamW
from recycle.runtime.stage import build_stage
from recycle.schedules.fault_free import build_schedule

RAW = {
    "topology": {"num_replicas": 1, "num_stages": 2},
    "workload": {"num_microbatches": 2, "microbatch_size": 1, "seq_len": 8},
    "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
    "model": {"preset": "tiny"},
    "training": {"steps": 6, "lr": 0.01, "seed": 3, "dtype": "float32"},
}
TOML = """
[topology]
num_replicas = 1
num_stages = 2
[workload]
num_microbatches = 2
microbatch_size = 1
seq_len = 8
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[model]
preset = "tiny"
[training]
steps = 6
lr = 0.01
seed = 3
dtype = "float32"
"""


def config(**training):
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["training"].update(training)
    return parse_config(raw, name="ck")


def write_checkpoint(root: Path, step: int, cfg=None, latest: bool = True) -> None:
    """What the workers write: one stage file per stage, with the run fingerprint from run.json."""
    cfg = cfg or config()
    checkpoint.atomic_write_text(root / checkpoint.RUN_FILE, preflight._dumps(preflight.run_fingerprint(cfg)))
    for stage in range(cfg.num_stages):
        built = build_stage(cfg, stage)
        checkpoint.save_stage(root, step, stage, built.layout, built.module, AdamW(built.module.parameters()))
    if latest:
        checkpoint.mark_latest(root, step)


class Evil:
    """Unpickling this runs `os.system(touch MARKER)`: the attack of issue 11 item 2."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_malicious(path: Path, marker: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"step": 2, "stage": 0, "layers": [0, 2], "model": Evil(marker), "optimizer": {}, "rng": None}, buffer)
    path.write_bytes(buffer.getvalue())


@pytest.mark.timeout(60)
def test_a_malicious_stage_file_is_refused_and_never_runs(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    evil, marker = checkpoint.stage_file(tmp_path, 2, 0), tmp_path / "PWNED"
    plant_malicious(evil, marker)
    # Control: the file really is an attack (an unsafe load runs it).
    torch.load(evil, weights_only=False)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointError, match="refused without running it") as info:
        checkpoint.read_stage(evil)
    assert "system" in str(info.value)  # names the forbidden global
    with pytest.raises(CheckpointError, match="refused"):  # the worker's load path, too
        built = build_stage(config(), 0)
        checkpoint.load_stage(tmp_path, 2, 0, built.layout, built.module, AdamW(built.module.parameters()))
    with pytest.raises(CheckpointError, match="refused"):  # never skipped over by the fallback
        preflight.find_resume_point(config(), tmp_path)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_cli_resume_from_a_malicious_checkpoint_exits_2_before_any_worker(tmp_path: Path, capsys) -> None:
    (tmp_path / "cfg.toml").write_text(TOML)
    ck = tmp_path / "ck"
    write_checkpoint(ck, 2)
    plant_malicious(checkpoint.stage_file(ck, 2, 1), tmp_path / "PWNED")
    assert main(["train", "--config", str(tmp_path / "cfg.toml"), "--resume", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "refused" in err and "Traceback" not in err
    assert not (tmp_path / "PWNED").exists()


def test_stage_files_hold_plain_data_only(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1)
    state = torch.load(checkpoint.stage_file(tmp_path, 1, 0), weights_only=True)  # would raise on any object
    assert isinstance(state["rng"], torch.Tensor) and state["rng"].dtype == torch.uint8
    assert state["run"] == preflight.run_fingerprint(config()) and state["format"] == checkpoint.FORMAT


def test_resume_uses_latest_when_intact(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    point = preflight.find_resume_point(config(), tmp_path)
    assert (point.step, point.warnings) == (4, ())


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete", "garbage"])
def test_a_damaged_latest_falls_back_to_the_newest_intact_step(tmp_path: Path, damage: str) -> None:
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    write_checkpoint(tmp_path, 6, latest=False)  # newer than `latest`: never trusted
    checkpoint.mark_latest(tmp_path, 4)
    path = checkpoint.stage_file(tmp_path, 4, 1)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(b"not a checkpoint at all")
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2
    assert len(point.warnings) == 1 and str(path) in point.warnings[0] and "step 2" in point.warnings[0]


def test_latest_naming_a_missing_step_is_reported_as_such(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    (tmp_path / "latest").write_text("step000999\n")
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2 and "'latest' names step 999 but" in point.warnings[0] and "missing" in point.warnings[0]
    checkpoint.stage_file(tmp_path, 2, 0).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*'latest' names step 999"):
        preflight.find_resume_point(config(), tmp_path)


def test_a_checkpoint_of_another_model_or_run_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"different run \(seed 3 -> 4\)"):
        preflight.find_resume_point(config(seed=4), tmp_path)
    other = parse_config({**RAW, "model": {"preset": "custom", "n_layer": 4, "n_head": 2, "n_embd": 64}})
    with pytest.raises(CheckpointError, match="different run"):
        preflight.find_resume_point(other, tmp_path)
    three = parse_config({**RAW, "topology": {"num_replicas": 1, "num_stages": 3},
                          "model": {"preset": "custom", "n_layer": 6, "n_head": 2, "n_embd": 32}})
    with pytest.raises(CheckpointError, match="different run"):
        preflight.find_resume_point(three, tmp_path)


def test_shapes_are_checked_even_without_a_fingerprint(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    (tmp_path / checkpoint.RUN_FILE).unlink()
    write_checkpoint(tmp_path, 2)  # rewrite with run.json present, then strip it from the files
    for s in range(2):
        path = checkpoint.stage_file(tmp_path, 2, s)
        state = torch.load(path, weights_only=True)
        state.pop("run")
        checkpoint.atomic_torch_save(state, path)
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2 and "no run fingerprint" in point.warnings[0]
    wide = parse_config({**RAW, "model": {"preset": "custom", "n_layer": 4, "n_head": 2, "n_embd": 64}})
    with pytest.raises(CheckpointError, match=r"wte.weight is \(\(256, 32\)"):
        preflight.find_resume_point(wide, tmp_path)


def test_a_changed_learning_rate_is_accepted_with_a_warning(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    point = preflight.find_resume_point(config(lr=0.001), tmp_path)
    assert point.step == 2 and "lr changed since the checkpoint (0.01 -> 0.001)" in point.warnings[0]


def test_the_launcher_says_which_checkpoint_it_resumes(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 4)
    said: list[str] = []
    cfg = config()
    start, end = _check_options(cfg, build_schedule(cfg, "1f1b"),
                                LaunchOptions(resume_dir=str(tmp_path), progress=said.append))
    assert (start, end) == (4, 6) and said == [f"resuming from {tmp_path / 'step000004'} (step 4; 2 stage file(s) "
                                               "checked)"]
    with pytest.raises(ConfigError, match="past --steps 3"):
        _check_options(cfg, build_schedule(cfg, "1f1b"), LaunchOptions(steps=3, resume_dir=str(tmp_path)))


def test_no_part_file_outlives_a_failed_merge(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    checkpoint.atomic_torch_save({"w": torch.zeros(2)}, checkpoint.part_file(target, 0))
    with pytest.raises(CheckpointError):  # stage 1's part is missing
        checkpoint.merge_stage_parts(target, 2, {})
    assert not list(tmp_path.iterdir())
