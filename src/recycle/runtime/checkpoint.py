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
merges the shards' metadata and moves `latest` only after every shard of the step is complete. Files are untrusted
on reading: DCP's `.metadata` is a pickle, so it is read with an unpickler that admits only DCP's metadata classes
(and its hash must match recycle.json); tensors are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from recycle.errors import CheckpointError, ConfigError
from recycle.fileio import atomic_write_bytes, atomic_write_text

__all__ = ["preload", "atomic_torch_save", "atomic_write_text", "step_dir", "shard_dir", "key_prefix", "stage_state",
           "save_shard", "load_stage", "mark_latest", "latest_step", "read_metadata", "read_manifest",
           "load_model_state", "load_full_model", "merge_stage_parts", "part_file", "safe_load", "RUN_FILE",
           "MANIFEST", "SHARD_MANIFEST", "FORMAT", "safe_reader"]

RUN_FILE = "run.json"  # the fingerprint of the run writing a checkpoint directory (runtime.preflight writes it)
MANIFEST = "recycle.json"  # per step: what recycle knows about the DCP checkpoint (written last, with the hashes)
SHARD_MANIFEST = "shard.json"  # per stage shard: its files' hashes (written last: the shard is complete)
FORMAT = 3  # 3 = DCP folders keyed by the whole model's names
OPTIMIZER_PREFIX = "optimizer.state."
STEP_KEY = "train.step"

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


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save, atomically (serialised in memory, then written with fileio's temp-file-and-rename)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def shard_dir(root: str | Path, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage{stage}"


def key_prefix(stage: int, model_factory: str = "") -> str:
    """The built-in GPT's stages partition the whole model's names; a user factory's stages may reuse names."""
    return f"stage{stage}." if model_factory else ""


def read_run_fingerprint(root: str | Path) -> dict[str, Any] | None:
    """The fingerprint in DIR/run.json, or None when there is none (or it is not a JSON object)."""
    try:
        data = json.loads((Path(root) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- saving -------------------------------------------------------------------------------------------------------
def _trainable_names(module: nn.Module) -> list[str]:
    """Parameter names in the optimizer's order (it was built from module.parameters() that require grad)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def stage_state(module: nn.Module, optimizer: Any, stage: int, done_steps: int, prefix: str = "",
                copy: bool = True) -> dict[str, torch.Tensor]:
    """One stage's checkpoint entries, flat and keyed by whole-model names (copied to CPU when `copy`, so that the
    training step can go on while a background thread writes them)."""
    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True) if copy else t.detach()

    state = {prefix + name: own(t) for name, t in module.state_dict().items()}
    names = _trainable_names(module)
    for index, per_param in optimizer.state_dict()["optimizer"]["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):  # torch.optim keeps None for a state not made yet (SGD momentum)
                state[f"{OPTIMIZER_PREFIX}{prefix}{names[index]}.{key}"] = own(value)
    state[STEP_KEY] = torch.tensor(done_steps, dtype=torch.int64)
    state[f"train.rng.stage{stage}"] = torch.get_rng_state()
    return state


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
    its successor wrote)."""
    import torch.distributed.checkpoint as dcp

    _guard_dcp_logging()
    where = shard_dir(root, step, stage)
    temporary = where.with_name(f"{where.name}.{_writer_tag()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(temporary), no_dist=True)
    if before_write is not None:
        before_write()
    files = {p.name: _sha256(p) for p in sorted(temporary.iterdir()) if p.is_file()}
    atomic_write_text(temporary / SHARD_MANIFEST, json.dumps({"step": step, "stage": stage, "layers": list(layers),
                                                              "files": files}, indent=1) + "\n")
    if before_commit is not None:
        before_commit()
    old = where.with_name(f"{where.name}.old.{_writer_tag()}.tmp")
    if where.exists():
        os.replace(where, old)
    os.replace(temporary, where)
    for stale in where.parent.glob(f"{where.name}.*.tmp"):  # the old copy, and any left by a writer that died
        shutil.rmtree(stale, ignore_errors=True)


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


def _remove_dead_writers_leftovers(root: str | Path, up_to: int) -> None:
    """Temporary shard folders of steps <= `up_to` whose writer (a process of this host) is gone: a writer killed
    mid-save whose step was never completed (a newer one was)."""
    host = socket.gethostname()
    for folder in Path(root).glob("step*/stage*.tmp"):
        match = re.fullmatch(r"step(\d+)", folder.parent.name)
        parts = folder.name.split(".")
        if not match or int(match.group(1)) > up_to or len(parts) < 5 or parts[-4] != host:
            continue
        try:
            os.kill(int(parts[-3]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def mark_latest(root: str | Path, step: int, num_stages: int) -> bool:
    """Merge the S complete shards of `step` into one DCP checkpoint (.metadata, recycle.json), then point
    `latest` at it; called by the coordinator once every stage's writer has reported its shard. False (nothing
    marked; try again later) while a shard is being replaced by a writer that saves the step again."""
    try:
        _merge(root, step, num_stages)
    except (OSError, ValueError, KeyError):
        return False
    atomic_write_text(Path(root) / "latest", step_dir(root, step).name + "\n")
    _remove_dead_writers_leftovers(root, step)
    return True


def _merge(root: str | Path, step: int, num_stages: int) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    where = step_dir(root, step)
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    files: dict[str, str] = {}
    layers = []
    for stage in range(num_stages):
        shard = json.loads((shard_dir(root, step, stage) / SHARD_MANIFEST).read_text())
        layers.append(shard["layers"])
        files.update({f"stage{stage}/{name}": digest for name, digest in shard["files"].items()})
        part = _safe_unpickle((shard_dir(root, step, stage) / ".metadata").read_bytes(),
                              shard_dir(root, step, stage) / ".metadata")
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
    atomic_write_bytes(where / ".metadata", blob)
    files[".metadata"] = hashlib.sha256(blob).hexdigest()
    atomic_write_text(where / MANIFEST, json.dumps({
        "format": FORMAT, "step": step, "num_stages": num_stages, "layers": layers, "run": read_run_fingerprint(root),
        "files": files}, indent=1, sort_keys=True) + "\n")


def latest_step(root: str | Path) -> int:
    """The step of the last complete checkpoint in `root`."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        raise ConfigError(f"--resume {str(root)!r}: no checkpoint there (no 'latest' file); pass a directory "
                          "written by --checkpoint-dir")
    name = pointer.read_text().strip()
    try:
        return int(name.removeprefix("step"))
    except ValueError:
        raise ConfigError(f"{pointer}: holds {name!r}, not a step directory name like 'step000004'; the "
                          "checkpoint directory is damaged") from None


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
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds more than a DCP checkpoint's metadata ({exc}); refused without "
                              "running it, since loading it could execute code. Use a checkpoint written by "
                              "recycle, and do not resume from files of unknown origin") from None
    except Exception as exc:  # truncated, empty, garbage
        raise CheckpointError(f"{path} is damaged or not a DCP checkpoint's metadata ({type(exc).__name__}: "
                              f"{str(exc)[:100]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} is not a DCP checkpoint's metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # bytes entries would be read with an unrestricted load
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor; recycle checkpoints hold tensors only")
    for info in metadata.storage_data.values():
        relative = Path(str(getattr(info, "relative_path", "")))
        if relative.is_absolute() or ".." in relative.parts or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: a storage entry points at {str(relative)!r} (outside the checkpoint "
                                  "folder, or through a transform); refused")
    return metadata


def read_manifest(where: str | Path) -> dict[str, Any]:
    """A step folder's recycle.json, checked to be one."""
    path = Path(where) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (an incomplete checkpoint, or not written by recycle)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{path} is not a recycle checkpoint manifest")
    return manifest


def read_metadata(where: str | Path, verify_files: bool = False) -> Any:
    """The DCP metadata of a step folder, after checking its hash against recycle.json (and, with `verify_files`,
    every data file's), unpickled with the restricted unpickler."""
    where = Path(where)
    manifest = read_manifest(where)
    path = where / ".metadata"
    try:
        data = path.read_bytes()
    except OSError:
        raise CheckpointError(f"{path} is missing (an incomplete checkpoint)") from None
    if hashlib.sha256(data).hexdigest() != manifest["files"].get(".metadata"):
        raise CheckpointError(f"{path} does not match the hash in {MANIFEST} (damaged or replaced)")
    if verify_files:
        for name, digest in manifest["files"].items():
            file = where / name
            if name == ".metadata":
                continue
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(f"{where / MANIFEST} names {name!r}, outside the checkpoint folder")
            if not file.is_file():
                raise CheckpointError(f"{file} is missing (incomplete checkpoint)")
            if _sha256(file) != digest:
                raise CheckpointError(f"{file} is damaged (its SHA-256 differs from the one recorded when it was "
                                      "written: truncated, empty or overwritten)")
    return _safe_unpickle(data, path)


def safe_reader(where: str | Path) -> Any:
    """DCP's FileSystemReader for an untrusted recycle checkpoint folder: its metadata is read by read_metadata
    (hash-checked, restricted unpickling); tensors DCP reads with torch.load(weights_only=True) itself."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return read_metadata(self.path)

    return SafeReader(where)


def _dcp_load(state: dict[str, torch.Tensor], where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=safe_reader(where), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP wraps a reader's errors per rank (CheckpointException.failures)
        for failure in getattr(exc, "failures", {}).values():
            inner = getattr(failure, "exception", failure)
            if isinstance(inner, CheckpointError):
                raise inner from None
        text = str(exc).strip().splitlines() or [type(exc).__name__]
        raise CheckpointError(f"{where}: cannot be loaded ({type(exc).__name__}: {text[-1][:200]})") from None


def load_stage(root: str | Path, step: int, stage: int, module: nn.Module, optimizer: Any,
               model_factory: str = "") -> None:
    """Load a stage's parameters, optimizer state and schedule position from the checkpoint of `step`, whatever the
    number of stages it was written with (the keys are the whole model's)."""
    where = step_dir(root, step)
    metadata = read_metadata(where)
    prefix = key_prefix(stage, model_factory)
    state: dict[str, torch.Tensor] = {prefix + name: t for name, t in module.state_dict().items()}
    names = _trainable_names(module)
    optimizer_keys: dict[int, dict[str, str]] = {}
    for index, name in enumerate(names):
        head = f"{OPTIMIZER_PREFIX}{prefix}{name}."
        for key, entry in metadata.state_dict_metadata.items():
            if key.startswith(head) and "." not in key[len(head):]:
                state[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                optimizer_keys.setdefault(index, {})[key[len(head):]] = key
    state[STEP_KEY] = torch.zeros((), dtype=torch.int64)
    # The CPU generator's position. Dropout is seeded per forward, so this matters little; under another number of
    # stages this stage's entry is another stage's (or absent), which is just as harmless.
    rng_key = f"train.rng.stage{stage}"
    has_rng = rng_key in metadata.state_dict_metadata
    if has_rng:
        state[rng_key] = torch.empty(tuple(metadata.state_dict_metadata[rng_key].size), dtype=torch.uint8)
    missing = sorted(k for k in state if k not in metadata.state_dict_metadata)
    if missing:
        raise CheckpointError(f"{where} has no {missing[0]!r} (and {len(missing) - 1} more missing); it is of "
                              "another model")
    _dcp_load(state, where)
    current = optimizer.state_dict()["optimizer"]
    optimizer.load_state_dict({"optimizer": {
        "state": {index: {k: state[key] for k, key in keys.items()} for index, keys in optimizer_keys.items()},
        "param_groups": current["param_groups"]}, "steps": int(state[STEP_KEY])})
    if has_rng:
        torch.set_rng_state(state[rng_key])


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
    where = path if (path / MANIFEST).is_file() else step_dir(path, latest_step(path))
    metadata = read_metadata(where)
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if not key.startswith(OPTIMIZER_PREFIX) and not key.startswith("train.")}
    _dcp_load(state, where)
    return state


def load_full_model(path: str | Path, config: Any) -> nn.Module:
    """The single-process model (`models.gpt.full_model` of `config`) with the weights of a checkpoint directory,
    step folder or --save file, whatever D and S it was trained with."""
    from recycle.models.gpt import full_model
    from recycle.runtime.precision import weights_dtype

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
    return Path(f"{path}.stage{stage}.part")


def merge_stage_parts(path: str | Path, num_stages: int, extra: dict[str, Any]) -> None:
    """Merge the per-stage parameter files written by the workers into one file at `path`. A .pt file holds
    "model", the whole model's state dict (None when two stages use the same parameter name, as a user model's
    stages may), "stages" (each stage's) and `extra`; a .safetensors file holds the whole model's tensors (names
    prefixed "stage{s}." when the stages' names collide) and `extra` as string metadata."""
    try:
        stages = [safe_load(part_file(path, stage)) for stage in range(num_stages)]
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
            atomic_torch_save({"model": merged, "stages": stages, **extra}, path)
    finally:  # success or not, no .part file outlives the merge
        for stage in range(num_stages):
            part_file(path, stage).unlink(missing_ok=True)
