"""A worker's identity, (replica, stage), and its one text form "R:S" (e.g. "1:2")."""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

__all__ = ["Worker", "workers_text"]

_TEXT = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class Worker(NamedTuple):
    """(replica, stage): a tuple, so it stands wherever plans and failure sets hold (replica, stage) pairs."""

    replica: int
    stage: int

    def __str__(self) -> str:
        return f"{self.replica}:{self.stage}"

    @classmethod
    def parse(cls, text: str) -> Worker:
        """'R:S' -> Worker(R, S); ValueError naming the text and the form if it is not one."""
        match = _TEXT.match(text)
        if not match:
            raise ValueError(f"worker {text!r} is malformed; write REPLICA:STAGE, e.g. 1:2")
        return cls(int(match.group(1)), int(match.group(2)))


def workers_text(workers: Iterable[tuple[int, int]], sep: str = " ", most: int | None = None) -> str:
    """Workers in their text form, sorted, joined by `sep` ("" for none); with `most`, at most that many named and
    the rest counted (a line about a thousand-node run stays one line)."""
    ordered = sorted(workers)
    named = ordered if most is None or len(ordered) <= most else ordered[:most]
    text = sep.join(str(Worker(*w)) for w in named)
    return text if len(named) == len(ordered) else f"{text}{sep}... ({len(ordered)} in all)"
