"""Reading input files a user (or another process) wrote: regular files only, bounded in size, UTF-8; JSON bounded in
depth and number range. Every failure is one error naming the file, what is wrong and the fix (issue 21, item 6)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from recycle.errors import ConfigError, RecycleError

__all__ = ["read_input_text", "strict_json_loads", "UnsafeJSON", "describe_kind", "MIB", "json_list", "json_object"]

MIB = 1024 * 1024


class UnsafeJSON(ValueError):
    """Valid JSON syntax that cannot be read safely: nested too deeply, an integer too long, a number out of range."""


def describe_kind(mode: int) -> str:
    """'a directory', 'a FIFO', ... for a stat mode that is not a regular file."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_input_text(path: str | Path, what: str, limit_bytes: int, fix: str,
                    error: type[RecycleError] = ConfigError) -> str:
    """The text of the regular file `path` (`what` names it in messages, e.g. "--plan 'x.json'"): at most
    `limit_bytes`, UTF-8 (a byte-order mark is dropped). A missing file, a directory, a device or FIFO, a file
    that cannot be read (/proc/self/mem) or is too large, or bytes that are not UTF-8 raise `error` ending in `fix`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} does not exist; {fix}") from None
    except OSError as exc:
        raise error(f"{what} cannot be read ({exc.strerror}); {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} is {describe_kind(info.st_mode)}, not a regular file; {fix}")
    if info.st_size > limit_bytes:
        raise error(f"{what} is {_size(info.st_size)}, above the limit of {_size(limit_bytes)} for this kind of "
                    f"file; {fix}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit_bytes + 1)  # files that report size 0 (/proc) are bounded here
    except OSError as exc:
        raise error(f"{what} cannot be read ({exc.strerror or exc}); {fix}") from None
    if len(data) > limit_bytes:
        raise error(f"{what} holds more than {_size(limit_bytes)}, the limit for this kind of file; {fix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); {fix}") from None


def _size(n: int) -> str:
    return f"{n / MIB:,.1f} MiB" if n >= MIB else f"{n:,} bytes"


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnsafeJSON(f"the number {text[:40]} is out of range for a float (|x| < 1.8e308)")
    return value


def _no_constant(name: str) -> Any:
    raise UnsafeJSON(f"it holds {name}, which is not a number JSON allows")


def strict_json_loads(text: str | bytes) -> Any:
    """json.loads that raises json.JSONDecodeError for bad syntax and UnsafeJSON (both ValueErrors) for arrays or
    objects nested past Python's recursion limit (a RecursionError otherwise), an integer of more than 4,300
    digits, a number out of float range (1e400 would be inf) and NaN or Infinity."""
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise UnsafeJSON("its arrays or objects are nested too deeply to read") from None
    except json.JSONDecodeError:
        raise
    except UnsafeJSON:
        raise
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        if "digits" in str(exc):
            raise UnsafeJSON("it holds an integer of more than 4,300 digits (every count or size fits in 64 bits)") \
                from None
        raise UnsafeJSON(str(exc)) from None


def json_list(value: Any) -> list[Any]:
    """`value` if it is a JSON array, else ValueError naming what it is (for readers that wrap it in their error)."""
    if not isinstance(value, list):
        raise ValueError(f"{str(value)[:40]!r} is not a list")
    return value


def json_object(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else ValueError naming what it is."""
    if not isinstance(value, dict):
        raise ValueError(f"{str(value)[:40]!r} is not an object")
    return value
