"""Checkpoints as untrusted input (issue 11, items 2 and 5; DCP folders since issue 12): DCP's pickled .metadata
that would run code is refused unexecuted; a resume is validated before any worker starts (completeness, hashes,
shapes, run fingerprint) and falls back to the newest intact checkpoint with a warning. Also: a checkpoint loads
under another number of stages and into the single-process model, and --save writes safetensors."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from recycle.cli import main
from recycle.config import parse_config
from recycle.errors import CheckpointError, ConfigError
from recycle.runtime import checkpoint, preflight
from recycle.runtime.launcher import LaunchOptions, _check_options
from recycle.runtime.optim import make_optimizer
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


def write_checkpoint(root: Path, step: int, cfg=None, latest: bool = True, fingerprint: bool = True) -> None:
    """What the workers and the coordinator write: one DCP shard per stage (after one optimizer step, so the
    optimizer state exists), merged, with the run fingerprint from run.json."""
    cfg = cfg or config()
    if fingerprint:
        checkpoint.atomic_write_text(root / checkpoint.RUN_FILE, preflight._dumps(preflight.run_fingerprint(cfg)))
    for stage in range(cfg.num_stages):
        built = build_stage(cfg, stage)
        optimizer = make_optimizer(built.module, cfg.training)
        for p in built.module.parameters():
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
        checkpoint.save_shard(root, step, stage, built.layout,
                              checkpoint.stage_state(built.module, optimizer, stage, step))
    if latest:
        checkpoint.mark_latest(root, step, cfg.num_stages)


def rewrite_metadata(root: Path, step: int, blob: bytes) -> Path:
    """Replace a step's .metadata and record its hash in recycle.json, as an attacker with write access can."""
    where = checkpoint.step_dir(root, step)
    (where / ".metadata").write_bytes(blob)
    manifest = json.loads((where / checkpoint.MANIFEST).read_text())
    manifest["files"][".metadata"] = hashlib.sha256(blob).hexdigest()
    (where / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return where / ".metadata"


class Evil:
    """Unpickling this runs `os.system(touch MARKER)`: the attack of issue 11 item 2."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(60)
def test_a_malicious_dcp_metadata_is_refused_and_never_runs(tmp_path: Path) -> None:
    """DCP's FileSystemReader unpickles .metadata with plain pickle.load; ours admits only DCP's metadata classes.
    The planted file's hash is recorded too, so the unpickler (not the hash) is what stops it."""
    write_checkpoint(tmp_path, 2)
    marker = tmp_path / "PWNED"
    evil = rewrite_metadata(tmp_path, 2, pickle.dumps(Evil(marker)))
    pickle.loads(evil.read_bytes())  # control: the file really is an attack (a plain unpickle runs it)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointError, match="refused without running it") as info:
        checkpoint.read_metadata(evil.parent)
    assert "posix.system" in str(info.value) or "os.system" in str(info.value)  # names the forbidden global
    cfg = config()
    built = build_stage(cfg, 0)
    with pytest.raises(CheckpointError, match="refused"):  # the worker's load path, through DCP's reader
        checkpoint.load_stage(tmp_path, 2, 0, built.module, make_optimizer(built.module, cfg.training))
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint.load_model_state(tmp_path)
    with pytest.raises(CheckpointError, match="refused"):  # never skipped over by the fallback
        preflight.find_resume_point(cfg, tmp_path)
    assert not marker.exists()


def test_metadata_with_bytes_entries_or_paths_outside_the_folder_is_refused(tmp_path: Path) -> None:
    """DCP reads a bytes entry with torch.load(weights_only=False): recycle writes none and accepts none; a storage
    entry may not point outside the checkpoint folder."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    write_checkpoint(tmp_path, 2)
    where = checkpoint.step_dir(tmp_path, 2)
    metadata = checkpoint.read_metadata(where)
    original = (where / ".metadata").read_bytes()
    metadata.state_dict_metadata["wte.weight"] = BytesStorageMetadata()
    rewrite_metadata(tmp_path, 2, pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="BytesStorageMetadata"):
        checkpoint.read_metadata(where)
    metadata = pickle.loads(original)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    rewrite_metadata(tmp_path, 2, pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        checkpoint.read_metadata(where)


@pytest.mark.timeout(60)
def test_cli_resume_from_a_malicious_checkpoint_exits_2_before_any_worker(tmp_path: Path, capsys) -> None:
    (tmp_path / "cfg.toml").write_text(TOML)
    ck = tmp_path / "ck"
    write_checkpoint(ck, 2)
    rewrite_metadata(ck, 2, pickle.dumps(Evil(tmp_path / "PWNED")))
    assert main(["train", "--config", str(tmp_path / "cfg.toml"), "--resume", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "refused" in err and "Traceback" not in err
    assert not (tmp_path / "PWNED").exists()


def test_a_checkpoint_is_a_dcp_folder_keyed_by_the_whole_models_names(tmp_path: Path) -> None:
    """Plain DCP reads it (as torchtitan and friends would), under the single-process model's names."""
    import torch.distributed.checkpoint as dcp

    write_checkpoint(tmp_path, 1)
    cfg = config()
    model = checkpoint.load_full_model(tmp_path, cfg)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["optimizer.state.blocks.3.mlp.0.weight.exp_avg"] = torch.zeros(128, 32)
    dcp.load(state, checkpoint_id=str(checkpoint.step_dir(tmp_path, 1)), no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert float(state["optimizer.state.blocks.3.mlp.0.weight.exp_avg"].abs().sum()) > 0
    manifest = checkpoint.read_manifest(checkpoint.step_dir(tmp_path, 1))
    assert manifest["run"] == preflight.run_fingerprint(cfg) and manifest["format"] == checkpoint.FORMAT
    assert manifest["layers"] == [[0, 2], [2, 4]]


@pytest.mark.parametrize("S", [1, 4])
def test_a_checkpoint_loads_under_another_number_of_stages(tmp_path: Path, S: int) -> None:
    """Written by 2 stages, loaded by S: every stage gets its layers' parameters, optimizer state and step."""
    write_checkpoint(tmp_path, 2)
    saved = checkpoint.load_model_state(tmp_path)
    cfg = parse_config({**RAW, "topology": {"num_replicas": 1, "num_stages": S}})
    assert preflight.find_resume_point(cfg, tmp_path).step == 2
    for stage in range(S):
        built = build_stage(cfg, stage)
        optimizer = make_optimizer(built.module, cfg.training)
        checkpoint.load_stage(tmp_path, 2, stage, built.module, optimizer)
        assert all(torch.equal(v, saved[k]) for k, v in built.module.state_dict().items())
        state = optimizer.state_dict()
        assert state["steps"] == 2 and len(state["optimizer"]["state"]) == len(list(built.module.parameters()))
        assert all(float(s["step"]) == 1 for s in state["optimizer"]["state"].values())


def test_save_writes_safetensors_that_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = config()
    stages = [build_stage(cfg, s).module for s in range(2)]
    target = tmp_path / "model.safetensors"
    for s, module in enumerate(stages):
        checkpoint.atomic_torch_save(module.state_dict(), checkpoint.part_file(target, s))
    checkpoint.merge_stage_parts(target, 2, {"step": 6, "config": cfg.to_dict()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(target))
    whole = {k: v for m in stages for k, v in m.state_dict().items()}
    assert loaded.keys() == whole.keys() and all(torch.equal(loaded[k], v) for k, v in whole.items())
    model = checkpoint.load_full_model(target, cfg)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.items())


def test_resume_uses_latest_when_intact(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    point = preflight.find_resume_point(config(), tmp_path)
    assert (point.step, point.warnings) == (4, ())


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete", "garbage", "metadata", "unmerged"])
def test_a_damaged_latest_falls_back_to_the_newest_intact_step(tmp_path: Path, damage: str) -> None:
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    write_checkpoint(tmp_path, 6, latest=False)  # newer than `latest`: never trusted
    (tmp_path / "latest").write_text("step000004\n")
    path = checkpoint.shard_dir(tmp_path, 4, 1) / "__0_0.distcp"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "delete":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    elif damage == "metadata":
        path = checkpoint.step_dir(tmp_path, 4) / ".metadata"
        path.write_bytes(path.read_bytes()[:-10])
    else:  # a crash between the last shard and the merge: no manifest
        path = checkpoint.step_dir(tmp_path, 4) / checkpoint.MANIFEST
        path.unlink()
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2
    assert len(point.warnings) == 1 and str(path) in point.warnings[0] and "step 2" in point.warnings[0]


def test_latest_naming_a_missing_step_is_reported_as_such(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    (tmp_path / "latest").write_text("step000999\n")
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2 and "'latest' names step 999 but" in point.warnings[0] and "missing" in point.warnings[0]
    (checkpoint.shard_dir(tmp_path, 2, 0) / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*'latest' names step 999"):
        preflight.find_resume_point(config(), tmp_path)


def test_a_checkpoint_of_another_model_or_run_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"different run \(seed 3 -> 4\)"):
        preflight.find_resume_point(config(seed=4), tmp_path)
    with pytest.raises(CheckpointError, match=r"different run \(optimizer 'AdamW' -> 'SGD'\)"):
        preflight.find_resume_point(config(optimizer="SGD"), tmp_path)
    other = parse_config({**RAW, "model": {"preset": "custom", "n_layer": 4, "n_head": 2, "n_embd": 64}})
    with pytest.raises(CheckpointError, match="different run"):
        preflight.find_resume_point(other, tmp_path)
    deeper = parse_config({**RAW, "model": {"preset": "custom", "n_layer": 6, "n_head": 2, "n_embd": 32}})
    with pytest.raises(CheckpointError, match="different run"):
        preflight.find_resume_point(deeper, tmp_path)


def test_shapes_are_checked_even_without_a_fingerprint(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2, fingerprint=False)
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
    assert (start, end) == (4, 6) and said == [f"resuming from {tmp_path / 'step000004'} (step 4; every file "
                                               "checked against its recorded hash)"]
    with pytest.raises(ConfigError, match="past --steps 3"):
        _check_options(cfg, build_schedule(cfg, "1f1b"), LaunchOptions(steps=3, resume_dir=str(tmp_path)))


def test_no_part_file_outlives_a_failed_merge(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    checkpoint.atomic_torch_save({"w": torch.zeros(2)}, checkpoint.part_file(target, 0))
    with pytest.raises(CheckpointError):  # stage 1's part is missing
        checkpoint.merge_stage_parts(target, 2, {})
    assert not list(tmp_path.iterdir())
