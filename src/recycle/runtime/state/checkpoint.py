"""Checkpoints as torch.distributed.checkpoint (DCP) folders keyed by the whole model's parameter names, the
`latest` pointer, and the merged --save file (.pt or .safetensors).

Layout of DIR/step000004/ (a DCP checkpoint: `dcp.load(state_dict, checkpoint_id=...)` reads it):
  .metadata          DCP's index of every key, merged from the stages' shards when the last one is complete
  recycle.json       step, number of stages and their layers, the run fingerprint, and the SHA-256 of every file
  stage{s}/          stage s's shard: what one DCP `save(no_dist=True)` of that stage wrote, plus shard.json
Keys: the model's state-dict names as the single-process model has them ("blocks.5.attn.c_attn.weight"; a
--model-factory model's are prefixed "stage{s}."), "optimizer.state.{name}.{exp_avg|step|...}" (torch.optim's
per-parameter state, keyed by parameter name), "train.step" and "train.rng.stage{s}". Because the keys are the whole
model's, a checkpoint resumes under another number of stages (the stages take their layers' keys) and loads into
the plain model (`load_full_model`).

Each stage's writer saves on its own, with no process group, so a dead worker never hangs a save. The coordinator
merges the shards' metadata and moves `latest` only after every shard of the step is complete; then it merges any
older step whose shards all came in between two of its polls, removes older steps that can no longer be completed,
and (with `keep`) deletes all but the newest complete checkpoints. Files are untrusted on reading: DCP's `.metadata`
is a pickle, so it is read with an unpickler that admits only DCP's metadata classes (and its hash must match
recycle.json), and every field of it is checked for type, shape and bounds; tensors are read with
`torch.load(weights_only=True)`. Every file is reached from the checkpoint folder without following a symbolic link,
must be a regular file, and the small ones (JSON, `.metadata`) are read with a size bound (fileio.open_inside).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import socket
import stat
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from recycle.errors import CheckpointError, ConfigError, OutputError, RecycleError
from recycle.fileio import (UnsafeFile, atomic_write_bytes, atomic_write_text, is_stream_target, lstat_inside,
                            open_inside, read_inside, relative_parts, sha256_inside)
from recycle.models.tensor_parallel import is_sharded, local_tensor
from recycle.runtime.state.stage_state import OPTIMIZER_PREFIX, RNG_PREFIX, STEP_KEY, StageState

__all__ = ["preload", "atomic_torch_save", "atomic_write_text", "step_dir", "shard_dir", "key_prefix", "shard_entries",
           "save_shard", "load_stage", "mark_latest", "latest_step", "read_metadata", "read_manifest",
           "load_model_state", "load_full_model", "merge_stage_parts", "part_file", "read_stage_parts",
           "remove_stage_parts", "write_merged", "safe_load", "RUN_FILE",
           "MANIFEST", "SHARD_MANIFEST", "FORMAT", "safe_reader"]

RUN_FILE = "run.json"  # the fingerprint of the run writing a checkpoint directory (runtime.preflight writes it)
MANIFEST = "recycle.json"  # per step: what recycle knows about the DCP checkpoint (written last, with the hashes)
SHARD_MANIFEST = "shard.json"  # per stage shard: its files' hashes (written last: the shard is complete)
FORMAT = 3  # 3 = DCP folders keyed by the whole model's names
# Size bounds of the small files read from a checkpoint folder (a larger one is refused, not read): the JSON files
# (recycle.json lists one hash per file), and DCP's .metadata (~200 bytes per tensor: a million tensors fit).
JSON_LIMIT = 16 << 20
METADATA_LIMIT = 256 << 20
POINTER_LIMIT = 4096  # `latest`
_STEP_NAME = re.compile(r"step(\d{6,18})")  # as step_dir names them

# DCP warns once per save/load that it runs without a process group; that is the design here (one writer per stage).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def preload() -> threading.Thread:
    """Import torch.distributed.checkpoint (~1.2 s here) in a background thread, so that the coordinator's first
    merge does not stall its failure detection for that long."""
    def load() -> None:
        import torch.distributed.checkpoint  # noqa: F401

    thread = threading.Thread(target=load, daemon=True, name="recycle-dcp-import")
    thread.start()
    return thread


def atomic_torch_save(obj: Any, path: str | Path, follow: bool = False) -> None:
    """torch.save, atomically (serialised in memory, then written with fileio's temp-file-and-rename; `follow`: as
    a user's output target, see fileio)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue(), follow)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def shard_dir(root: str | Path, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage{stage}"


def key_prefix(stage: int, model_factory: str = "") -> str:
    """The built-in GPT's stages partition the whole model's names; a user factory's stages may reuse names."""
    return f"stage{stage}." if model_factory else ""


def read_run_fingerprint(root: str | Path) -> dict[str, Any] | None:
    """The fingerprint in DIR/run.json, or None when there is none (or it is not a JSON object, or not a regular
    file of bounded size)."""
    try:
        data = json.loads(read_inside(root, RUN_FILE, JSON_LIMIT, "run fingerprint"))
    except (OSError, ValueError, UnsafeFile):
        return None
    return data if isinstance(data, dict) else None


def _read_json(root: str | Path, relative: str, what: str) -> Any:
    """A small JSON file inside a checkpoint folder (open_inside's rules, JSON_LIMIT); OSError when it cannot be
    read, ValueError when it is not JSON, UnsafeFile when it is refused."""
    return json.loads(read_inside(root, relative, JSON_LIMIT, what))


# -- saving -------------------------------------------------------------------------------------------------------
def shard_entries(state: StageState, copy: bool = True) -> dict[str, torch.Tensor]:
    """One stage's checkpoint entries: its state's tensors (copied to CPU when `copy`, so that the training step can
    go on while a background thread writes them). torch.optim keeps None for a state not made yet (SGD momentum):
    such entries are not written."""
    return {key: value.detach().to("cpu", copy=True) if copy else value.detach()
            for key, value in state.state_dict().items() if isinstance(value, torch.Tensor)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_shard(root: str | Path, step: int, stage: int, layers: tuple[int, int], state: dict[str, torch.Tensor],
               before_write: Callable[[], None] | None = None,
               before_commit: Callable[[], None] | None = None) -> None:
    """Write stage `stage`'s shard of `step` with DCP (no process group) into a fresh temporary folder, add its
    shard.json (file hashes), and move it into place. `before_write` (a fault-injection hook) runs when the data is
    on disk and shard.json is not: a crash there leaves only a temporary folder, which the shard's next writer removes
    (or the coordinator, once a newer step is complete and the dead writer's step can no longer be written). A
    shard already in place (a step written again after a recovery) is replaced by two renames, so the coordinator
    never finds a complete step without it. `before_commit` runs right before the shard moves into place (a worker
    checks there that it has not been fenced: a process frozen mid-write that wakes up must not replace the shard
    its successor wrote).

    A failed write (disk full, unwritable; DCP reports its writers' errors as a CheckpointException, which derives
    from BaseException) removes the temporary folder and raises an OutputError naming the shard and the cause."""
    import torch.distributed.checkpoint as dcp

    _guard_dcp_logging()
    where = shard_dir(root, step, stage)
    temporary = where.with_name(f"{where.name}.{_writer_tag()}.tmp")
    try:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(temporary), no_dist=True)
        if before_write is not None:
            before_write()
        files = {p.name: _sha256(p) for p in sorted(temporary.iterdir()) if p.is_file()}
        atomic_write_text(temporary / SHARD_MANIFEST, json.dumps({"step": step, "stage": stage,
                                                                  "layers": list(layers), "files": files},
                                                                 indent=1) + "\n", follow=False)
    except BaseException as exc:
        # No half-written shard is left behind (on a full disk it would keep the disk full). The step folder stays
        # (another stage's writer may be creating its own shard in it); mark_latest removes it once it is stale.
        shutil.rmtree(temporary, ignore_errors=True)
        failure = _write_failure(exc, root, step, stage, where)
        if failure is None:
            raise
        raise failure from None
    if before_commit is not None:
        before_commit()
    old = where.with_name(f"{where.name}.old.{_writer_tag()}.tmp")
    if where.exists():
        os.replace(where, old)
    os.replace(temporary, where)
    for stale in where.parent.glob(f"{where.name}.*.tmp"):  # the old copy, and any left by a writer that died
        shutil.rmtree(stale, ignore_errors=True)


def _inner_errors(exc: BaseException) -> list[BaseException]:
    """The errors inside DCP's CheckpointException (one per rank), or the error itself."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        return [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
    return [exc]


def _write_failure(exc: BaseException, root: str | Path, step: int, stage: int, where: Path) -> RecycleError | None:
    """The one-line error of a failed shard write (None: not a write failure; re-raised as it is)."""
    inner = _inner_errors(exc)
    what = f"the checkpoint of step {step} (stage {stage}) could not be written to {where}"
    for error in inner:
        if getattr(error, "errno", None) == errno.ENOSPC:
            return OutputError(f"{what}: no space left in {Path(root)}; free space there or pick another "
                               "--checkpoint-dir (the partial shard was removed; 'latest' is unchanged)")
    for error in inner:
        if isinstance(error, RecycleError):
            return error
        if isinstance(error, OSError):
            name = f" ({error.filename})" if error.filename else ""
            return OutputError(f"{what}{name}: {error.strerror or error}; check that the --checkpoint-dir is "
                               "writable (the partial shard was removed; 'latest' is unchanged)")
    if inner[0] is not exc and isinstance(inner[0], Exception):
        text = (str(inner[0]).strip().splitlines() or [""])[0][:200]
        return CheckpointError(f"{what}: {type(inner[0]).__name__}: {text}")
    return None


def _guard_dcp_logging() -> None:
    """Make DCP's call logging safe against a process group torn down by another thread.

    DCP logs every call with the c10d rank fields: `dist.is_initialized()`, then `dist.get_rank()`. The writer thread
    saves while the worker's main thread may leave a broken generation (destroy_process_group) in a recovery; in
    between the two calls the save raised "Default process group has not been initialized" and the checkpoint
    was lost (found by the chaos soak). A save with no_dist=True needs no process group, so when the rank fields
    cannot be read the log entry goes without them. Installed once per process; torch is pinned (2.13)."""
    from torch.distributed.checkpoint import logger as dcp_logger

    original = dcp_logger._get_msg_dict
    if getattr(original, "_recycle_guarded", False):
        return

    def get_msg_dict(func_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return original(func_name, *args, **kwargs)
        except (ValueError, RuntimeError):  # the default group went away between is_initialized() and get_rank()
            return {"func_name": func_name}

    get_msg_dict._recycle_guarded = True  # type: ignore[attr-defined]
    dcp_logger._get_msg_dict = get_msg_dict


def _writer_tag() -> str:
    """Names a temporary shard folder after its writer (host, process, thread), so that the coordinator can tell
    a dead writer's leftovers from a live writer's work in progress."""
    return f"{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"


_TEMPORARY = re.compile(r"stage\d+(?:\.old)?\.(?P<host>.+)\.(?P<pid>\d{1,10})\.(?P<thread>\d+)\.tmp")


def _step_folders(root: str | Path) -> dict[int, str]:
    """The step folders of a checkpoint directory, by step: real folders only (a symbolic link named like one is
    never entered, merged or deleted). Removes what an interrupted _remove_step left."""
    folders: dict[int, str] = {}
    try:
        entries = list(os.scandir(root))
    except OSError:
        return folders
    for entry in entries:
        match = _STEP_NAME.fullmatch(entry.name)
        if not match or entry.name != f"step{int(match.group(1)):06d}":
            if entry.name.startswith(".step") and entry.name.endswith(".deleting"):  # a crash interrupted it
                shutil.rmtree(entry.path, ignore_errors=True)
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                folders[int(match.group(1))] = entry.name
        except OSError:
            continue
    return folders


def _clear_dead_writers(folder: Path) -> bool:
    """Remove the temporary shard folders in a step folder whose writer (a process of this host) is gone; True
    when one of a live writer (or of another host's, which cannot be told) remains."""
    host = socket.gethostname()
    busy = False
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return True
    for entry in entries:
        if not (entry.name.startswith("stage") and entry.name.endswith(".tmp")):
            continue
        match = _TEMPORARY.fullmatch(entry.name)
        alive = True
        if match and match.group("host") == host:
            try:
                os.kill(int(match.group("pid")), 0)
            except ProcessLookupError:
                alive = False
            except (PermissionError, OverflowError):
                pass
        if alive:
            busy = True
        else:
            _remove_tree(folder / entry.name)
    return busy


def clear_dead_writers(root: str | Path) -> None:
    """Remove every temporary shard folder whose writer (a process of this host) is gone: a run that failed while
    another worker was writing its shard leaves none behind once its workers are stopped."""
    for name in _step_folders(root).values():
        _clear_dead_writers(Path(root) / name)


def _remove_tree(path: Path) -> None:
    """Remove a folder (a symbolic link: the link only)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _remove_step(root: Path, name: str) -> None:
    """Delete a step folder: renamed out of the step names first (one rename), so that a crash mid-delete never
    leaves a half-deleted folder that looks like a checkpoint."""
    doomed = root / f".{name}.{_writer_tag()}.deleting"
    try:
        os.rename(root / name, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _is_merged(folder: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(folder / MANIFEST).st_mode)
    except OSError:
        return False


def _written_by_this_run(folder: Path, num_stages: int, started_ns: int | None) -> bool:
    """Every stage shard of a step folder is complete (its shard.json is there) and was written after the run
    started (after DIR/run.json, which the run writes first): a step the coordinator skipped, not another run's."""
    for stage in range(num_stages):
        try:
            if not stat.S_ISDIR(os.lstat(folder / f"stage{stage}").st_mode):
                return False
            info = os.lstat(folder / f"stage{stage}" / SHARD_MANIFEST)
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode) or (started_ns is not None and info.st_mtime_ns < started_ns):
            return False
    return True


def mark_latest(root: str | Path, step: int, num_stages: int, keep: int | None = None) -> bool:
    """Merge the S complete shards of `step` into one DCP checkpoint (.metadata, recycle.json), then point
    `latest` at it; called by the coordinator once every stage's writer has reported its shard. False (nothing
    marked; try again later) while a shard is being replaced by a writer that saves the step again.

    Then the older steps are settled: a step whose shards all came in between two polls of the coordinator (it
    marks only the newest complete step) is merged too, a step that can no longer be completed (its writer moved
    on or died; another run's leftovers) is deleted, and with `keep` only the newest `keep` complete checkpoints up
    to `step` are kept."""
    try:
        _merge(root, step, num_stages)
    except (OSError, ValueError, KeyError, TypeError, UnsafeFile):
        return False
    atomic_write_text(Path(root) / "latest", step_dir(root, step).name + "\n", follow=False)
    _settle_older_steps(Path(root), step, num_stages, keep)
    return True


# Per checkpoint directory and run (its run.json's time): the steps found merged with no temporary shard in them,
# not looked into again (a run that keeps every checkpoint would otherwise scan thousands of folders per mark),
# except on every _FULL_SWEEP_EVERY-th mark, which finds a leftover that a fenced writer waking up later may have made.
_SETTLED: dict[tuple[str, int | None], tuple[int, set[int]]] = {}
_FULL_SWEEP_EVERY = 64


def _settle_older_steps(root: Path, latest: int, num_stages: int, keep: int | None) -> None:
    """See mark_latest. A step folder that still holds a live (or another host's) writer's temporary shard is left
    alone: its writer is finishing or will find itself fenced."""
    try:
        started: int | None = os.lstat(root / RUN_FILE).st_mtime_ns
    except OSError:
        started = None
    marks, settled = _SETTLED.get((str(root), started), (0, set()))
    if marks % _FULL_SWEEP_EVERY == 0:
        settled = set()
    _SETTLED[(str(root), started)] = (marks + 1, settled)
    folders = _step_folders(root)
    for step, name in sorted(folders.items()):
        if step > latest:
            break
        if step in settled:
            continue
        folder = root / name
        busy = _clear_dead_writers(folder)
        if _is_merged(folder):
            if not busy:
                settled.add(step)
            continue
        if step == latest or busy:
            continue
        if _written_by_this_run(folder, num_stages, started):
            try:
                _merge(root, step, num_stages)
                settled.add(step)
                continue
            except (OSError, ValueError, KeyError, TypeError, UnsafeFile, CheckpointError):
                pass
        _remove_step(root, name)
        del folders[step]
    if keep is not None:
        complete = [(step, name) for step, name in sorted(folders.items())
                    if step <= latest and (step in settled or _is_merged(root / name))]
        for step, name in complete[:-keep]:
            _remove_step(root, name)
            settled.discard(step)


def _merge(root: str | Path, step: int, num_stages: int) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    where = step_dir(root, step)
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    files: dict[str, str] = {}
    layers = []
    for stage in range(num_stages):
        shard = _read_json(root, f"{where.name}/stage{stage}/{SHARD_MANIFEST}", "shard manifest")
        if not isinstance(shard, dict) or not isinstance(shard.get("files"), dict):
            raise ValueError(f"{shard_dir(root, step, stage) / SHARD_MANIFEST} is not a shard manifest")
        layers.append(shard["layers"])
        files.update({f"stage{stage}/{name}": digest for name, digest in shard["files"].items()})
        relative = f"{where.name}/stage{stage}/.metadata"
        part = _safe_unpickle(read_inside(root, relative, METADATA_LIMIT, "checkpoint's .metadata"),
                              Path(root, relative))
        clash = merged.state_dict_metadata.keys() & part.state_dict_metadata.keys() - {STEP_KEY}
        if clash:
            raise CheckpointError(f"{where}: stages hold the same keys {sorted(clash)[:3]}; the stages of a model "
                                  "must have distinct parameter names")
        merged.state_dict_metadata.update(part.state_dict_metadata)
        merged.planner_data.update(part.planner_data or {})
        for index, info in part.storage_data.items():
            if index.fqn != STEP_KEY or stage == 0:  # every shard has the step; stage 0's copy is the one indexed
                merged.storage_data[index] = _StorageInfo(f"stage{stage}/{info.relative_path}", info.offset,
                                                          info.length)
    blob = pickle.dumps(merged)
    atomic_write_bytes(where / ".metadata", blob, follow=False)
    files[".metadata"] = hashlib.sha256(blob).hexdigest()
    atomic_write_text(where / MANIFEST, json.dumps({
        "format": FORMAT, "step": step, "num_stages": num_stages, "layers": layers, "run": read_run_fingerprint(root),
        "files": files}, indent=1, sort_keys=True) + "\n", follow=False)


def latest_step(root: str | Path) -> int:
    """The step of the last complete checkpoint in `root`."""
    try:
        name = read_inside(root, "latest", POINTER_LIMIT, "'latest' pointer").decode("utf-8", "replace").strip()
    except UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except OSError:
        raise ConfigError(f"--resume {str(root)!r}: no checkpoint there (no 'latest' file); pass a directory "
                          "written by --checkpoint-dir") from None
    match = re.fullmatch(r"(?:step)?(\d{1,18})", name)
    if match is None:
        raise ConfigError(f"{Path(root) / 'latest'}: holds {name[:40]!r}, not a step directory name like "
                          "'step000004'; the checkpoint directory is damaged")
    return int(match.group(1))


# -- reading untrusted checkpoints --------------------------------------------------------------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this admits only the classes DCP's metadata is made of (plain dataclasses,
    torch.Size, dtypes and layouts by name), so a planted file cannot name os.system or any other callable."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of a DCP checkpoint's metadata")


