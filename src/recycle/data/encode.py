"""Corpora that are not token files yet (text through a local tokenizer, a Hugging Face dataset saved to disk),
encoded once into a cached uint32 token file that every worker then memory-maps."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from recycle.errors import ConfigError

__all__ = ["cache_dir", "encode_text_file", "encode_hf_dataset", "is_hf_dataset", "CACHE_DTYPE"]

CACHE_DTYPE = "uint32"  # any tokenizer's ids fit
_LINES = 4096  # lines (or rows) encoded per batch: what bounds the memory of an encoding
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


def cache_dir() -> Path:
    """Where encoded corpora are kept: $RECYCLE_DATA_CACHE, else $XDG_CACHE_HOME/recycle/tokens (~/.cache)."""
    if os.environ.get("RECYCLE_DATA_CACHE"):
        return Path(os.environ["RECYCLE_DATA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recycle" / "tokens"


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def _stamp(path: Path) -> list[Any]:
    """What identifies a file's or folder's contents cheaply: names, sizes and modification times."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _cached(key: dict[str, Any], write: Any) -> Path:
    """The cache file for `key`, written by `write(file)` the first time (atomically: workers may race)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    folder = cache_dir()
    target = folder / f"{digest}.{CACHE_DTYPE}.bin"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{digest}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(f"cannot write the token cache in {str(folder)!r} ({exc.strerror}); set RECYCLE_DATA_CACHE "
                          "to a writable folder") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("[training] tokenizer needs the tokenizers package (pip install tokenizers; it ships with "
                          "transformers, the 'hf' extra)") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass for a malformed file
        raise ConfigError(f"[training] tokenizer = {str(path)!r} is not a tokenizers tokenizer.json ({exc})") from None


def _write_ids(f: Any, batches: Iterable[list[list[int]]]) -> None:
    for batch in batches:
        for ids in batch:
            np.asarray(ids, dtype=CACHE_DTYPE).tofile(f)


def _lines(path: Path, where: str) -> Iterator[list[str]]:
    """The text's lines, newlines kept, in batches; a file that is not UTF-8 is refused with the line."""
    batch: list[str] = []
    with open(path, encoding="utf-8", newline="") as text:
        try:
            for line in text:
                batch.append(line)
                if len(batch) == _LINES:
                    yield batch
                    batch = []
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text ({exc.reason}); convert it to UTF-8") \
                from None
    if batch:
        yield batch


def encode_text_file(path: Path, tokenizer: Path, where: str) -> Path:
    """The text encoded line by line (no special tokens added) with the tokenizer: a cached token file."""
    tok = _tokenizer(tokenizer)

    def write(f: Any) -> None:
        _write_ids(f, ([e.ids for e in tok.encode_batch(lines, add_special_tokens=False)]
                       for lines in _lines(path, where)))

    return _cached({"kind": "text", "data": _stamp(path), "tokenizer": _stamp(tokenizer)}, write)


def _hf_split(path: Path, where: str) -> Any:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(f"{where} is a Hugging Face dataset folder, which needs the datasets package (pip install "
                          "datasets)") from None
    datasets.disable_progress_bars()  # recycle's own lines only, on stdout and stderr
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, pyarrow errors for a bad folder
        raise ConfigError(f"{where} is not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ConfigError(f"{where} has splits {sorted(data)} but no 'train'; save the split to "
                              "train on by itself, or under the name 'train'")
        data = data["train"]
    return data


def encode_hf_dataset(path: Path, column: str, tokenizer: Path | None, where: str) -> tuple[Path, str]:
    """(cached token file, the column used): the column's rows concatenated, a token-id column (lists of ints) as
    is, a text column encoded row by row with the tokenizer."""
    column = column or ("text" if tokenizer else "input_ids")
    data = _hf_split(path, where)
    if column not in data.column_names:
        raise ConfigError(f"{where} has no column {column!r} (it has {data.column_names}); name the "
                          "column with [training] dataset_column")
    feature = str(data.features[column])
    is_text = "string" in feature and "List" not in feature and "Sequence" not in feature
    if tokenizer is None and is_text:
        raise ConfigError(f"{where}: its column {column!r} holds text; give [training] tokenizer (a "
                          "tokenizer.json) to encode it, or name a token-id column")
    if tokenizer is not None and not is_text:
        raise ConfigError(f"{where}: its column {column!r} is {feature}, not text; drop [training] "
                          "tokenizer to read it as token ids")
    tok = _tokenizer(tokenizer) if tokenizer is not None else None
    rows = data.select_columns([column])

    def batches() -> Iterator[list[list[int]]]:
        for start in range(0, len(rows), _LINES):
            values = rows[start:start + _LINES][column]
            if tok is not None:
                yield [e.ids for e in tok.encode_batch(values, add_special_tokens=False)]
                continue
            for row, ids in enumerate(values, start):
                if ids is None or (len(ids) and min(ids) < 0):
                    raise ConfigError(f"{where}: row {row} of its column {column!r} is {ids!r:.60}, "
                                      "not a list of token ids >= 0")
            yield values

    key = {"kind": "hf", "data": _stamp(path), "column": column,
           "tokenizer": _stamp(tokenizer) if tokenizer is not None else None}
    return _cached(key, lambda f: _write_ids(f, batches())), column
