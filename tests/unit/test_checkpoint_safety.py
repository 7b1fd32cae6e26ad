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
from recycle.runtime.control import preflight
from recycle.runtime.control.launcher import _check_options
from recycle.runtime.options import CheckpointOptions, LaunchOptions
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.worker.stage import build_stage
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


def fresh_state(built, cfg, stage: int = 0) -> StageState:
    """A built stage with a new optimizer, as a worker loads a checkpoint into it."""
    return StageState(built.module, make_optimizer(built.module, cfg.training), stage, IterationPosition())


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
                              checkpoint.shard_entries(StageState(built.module, optimizer, stage,
                                                                 IterationPosition(step - 1))))
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
        checkpoint.load_stage(tmp_path, 2, fresh_state(built, cfg))
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
        checkpoint.load_stage(tmp_path, 2, StageState(built.module, optimizer, stage, IterationPosition()))
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
    options = LaunchOptions(checkpoint=CheckpointOptions(resume_dir=str(tmp_path)), progress=said.append)
    start, end = _check_options(cfg, build_schedule(cfg, "1f1b"), options)
    assert (start, end) == (4, 6) and said == [f"resuming from {tmp_path / 'step000004'} (step 4; every file "
                                               "checked against its recorded hash)"]
    with pytest.raises(ConfigError, match="past --steps 3"):
        _check_options(cfg, build_schedule(cfg, "1f1b"),
                       LaunchOptions(steps=3, checkpoint=CheckpointOptions(resume_dir=str(tmp_path))))


def test_no_part_file_outlives_a_failed_merge(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    checkpoint.atomic_torch_save({"w": torch.zeros(2)}, checkpoint.part_file(target, 0))
    with pytest.raises(CheckpointError):  # stage 1's part is missing
        checkpoint.merge_stage_parts(target, 2, {})
    assert not list(tmp_path.iterdir())


# -- issue 21 item 4: files of a checkpoint folder are reached without links, regular only, size-bounded ------------
def _record_hash(root: Path, step: int, name: str, data: bytes) -> None:
    """Record `data`'s SHA-256 for `name` in the step's recycle.json, as an attacker with write access can."""
    manifest_path = checkpoint.step_dir(root, step) / checkpoint.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def _plant(root: Path, kind: str) -> Path:
    """Replace one file (or folder) of step 2 by a link or a special file; return the path."""
    where = checkpoint.step_dir(root, 2)
    if kind == "shard -> /etc/passwd":  # with its hash recorded: only the link gives it away
        path = where / "stage1" / "__0_0.distcp"
        path.unlink()
        path.symlink_to("/etc/passwd")
        _record_hash(root, 2, "stage1/__0_0.distcp", Path("/etc/passwd").read_bytes())
    elif kind == ".metadata -> /dev/zero":  # read 7 GB before the fix
        path = where / ".metadata"
        path.unlink()
        path.symlink_to("/dev/zero")
    elif kind.startswith("FIFO "):  # hung preflight before the fix
        path = where / kind.removeprefix("FIFO ")
        path.unlink()
        os.mkfifo(path)
    elif kind == "stage folder -> elsewhere":
        other = root.parent / "other"
        write_checkpoint(other, 2)
        path = where / "stage1"
        import shutil

        shutil.rmtree(path)
        path.symlink_to(other / "step000002" / "stage1")
    else:
        raise AssertionError(kind)
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["shard -> /etc/passwd", ".metadata -> /dev/zero", "FIFO recycle.json",
                                  "FIFO .metadata", "FIFO stage0/__0_0.distcp", "stage folder -> elsewhere"])
def test_links_and_special_files_in_a_checkpoint_are_refused(tmp_path: Path, kind: str) -> None:
    """Every file is reached from the checkpoint folder without following a link and must be a regular file:
    refused (never skipped over quietly, as for a file that would run code), in preflight and in the workers'
    load."""
    root = tmp_path / "ck"
    write_checkpoint(root, 2)
    path = _plant(root, kind)
    with pytest.raises(CheckpointError, match="refused") as info:
        preflight.find_resume_point(config(), root)
    assert str(path) in str(info.value)
    cfg = config()
    built = build_stage(cfg, 0)  # stage 0's load checks every data file the metadata names, stage 1's too
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint.load_stage(root, 2, fresh_state(built, cfg))


