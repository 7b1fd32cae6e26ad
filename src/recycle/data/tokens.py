"""A corpus as a flat stream of token ids, memory-mapped from disk (a token file, or a UTF-8 text's bytes), and the
whole-file checks run once per job, in fixed-size chunks so that they do not grow the process either."""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from recycle.errors import ConfigError

__all__ = ["TOKEN_DTYPES", "TokenStream", "open_token_file", "open_text_bytes", "stream_of_bytes", "check_vocab",
           "check_utf8", "check_length"]

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = 1 << 20  # elements per chunk of a whole-file scan (1-4 MB)


@dataclass(frozen=True)
class TokenStream:
    """Token ids as a 1-D unsigned array (a read-only memmap of `path`, or in memory when `path` is empty), and a
    description of where they came from for messages."""

    tokens: np.ndarray
    source: str
    path: str = ""
    unit: str = "tokens"  # what one element is, for messages ("bytes" for byte-level text)
    file: IO[bytes] | None = None  # `path` open for pread (closed with the stream)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, offset: int, count: int) -> np.ndarray:
        """Ids [offset, offset + count). A file is read with pread rather than through the map: a page touched
        through a map counts in the process's RSS (with the kernel's read-around, ~100 KB per window), so a long
        run's RSS would grow towards the file's size; read, the pages stay in the shared page cache only."""
        if self.file is None:
            return self.tokens[offset:offset + count]
        size = self.tokens.dtype.itemsize
        return np.frombuffer(os.pread(self.file.fileno(), count * size, offset * size), dtype=self.tokens.dtype)

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, ids) over the whole stream, read from the file rather than through the map: touching every page
        of the map would count the whole file in this process's RSS."""
        if not self.path:
            for start in range(0, len(self), _CHUNK):
                yield start, self.tokens[start:start + _CHUNK]
            return
        with open(self.path, "rb") as f:
            start = 0
            while True:
                ids = np.fromfile(f, dtype=self.tokens.dtype, count=_CHUNK)
                if ids.size == 0:
                    return
                yield start, ids
                start += ids.size


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file; the length check names the problem
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def open_token_file(path: Path, token_dtype: str, where: str) -> TokenStream:
    """A nanoGPT-style token file: ids of `token_dtype` back to back, native (little-endian) byte order."""
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"{where} has {size} bytes, not a multiple of {dtype.itemsize} ([training] "
                          f"token_dtype = {token_dtype!r}); the file is truncated or its token_dtype is another")
    return TokenStream(_map(path, dtype), str(path), str(path), file=open(path, "rb", buffering=0))


def open_text_bytes(path: Path) -> TokenStream:
    """A UTF-8 text file's bytes as tokens (the byte-level vocabulary of 256)."""
    return TokenStream(_map(path, np.dtype(np.uint8)), str(path), str(path), unit="bytes",
                       file=open(path, "rb", buffering=0))


def stream_of_bytes(data: bytes, source: str) -> TokenStream:
    """Bytes held in memory (the built-in corpus) as a byte-level stream."""
    return TokenStream(np.frombuffer(data, dtype=np.uint8), source, unit="bytes")


def check_vocab(stream: TokenStream, vocab_size: int, where: str) -> None:
    """Every id is below the model's vocabulary; the first one that is not is named with its position."""
    for start, ids in stream.chunks():
        if ids.size and int(ids.max()) >= vocab_size:
            bad = np.flatnonzero(ids >= vocab_size)
            position = start + int(bad[0])
            raise ConfigError(f"{where} has token id {int(ids[bad[0]])} at position {position:,}, "
                              f"not below the model's vocabulary of {vocab_size:,}; use the tokenizer the model was "
                              "made for, or a model with a larger vocab_size")


def check_utf8(stream: TokenStream, where: str) -> None:
    """The bytes decode as UTF-8 (decoded chunk by chunk; a character may straddle two chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    for start, ids in stream.chunks():
        try:
            decoder.decode(ids.tobytes())
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text (byte {start + exc.start:,}: {exc.reason})"
                              "; convert it to UTF-8, or give [training] token_dtype if it is a token file") from None
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (it ends inside a character: {exc.reason}); "
                          "convert it to UTF-8") from None


def check_length(stream: TokenStream, needed: int, why: str) -> None:
    """At least `needed` elements (`why` says what needs them)."""
    if len(stream) < needed:
        raise ConfigError(f"dataset {stream.source!r} has {len(stream)} {stream.unit} but {why} needs at least "
                          f"{needed}; use a longer corpus or a shorter seq_len")
