"""Atomic per-stage checkpoints (model, optimizer, step, RNG), the `latest` pointer, and merged final weights.

Layout: DIR/step000004/stage0.pt ... stage{S-1}.pt, and DIR/latest containing "step000004". A step directory is
only named by `latest` after every stage file of that step is complete, so a crash mid-save never corrupts resume.
Replicas of a stage hold identical state, so one live replica per stage writes it; the files are per stage, not
per worker, which lets a run resume under any failure state.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import torch

from recycle.errors import ConfigError
from recycle.fileio import atomic_write_bytes, atomic_write_text
from recycle.runtime.optim import StageOptimizer

__all__ = ["atomic_torch_save", "atomic_write_text", "step_dir", "stage_file", "save_stage", "save_stage_state",
           "load_stage",
           "mark_latest", "latest_step", "merge_stage_parts", "part_file"]


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save, atomically (serialised in memory, then written with fileio's temp-file-and-rename)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def stage_file(root: str | Path, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage{stage}.pt"


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
    buffer = io.BytesIO()
    torch.save({
        "step": step,
        "stage": stage,
        "layers": layers,
        "model": model_state,
        "optimizer": optimizer_state,
        "rng": rng,
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
    state = torch.load(path, map_location="cpu", weights_only=False)
    if tuple(state["layers"]) != tuple(layers):
        raise ConfigError(f"checkpoint {path} holds layers {tuple(state['layers'])} for stage {stage} but this run "
                          f"puts layers {tuple(layers)} there; resume with the same model and num_stages")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])


def part_file(path: str | Path, stage: int) -> Path:
    return Path(f"{path}.stage{stage}.part")


def merge_stage_parts(path: str | Path, num_stages: int, extra: dict[str, Any]) -> None:
    """Merge the per-stage parameter files written by the workers into one file at `path`: "stages" holds each
    stage's state dict and "model" their union (the whole model's state dict for the built-in GPT; None when two
    stages use the same parameter name, as a user model's stages may)."""
    stages = [torch.load(part_file(path, stage), map_location="cpu", weights_only=True) for stage in range(num_stages)]
    merged: dict[str, torch.Tensor] | None = {}
    for state in stages:
        if merged is not None and merged.keys() & state.keys():
            merged = None
        elif merged is not None:
            merged.update(state)
    atomic_torch_save({"model": merged, "stages": stages, **extra}, path)
    for stage in range(num_stages):
        part_file(path, stage).unlink(missing_ok=True)
