"""Python's cyclic garbage collector paused around work that makes many young, acyclic objects."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside the block and restored after (also on an error); a caller's disabled collector
    stays disabled. For work whose objects are kept or freed by reference counts (plans, schedules, views): the
    collections their allocations set off would only walk them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