def test_a_data_file_linked_after_preflight_is_refused_by_the_dcp_reader(tmp_path: Path, monkeypatch) -> None:
    """DCP's own reader opens the data files: recycle's opens each one inside the folder, without links, so a file
    swapped for a link between preflight and the workers' load is refused there too."""
    write_checkpoint(tmp_path, 2)
    where = checkpoint.step_dir(tmp_path, 2)
    metadata = checkpoint.read_metadata(where, verify_files=True, root=tmp_path)
    data = where / "stage0" / "__0_0.distcp"
    copy = tmp_path / "copy.distcp"
    copy.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(copy)
    state = {k: torch.empty(tuple(e.size), dtype=e.properties.dtype) for k, e in
             metadata.state_dict_metadata.items() if k == "wte.weight"}
    monkeypatch.setattr(checkpoint, "_check_data_files", lambda *args: None)  # as if swapped just after the check
    with pytest.raises(CheckpointError, match="symbolic link.*refused"):
        checkpoint._dcp_load(state, where, tmp_path)


def test_a_metadata_file_over_its_size_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    write_checkpoint(tmp_path, 2)
    size = (checkpoint.step_dir(tmp_path, 2) / ".metadata").stat().st_size
    monkeypatch.setattr(checkpoint, "METADATA_LIMIT", size - 1)
    with pytest.raises(CheckpointError, match=f"is {size:,} bytes, more than a checkpoint's .metadata may have"):
        checkpoint.read_metadata(checkpoint.step_dir(tmp_path, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero"])
def test_a_latest_pointer_that_is_not_a_regular_file_is_reported_and_ignored(tmp_path: Path, kind: str) -> None:
    write_checkpoint(tmp_path, 2)
    pointer = tmp_path / "latest"
    pointer.unlink()
    os.mkfifo(pointer) if kind == "FIFO" else pointer.symlink_to("/dev/zero")
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2 and len(point.warnings) == 1 and "latest" in point.warnings[0] \
        and "refused" in point.warnings[0]
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint.latest_step(tmp_path)


def test_the_coordinators_files_replace_a_planted_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    """.metadata, recycle.json and `latest` are recycle's own files: a link planted there is replaced, and the
    file it points to is left alone (a root launcher would otherwise overwrite it)."""
    cfg = config()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    root = tmp_path / "ck"
    write_checkpoint(root, 2, latest=False)
    for name in (".metadata", checkpoint.MANIFEST):
        (checkpoint.step_dir(root, 2) / name).symlink_to(victim)
    (root / "latest").symlink_to(victim)
    assert checkpoint.mark_latest(root, 2, cfg.num_stages)
    assert victim.read_text() == "precious\n"
    assert not any(p.is_symlink() for p in (root / "latest", checkpoint.step_dir(root, 2) / ".metadata"))
    assert preflight.find_resume_point(cfg, root).step == 2


def _metadata_with(root: Path, field: str) -> Path:
    """Step 2's .metadata with one field of another type or shape (hash recorded, so only the check stops it)."""
    where = checkpoint.step_dir(root, 2)
    metadata = pickle.loads((where / ".metadata").read_bytes())
    entries = metadata.state_dict_metadata
    optimizer_key = next(k for k in entries if k.startswith("optimizer.") and k.endswith(".exp_avg"))
    if field == "size given as an int":
        entries["wte.weight"].size = 8192
    elif field == "train.rng shape 10^13":
        entries["train.rng.stage0"].size = torch.Size([10 ** 13])
        entries["train.rng.stage0"].chunks[0].sizes = torch.Size([10 ** 13])
    elif field == "train.rng shape 10^13, storage too":  # a sparse data file could claim that much
        entries["train.rng.stage0"].size = torch.Size([10 ** 13])
        entries["train.rng.stage0"].chunks[0].sizes = torch.Size([10 ** 13])
        index = next(i for i in metadata.storage_data if i.fqn == "train.rng.stage0")
        info = metadata.storage_data[index]
        metadata.storage_data[index] = type(info)(info.relative_path, info.offset, 10 ** 13)
    elif field == "model dtype as a string":
        entries["wte.weight"].properties.dtype = "float32"
    elif field == "optimizer dtype as a string":
        entries[optimizer_key].properties.dtype = "float32"
    elif field == "step of shape (10^12,)":
        entries["train.step"].size = torch.Size([10 ** 12])
        entries["train.step"].chunks[0] = type(entries["train.step"].chunks[0])(torch.Size([0]),
                                                                                 torch.Size([10 ** 12]))
    elif field == "chunks not a list":
        entries["wte.weight"].chunks = "x"
    elif field == "a negative storage length":
        index = next(iter(metadata.storage_data))
        info = metadata.storage_data[index]
        metadata.storage_data[index] = type(info)(info.relative_path, info.offset, -1)
    else:
        raise AssertionError(field)
    return rewrite_metadata(root, 2, pickle.dumps(metadata))


@pytest.mark.parametrize("field", ["size given as an int", "train.rng shape 10^13",
                                   "train.rng shape 10^13, storage too", "model dtype as a string",
                                   "optimizer dtype as a string", "step of shape (10^12,)", "chunks not a list",
                                   "a negative storage length"])
def test_every_metadata_field_is_checked_for_type_and_shape(tmp_path: Path, field: str) -> None:
    """Before: a TypeError traceback in preflight (an int size), or preflight passed and every worker failed (an
    RNG state of 10^13 bytes to allocate, a dtype string). Now each is a damaged checkpoint: preflight falls back
    to an older intact one, and a worker's load is a CheckpointError, never a traceback or an allocation."""
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2)
    path = _metadata_with(tmp_path, field)
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 1 and str(path) in point.warnings[0] and "damaged" in point.warnings[0]
    cfg = config()
    built = build_stage(cfg, 0)
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint.load_stage(tmp_path, 2, fresh_state(built, cfg))


@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_dcps_checkpoint_exception_on_load_is_a_checkpoint_error(tmp_path: Path, damage: str) -> None:
    """DCP's CheckpointException derives from BaseException and escaped `except Exception`: a data file that
    reads wrong is now a CheckpointError (an Exception) naming the folder."""
    write_checkpoint(tmp_path, 2)
    data = checkpoint.shard_dir(tmp_path, 2, 0) / "__0_0.distcp"
    blob = data.read_bytes()
    data.write_bytes(b"\0" * len(blob) if damage == "zeroed" else blob[:300])
    cfg = config()
    built = build_stage(cfg, 0)
    for load in (lambda: checkpoint.load_model_state(tmp_path),
                 lambda: checkpoint.load_stage(tmp_path, 2, fresh_state(built, cfg))):
        with pytest.raises(CheckpointError) as info:
            load()
        assert str(checkpoint.step_dir(tmp_path, 2)) in str(info.value)
        assert "damaged" in str(info.value) or "truncated" in str(info.value)


@pytest.mark.timeout(60)
def test_a_fifo_in_a_shard_does_not_hang_the_coordinators_merge(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2, latest=False)
    manifest = checkpoint.shard_dir(tmp_path, 2, 1) / checkpoint.SHARD_MANIFEST
    manifest.unlink()
    os.mkfifo(manifest)
    assert checkpoint.mark_latest(tmp_path, 2, 2) is False  # not complete: the coordinator tries again later
    assert not (tmp_path / "latest").exists()


@pytest.mark.parametrize("digits,problem", [(5000, "more than a 'latest' pointer may have"),
                                            (19, "not a step directory name")])
def test_a_latest_pointer_with_thousands_of_digits_is_reported_not_a_traceback(tmp_path: Path, digits: int,
                                                                               problem: str) -> None:
    """Before: int() of 5,000 digits raised ValueError (a traceback). The pointer is read with a 4 KB bound and
    step names are at most 18 digits."""
    write_checkpoint(tmp_path, 2)
    (tmp_path / "latest").write_text("step" + "9" * digits + "\n")
    point = preflight.find_resume_point(config(), tmp_path)
    assert point.step == 2 and problem in point.warnings[0]
    with pytest.raises(ConfigError, match=problem):
        checkpoint.latest_step(tmp_path)
