"""Atomic per-stage checkpoints (model, optimizer, step, RNG), the `latest` pointer, and merged final weights.

Layout: DIR/step000004/stage0.pt ... stage{S-1}.pt, DIR/latest containing "step000004", and DIR/run.json (the
fingerprint of the run writing there, copied into every stage file). A step directory is only named by `latest`
after every stage file of that step is complete, so a crash mid-save never corrupts resume. Replicas of a stage
hold identical state, so one live replica per stage writes it; the files are per stage, not per worker, which lets
a run resume under any failure state. Files are untrusted on reading: only tensors and plain data are loaded
(`torch.load(weights_only=True)`), never pickled code.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any, Callable

import torch

from recycle.errors import CheckpointError, ConfigError
from recycle.fileio import atomic_write_bytes, atomic_write_text
from recycle.runtime.optim import StageOptimizer

__all__ = ["atomic_torch_save", "atomic_write_text", "step_dir", "stage_file", "save_stage", "save_stage_state",
           "load_stage", "mark_latest", "latest_step", "merge_stage_parts", "part_file", "read_stage", "safe_load",
           "RUN_FILE", "read_run_fingerprint", "FORMAT"]

RUN_FILE = "run.json"  # the fingerprint of the run writing a checkpoint directory (runtime.preflight writes it)
FORMAT = 2  # stage-file layout version; 2 = plain data only, with the run fingerprint


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save, atomically (serialised in memory, then written with fileio's temp-file-and-rename)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def stage_file(root: str | Path, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage{stage}.pt"


def read_run_fingerprint(root: str | Path) -> dict[str, Any] | None:
    """The fingerprint in DIR/run.json, or None when there is none (or it is not a JSON object)."""
    try:
        data = json.loads((Path(root) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_stage(root: str | Path, step: int, stage: int, layers: tuple[int, int], model: torch.nn.Module,
               optimizer: StageOptimizer, before_write: Callable[[], None] | None = None) -> None:
    """Write one stage's file atomically (see save_stage_state)."""
    save_stage_state(root, step, stage, layers, model.state_dict(), optimizer.state_dict(), torch.get_rng_state(),
                     before_write)


def save_stage_state(root: str | Path, step: int, stage: int, layers: tuple[int, int], model_state: dict[str, Any],
                     optimizer_state: dict[str, Any], rng: torch.Tensor,
                     before_write: Callable[[], None] | None = None) -> None:
    """Write one stage's file atomically from state dicts. `before_write` (a fault-injection hook) runs when half of
    the file is on disk under its temporary name: a crash there leaves only a temp file that no reader ever takes for
    the stage."""
    # Plain data only (tensors, numbers, strings, lists, dicts) so that resuming never needs to unpickle code; the
    # RNG state is already a uint8 tensor. The run fingerprint travels in every file, so a directory reused by a
    # different run still tells which run wrote which step.
    buffer = io.BytesIO()
    torch.save({
        "format": FORMAT,
        "step": step,
        "stage": stage,
        "layers": list(layers),
        "model": model_state,
        "optimizer": optimizer_state,
        "rng": rng,
        "run": read_run_fingerprint(root),
    }, buffer)
    path = stage_file(root, step, stage)
    if before_write is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = buffer.getvalue()
        (path.parent / f".{path.name}.interrupted.tmp").write_bytes(data[:len(data) // 2])
        before_write()
    atomic_write_bytes(path, buffer.getvalue())
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that died mid-save
        stale.unlink(missing_ok=True)


def mark_latest(root: str | Path, step: int) -> None:
    atomic_write_text(Path(root) / "latest", step_dir(root, step).name + "\n")


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


def load_stage(root: str | Path, step: int, stage: int, layers: tuple[int, int], model: torch.nn.Module,
               optimizer: StageOptimizer) -> None:
    path = stage_file(root, step, stage)
    if not path.is_file():
        raise ConfigError(f"checkpoint file {path} is missing; the checkpoint was made with fewer stages or is "
                          "incomplete")
    state = read_stage(path)
    if tuple(state["layers"]) != tuple(layers):
        raise ConfigError(f"checkpoint {path} holds layers {tuple(state['layers'])} for stage {stage} but this run "
                          f"puts layers {tuple(layers)} there; resume with the same model and num_stages")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])


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


def read_stage(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A stage file's contents, checked to have the keys a stage checkpoint has."""
    state = safe_load(path, mmap=mmap)
    missing = [k for k in ("step", "stage", "layers", "model", "optimizer", "rng") if not isinstance(state, dict)
               or k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a recycle stage checkpoint (missing {', '.join(missing)})")
    return state


def part_file(path: str | Path, stage: int) -> Path:
    return Path(f"{path}.stage{stage}.part")


def merge_stage_parts(path: str | Path, num_stages: int, extra: dict[str, Any]) -> None:
    """Merge the per-stage parameter files written by the workers into one file at `path`: "stages" holds each
    stage's state dict and "model" their union (the whole model's state dict for the built-in GPT; None when two
    stages use the same parameter name, as a user model's stages may)."""
    try:
        stages = [safe_load(part_file(path, stage)) for stage in range(num_stages)]
        merged: dict[str, torch.Tensor] | None = {}
        for state in stages:
            if merged is not None and merged.keys() & state.keys():
                merged = None
            elif merged is not None:
                merged.update(state)
        atomic_torch_save({"model": merged, "stages": stages, **extra}, path)
    finally:  # success or not, no .part file outlives the merge
        for stage in range(num_stages):
            part_file(path, stage).unlink(missing_ok=True)
