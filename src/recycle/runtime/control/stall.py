"""A process's own stalls: a thread that ticks on the monotonic clock and remembers each gap between its ticks, so a
launcher woken from SIGSTOP (or from a VM pause) can tell that it was gone longer than the coordinator waits for a
silent node, which a store call that blocked for as long cannot tell (it blocks only the caller's thread)."""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["StallClock"]


class StallClock:
    """Ticks every `tick_s` in a daemon thread; `longest_since(mark)` is the longest time the process did not run
    (a gap between ticks less one tick) among the gaps that ended after `mark` (monotonic seconds)."""

    def __init__(self, tick_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 keep: int = 64) -> None:
        self.tick_s, self._clock, self._keep = tick_s, clock, keep
        self._noise_s = 4 * tick_s  # a gap up to this long is scheduling noise on a loaded machine, not a stall
        self._lock = threading.Lock()
        self._last = clock()
        self._gaps: list[tuple[float, float]] = []  # (ended at, seconds stalled), newest last, bounded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallClock:
        self._thread = threading.Thread(target=self._run, name="recycle-stall-clock", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    def tick(self) -> None:
        """One tick: a gap much longer than a tick means the process (every thread of it) was not running."""
        now = self._clock()
        with self._lock:
            stalled = now - self._last - self.tick_s
            self._last = now
            if stalled > self._noise_s:
                self._gaps.append((now, stalled))
                del self._gaps[:-self._keep]

    def longest_since(self, mark: float) -> float:
        with self._lock:
            # A stall still going on (the clock thread has not ticked since the process woke) counts too.
            ongoing = max(0.0, self._clock() - self._last - self.tick_s)
            return max([ongoing if ongoing > self._noise_s else 0.0]
                       + [stalled for ended, stalled in self._gaps if ended > mark])