def _safe_unpickle(data: bytes, path: Path) -> Any:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds more than a DCP checkpoint's metadata ({exc}); refused without "
                              "running it, since loading it could execute code. Use a checkpoint written by "
                              "recycle, and do not resume from files of unknown origin") from None
    except Exception as exc:  # truncated, empty, garbage
        raise CheckpointError(f"{path} is damaged or not a DCP checkpoint's metadata ({type(exc).__name__}: "
                              f"{str(exc)[:100]})") from None
    _check_metadata_fields(metadata, path)
    return metadata


_MAX_DIMS = 32


def _is_shape(value: Any) -> bool:
    """A tuple (torch.Size) of at most _MAX_DIMS non-negative ints."""
    return isinstance(value, tuple) and len(value) <= _MAX_DIMS and all(
        type(v) is int and v >= 0 for v in value)


def _check_metadata_fields(metadata: Any, path: Path) -> None:
    """Every field of DCP metadata has the type and shape recycle writes, and every tensor's bytes fit in the
    storage entries that hold it (so a size taken from the file never allocates more than the data files hold):
    a field of another type, or a tensor larger than its data, is a damaged checkpoint, not a traceback (or an
    allocation of terabytes) in every worker."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; the checkpoint is damaged or not written by recycle")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} is not a DCP checkpoint's metadata")
    if not isinstance(metadata.planner_data, (dict, type(None))):
        raise bad("planner_data is not a dict")
    for key, value in (metadata.planner_data or {}).items():
        if not isinstance(key, str) or not isinstance(value, tuple) or \
                not all(isinstance(v, (str, int)) for v in value):
            raise bad(f"planner_data entry {key!r} is not a tuple of names")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or not _is_shape(index.offset):
            raise bad(f"storage index {index!r} is not a (name, offset) index")
        if not isinstance(info, _StorageInfo):
            raise bad(f"storage entry of {index.fqn!r} is a {type(info).__name__}")
        relative = info.relative_path
        try:
            if not isinstance(relative, str):
                raise UnsafeFile(f"{relative!r} is not a path")
            relative_parts(relative)
        except UnsafeFile:
            raise CheckpointError(f"{path}: a storage entry points at {str(relative)!r} (outside the checkpoint "
                                  "folder); refused") from None
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: a storage entry of {index.fqn!r} is read through a transform; refused")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise bad(f"storage entry of {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a name")
        if not isinstance(entry, TensorStorageMetadata):  # bytes entries would be read with an unrestricted load
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor; recycle checkpoints hold tensors only")
        properties = entry.properties
        if not isinstance(properties, TensorProperties) or not isinstance(properties.dtype, torch.dtype) \
                or properties.layout is not torch.strided:
            raise bad(f"entry {key!r} has dtype {getattr(properties, 'dtype', None)!r} and layout "
                      f"{getattr(properties, 'layout', None)!r} (a torch.dtype and strided are expected)")
        if not _is_shape(entry.size):
            raise bad(f"entry {key!r} has size {entry.size!r}, not a shape (a tuple of non-negative ints)")
        if not isinstance(entry.chunks, list):
            raise bad(f"entry {key!r} has chunks {type(entry.chunks).__name__}, not a list")
        elements = 0
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _is_shape(chunk.offsets) \
                    or not _is_shape(chunk.sizes) or len(chunk.offsets) != len(entry.size) \
                    or len(chunk.sizes) != len(entry.size) \
                    or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size)):
                raise bad(f"entry {key!r} has a chunk (offsets {getattr(chunk, 'offsets', None)!r}, sizes "
                          f"{getattr(chunk, 'sizes', None)!r}) that is not a block of its size {tuple(entry.size)}")
            stored = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            need = math.prod(chunk.sizes) * properties.dtype.itemsize
            if stored is None or stored.length < need:
                raise bad(f"entry {key!r} ({tuple(entry.size)}, {properties.dtype}) needs {need:,} bytes at offset "
                          f"{tuple(chunk.offsets)} but its storage entry holds "
                          f"{'none' if stored is None else f'{stored.length:,}'}")
            elements += math.prod(chunk.sizes)
        if elements != math.prod(entry.size):
            raise bad(f"entry {key!r}: its chunks hold {elements:,} elements, its size {tuple(entry.size)} has "
                      f"{math.prod(entry.size):,}")
        if key == STEP_KEY and (tuple(entry.size), properties.dtype) != ((), torch.int64):
            raise bad(f"{STEP_KEY!r} is {tuple(entry.size)} {properties.dtype}, not a scalar int64")
        if key.startswith(RNG_PREFIX) and (tuple(entry.size), properties.dtype) != (_rng_shape(), torch.uint8):
            raise bad(f"{key!r} is {tuple(entry.size)} {properties.dtype}, not the CPU generator's state "
                      f"({_rng_shape()} uint8)")


def _rng_shape() -> tuple[int, ...]:
    return tuple(torch.get_rng_state().shape)


def _locate(where: str | Path, root: str | Path | None) -> tuple[Path, str]:
    """The folder files are resolved against and the step folder's name under it: `root` when the step folder is
    reached from the checkpoint directory (so a linked step folder is refused), else the step folder itself (the
    user named it)."""
    if root is None:
        return Path(where), ""
    return Path(root), Path(where).name


def _inside(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def read_manifest(where: str | Path, root: str | Path | None = None) -> dict[str, Any]:
    """A step folder's recycle.json, checked to be one (`root`: the checkpoint directory `where` is in)."""
    base, prefix = _locate(where, root)
    path = Path(where) / MANIFEST
    try:
        manifest = json.loads(read_inside(base, _inside(prefix, MANIFEST), JSON_LIMIT, "checkpoint manifest"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (an incomplete checkpoint, or not written by recycle)") from None
    except UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or type(manifest.get("step")) is not int \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["files"].items()):
        raise CheckpointError(f"{path} is not a recycle checkpoint manifest")
    return manifest


def read_metadata(where: str | Path, verify_files: bool = False, root: str | Path | None = None) -> Any:
    """The DCP metadata of a step folder, after checking its hash against recycle.json (and, with `verify_files`,
    every data file's), unpickled with the restricted unpickler and checked field by field. Every file is reached
    without following a link (below `root`, the checkpoint directory, when given) and must be a regular file; the
    data files must hold the bytes the metadata places in them."""
    where = Path(where)
    base, prefix = _locate(where, root)
    manifest = read_manifest(where, root)
    path = where / ".metadata"
    try:
        data = read_inside(base, _inside(prefix, ".metadata"), METADATA_LIMIT, "checkpoint's .metadata")
    except UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except OSError:
        raise CheckpointError(f"{path} is missing (an incomplete checkpoint)") from None
    if hashlib.sha256(data).hexdigest() != manifest["files"].get(".metadata"):
        raise CheckpointError(f"{path} does not match the hash in {MANIFEST} (damaged or replaced)")
    if verify_files:
        for name, digest in manifest["files"].items():
            file = where / name
            if name == ".metadata":
                continue
            try:
                relative_parts(name)
            except UnsafeFile:
                raise CheckpointError(f"{where / MANIFEST} names {name!r}, outside the checkpoint folder; "
                                      "refused") from None
            with _file_errors(file):
                actual = sha256_inside(base, _inside(prefix, name))
            if actual != digest:
                raise CheckpointError(f"{file} is damaged (its SHA-256 differs from the one recorded when it was "
                                      "written: truncated, empty or overwritten)")
    metadata = _safe_unpickle(data, path)
    _check_data_files(metadata, where, base, prefix, manifest["files"] if verify_files else None)
    return metadata


@contextlib.contextmanager
def _file_errors(file: Path) -> Iterator[None]:
    """A checkpoint file that is unsafe, missing or unreadable, as one CheckpointError naming it."""
    try:
        yield
    except UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing (incomplete checkpoint)") from None
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read ({exc.strerror or exc})") from None


def _check_data_files(metadata: Any, where: Path, base: Path, prefix: str, hashed: dict[str, str] | None) -> None:
    """Every data file the metadata names is a regular file inside the folder (one the manifest hashes, when
    `hashed`) that holds every byte range placed in it."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for relative, end in ends.items():
        file = where / relative
        if hashed is not None and (relative not in hashed or relative == ".metadata"):
            raise CheckpointError(f"{where / '.metadata'} places data in {relative!r}, a file {MANIFEST} does not "
                                  "list; refused")
        with _file_errors(file):
            size = lstat_inside(base, _inside(prefix, relative)).st_size
        if size < end:
            raise CheckpointError(f"{file} is {size:,} bytes but the checkpoint's metadata places data up to byte "
                                  f"{end:,} (truncated, or the metadata is damaged)")


def safe_reader(where: str | Path, root: str | Path | None = None) -> Any:
    """DCP's FileSystemReader for an untrusted recycle checkpoint folder: its metadata is read by read_metadata
    (hash-checked, restricted unpickling, every field checked); every data file is opened as open_inside does (no
    link followed, regular files only); tensors DCP reads with torch.load(weights_only=True) itself."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    folder = Path(where)
    base, prefix = _locate(where, root)

    class InsideFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "rb":
                raise CheckpointError(f"{path}: a checkpoint being loaded is not written")
            try:
                relative = Path(path).relative_to(folder).as_posix()
            except ValueError:
                raise CheckpointError(f"{path} is outside the checkpoint folder {folder}; refused") from None
            try:
                fd = open_inside(base, _inside(prefix, relative))
            except UnsafeFile as exc:
                raise CheckpointError(str(exc)) from None
            with os.fdopen(fd, "rb") as stream:
                yield stream

    class SafeReader(FileSystemReader):
        def __init__(self, path: str | Path) -> None:
            super().__init__(path)
            self.fs = InsideFileSystem()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return read_metadata(folder, root=root)

    return SafeReader(where)


def _dcp_load(state: dict[str, torch.Tensor], where: Path, root: str | Path | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=safe_reader(where, root), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps a reader's errors per rank; a BaseException
        inner = _inner_errors(exc)
        for error in inner:
            if isinstance(error, CheckpointError):
                raise error from None
        first = inner[0]
        text = (str(first).strip().splitlines() or [type(first).__name__])[0].split(". ")[0][:200]
        name = f" {first.filename}" if isinstance(first, OSError) and first.filename else ""
        raise CheckpointError(f"{where}: cannot be loaded ({type(first).__name__}{name}: {text}); the checkpoint "
                              "is damaged or incomplete") from None


def load_stage(root: str | Path, step: int, state: StageState) -> None:
    """Load a stage's state (parameters, optimizer state, schedule and iteration position) from the checkpoint of
    `step`, whatever the number of stages, replicas and tensor-parallel ranks it was written with (the keys and
    tensors are the whole model's; a tensor-parallel rank takes its shard of each)."""
    where = step_dir(root, step)
    metadata = read_metadata(where, root=root)
    available = metadata.state_dict_metadata
    # DCP loads in place: into the live module tensors, and into new ones for the optimizer's entries (a fresh
    # optimizer holds none yet). The CPU generator's position: dropout is seeded per forward, so it matters little;
    # under another number of stages this stage's entry is another stage's (or absent), which is just as harmless.
    # A tensor-parallel stage's sharded tensors are read whole (the checkpoint holds the unsharded layout, whatever T
    # wrote it) and sliced to this rank's shard by load_state_dict; its replicated ones load in place.
    template: dict[str, torch.Tensor] = {
        key: torch.empty(tuple(live.shape), dtype=live.dtype) if is_sharded(live) else local_tensor(live)
        for key, live in state.module_entries().items()}
    template.update({key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                     for key, entry in available.items() if state.parameter_of(key) is not None})
    template[STEP_KEY] = torch.zeros((), dtype=torch.int64)
    if state.rng_key in available:
        template[state.rng_key] = torch.empty(tuple(available[state.rng_key].size), dtype=torch.uint8)
    missing = sorted(k for k in template if k not in available)
    if missing:
        raise CheckpointError(f"{where} has no {missing[0]!r} (and {len(missing) - 1} more missing); it is of "
                              "another model")
    _dcp_load(template, where, root)
    state.load_state_dict(template)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint directory (its `latest` step), a step folder, or a --save
    file (.pt or .safetensors). Plain tensors only; nothing in the files runs."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            try:
                return load_file(str(path))
            except Exception as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({str(exc)[:120]})") from None
        saved = safe_load(path)
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise CheckpointError(f"{path} holds no whole-model state dict (a --save file of a model whose stages "
                                  "share parameter names keeps them per stage in 'stages')")
        return saved["model"]
    if (path / MANIFEST).is_file():
        where, root = path, None
    else:
        where, root = step_dir(path, latest_step(path)), path
    metadata = read_metadata(where, root=root)
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if not key.startswith(OPTIMIZER_PREFIX) and not key.startswith("train.")}
    _dcp_load(state, where, root)
    return state


def load_full_model(path: str | Path, config: Any) -> nn.Module:
    """The single-process model (`models.gpt.full_model` of `config`) with the weights of a checkpoint directory,
    step folder or --save file, whatever D and S it was trained with."""
    from recycle.models.gpt import full_model
    from recycle.runtime.state.precision import weights_dtype

    training = config.training
    model = full_model(config.model, config.workload.seq_len, training.seed, weights_dtype(training.dtype))
    state = load_model_state(path)
    own = model.state_dict().keys()
    missing, unexpected = sorted(own - state.keys()), sorted(state.keys() - own)
    if missing or unexpected:
        raise CheckpointError(f"{path} does not fit this config's model (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); use the [model] it was trained with")
    model.load_state_dict(state)
    return model


def safe_load(path: str | Path, mmap: bool = False) -> Any:
    """torch.load of an untrusted file: tensors and plain data only. A file that would run code (a pickled
    callable, any non-allow-listed global) is refused with a CheckpointError and nothing in it executes; a
    truncated or non-checkpoint file is a CheckpointError too."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        detail = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), "")
        raise CheckpointError(f"{path} holds more than tensors and plain data ({detail or 'a pickled object'}); "
                              "refused without running it, since loading it could execute code. Use a file written "
                              "by recycle, and do not resume from files of unknown origin") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        first = (str(exc).splitlines()[0] if str(exc) else type(exc).__name__).split(". ")[0]
        raise CheckpointError(f"{path} is damaged or not a checkpoint (truncated, empty or overwritten: "
                              f"{first[:120]})") from None


# -- the --save file ----------------------------------------------------------------------------------------------
def part_file(path: str | Path, stage: int) -> Path:
    """Where a stage's worker writes its part of the --save file: next to it, or, when the target is a character
    device or FIFO (/dev/null: written into, fileio), in the temporary folder (single node: preflight refuses such
    a target on several nodes), named after the user and the target."""
    if is_stream_target(path):
        digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"recycle-save-{os.getuid()}-{digest}.stage{stage}.part"
    return Path(f"{path}.stage{stage}.part")


def read_stage_parts(path: str | Path, num_stages: int) -> list[dict[str, torch.Tensor]]:
    """The per-stage parameter files the workers wrote beside `path` (part_file), stage by stage."""
    return [safe_load(part_file(path, stage)) for stage in range(num_stages)]


def remove_stage_parts(path: str | Path, num_stages: int) -> None:
    for stage in range(num_stages):
        part_file(path, stage).unlink(missing_ok=True)


def merge_stage_parts(path: str | Path, num_stages: int, extra: dict[str, Any]) -> None:
    """Merge the per-stage parameter files written by the workers into one file at `path` (write_merged); no part
    file outlives the merge."""
    try:
        write_merged(path, read_stage_parts(path, num_stages), extra)
    finally:
        remove_stage_parts(path, num_stages)


def write_merged(path: str | Path, stages: list[dict[str, torch.Tensor]], extra: dict[str, Any]) -> None:
    """The stages' parameters as one file at `path`. A .pt file holds "model", the whole model's state dict (None
    when two stages use the same parameter name, as a user model's stages may), "stages" (each stage's) and `extra`;
    a .safetensors file holds the whole model's tensors (names prefixed "stage{s}." when the stages' names collide)
    and `extra` as string metadata."""
    merged: dict[str, torch.Tensor] | None = {}
    for state in stages:
        if merged is not None and merged.keys() & state.keys():
            merged = None
        elif merged is not None:
            merged.update(state)
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save

        tensors = merged if merged is not None else {
            f"stage{s}.{k}": v for s, state in enumerate(stages) for k, v in state.items()}
        metadata = {k: json.dumps(v) for k, v in extra.items()}
        atomic_write_bytes(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))
    else:
        atomic_torch_save({"model": merged, "stages": stages, **extra}, path, follow=True)
