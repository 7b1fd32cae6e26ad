"""Pretrained weights for a Hugging Face model: which safetensors file holds each tensor (a single file, or a folder
in `save_pretrained`'s layout), checked against the model's tensors by name and shape, and read lazily, tensor by
tensor, so a worker reads only its own stage's tensors (`safe_open`), never the whole model."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from recycle.errors import ConfigError

__all__ = ["WEIGHTS_FILE", "INDEX_FILE", "Pretrained", "open_pretrained", "check_pretrained", "load_pretrained"]

WEIGHTS_FILE = "model.safetensors"  # save_pretrained's names: one file, or shards listed by the index
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Pretrained:
    """The tensors of a pretrained model: name -> the safetensors file holding it, and its shape (from the files'
    headers; no tensor is read)."""

    source: str  # the path as the user named it (for messages)
    files: Mapping[str, Path]
    shapes: Mapping[str, tuple[int, ...]]

    def where(self) -> str:
        return f"the pretrained weights {self.source!r}"


def _safe_open(path: Path, source: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) on an unreadable file
        raise ConfigError(f"the pretrained weights {source!r}: {str(path)!r} is not a readable safetensors file "
                          f"({exc}); give a file written by safetensors / save_pretrained") from None


def _weight_files(path: Path, source: str) -> list[Path]:
    """The safetensors files of `path`: itself, or a folder's model.safetensors or the shards its index names."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"the pretrained weights {source!r} are neither a file nor a folder; give a .safetensors "
                          f"file or a folder saved by save_pretrained ({WEIGHTS_FILE}, or {INDEX_FILE} and shards)")
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / INDEX_FILE
    if not index.is_file():
        found = sorted(p.name for p in path.iterdir())[:8]
        raise ConfigError(f"the pretrained weights {source!r} hold neither {WEIGHTS_FILE} nor {INDEX_FILE} (found: "
                          f"{found}); save the model with save_pretrained (safetensors; .bin weights are not read), "
                          "or, for a random init, give the config JSON itself")
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise ValueError(f"larger than {MAX_INDEX_BYTES:,} bytes")
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"the pretrained weights {source!r}: {INDEX_FILE} is not a safetensors index with a "
                          f"weight_map ({exc}); write it with save_pretrained") from None
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ConfigError(f"the pretrained weights {source!r}: {INDEX_FILE} names the shard {shard!r}, which is "
                              "not a file name in that folder; shards live beside the index")
    return [path / shard for shard in shards]


def open_pretrained(path: str | Path, source: str | None = None) -> Pretrained:
    """The tensors of a safetensors file or a save_pretrained folder (headers only)."""
    source = str(path) if source is None else source
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(Path(path), source):
        with _safe_open(file, source) as handle:
            for name in handle.keys():
                if name in files:
                    raise ConfigError(f"the pretrained weights {source!r} hold the tensor {name!r} twice "
                                      f"({files[name]} and {file}); keep one copy")
                files[name] = file
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return Pretrained(source, files, shapes)


def _file_name(weights: Pretrained, name: str, prefix: str) -> str | None:
    """The file's name of the model's tensor `name`: the same, or without the base model's prefix (as the original
    GPT-2 checkpoints store "h.0.attn..." for "transformer.h.0.attn...")."""
    if name in weights.files:
        return name
    if prefix and name.startswith(prefix + "."):
        bare = name[len(prefix) + 1:]
        if bare in weights.files:
            return bare
    return None


def _expected(weights: Pretrained, name: str, shape: tuple[int, ...], prefix: str) -> str:
    """The file's name of the model's tensor `name` of shape `shape`, or a ConfigError naming what is wrong."""
    found = _file_name(weights, name, prefix)
    if found is None:
        raise ConfigError(f"{weights.where()} have no tensor {name!r}, which the model of the run's Hugging Face "
                          "config has; give the weights saved from a model of that config (or the config of these "
                          "weights)")
    if weights.shapes[found] != shape:
        raise ConfigError(f"{weights.where()}: tensor {found!r} has shape {list(weights.shapes[found])} but the model "
                          f"of the run's Hugging Face config needs {list(shape)}; the weights are of another config")
    return found


def check_pretrained(weights: Pretrained, tensors: Iterable[tuple[str, tuple[int, ...]]], prefix: str,
                     ignore_unexpected: Iterable[str] = ()) -> None:
    """Every tensor (name, shape) of the whole model is in the files with that shape, and the files hold nothing
    else (a tensor left over means the weights are of another model), except names matching `ignore_unexpected`
    (the model class's own `_keys_to_ignore_on_load_unexpected`, e.g. GPT-2's constant attention masks)."""
    used = {_expected(weights, name, shape, prefix) for name, shape in tensors}
    patterns = [re.compile(p) for p in ignore_unexpected]
    left = sorted(n for n in weights.files if n not in used and not any(p.search(n) for p in patterns))
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise ConfigError(f"{weights.where()} hold tensors the model of the run's Hugging Face config does not have: "
                          f"{left[:3]}{more}; give the config these weights were saved with")


@torch.no_grad()
def load_pretrained(weights: Pretrained, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Copy each tensor of `tensors` (name in the whole model -> an allocated tensor) from the files, in the tensor's
    own dtype; each file is opened once and only the named tensors are read."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, tensor in tensors.items():
        found = _expected(weights, name, tuple(tensor.shape), prefix)
        by_file.setdefault(weights.files[found], []).append((name, found))
    for file, names in by_file.items():
        with _safe_open(file, weights.source) as handle:
            for name, found in names:
                tensors[name].copy_(handle.get_tensor(found))
