"""Progress of long CLI work: a tqdm bar on stderr when it is a terminal, the plain progress lines otherwise."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Callable, Iterator, TextIO

__all__ = ["progress_lines", "interactive"]

_COUNTED = re.compile(r"^\[(\d+)/(\d+)\]\s*")  # "[3/35] key=..." lines: the bar takes its position and total from them
_POSTFIX = 40  # characters of the latest line shown next to the bar


def interactive(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def progress_lines(desc: str, total: int | None = None, stream: TextIO | None = None, bar: bool | None = None,
                   echo: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield `report(line)`, called once per unit of work done with a line that describes it.

    On a terminal (or with bar=True) a tqdm bar counts the units; a line "[i/n] ..." moves it to i of n, and what is
    printed to stdout meanwhile goes above the bar. Otherwise each line is written to `stream` (default stderr) as is
    (echo=False: nothing, for work whose own output already marks its steps). Nothing at all when the `recycle`
    logger is quieter than INFO (the CLI's -q)."""
    stream = sys.stderr if stream is None else stream
    quiet = not logging.getLogger("recycle").isEnabledFor(logging.INFO)
    if quiet or not (interactive(stream) if bar is None else bar):
        def plain(line: str) -> None:
            if echo and not quiet:
                print(line, file=stream, flush=True)

        yield plain
        return
    from tqdm import tqdm  # lazy: `--help` and piped runs never import it
    from tqdm.contrib import DummyTqdmFile

    with tqdm(total=total, desc=desc, file=stream, dynamic_ncols=True, leave=False) as progress:
        def update(line: str) -> None:
            match = _COUNTED.match(line)
            if match:
                progress.total = int(match.group(2))
                progress.update(int(match.group(1)) - progress.n)
                line = line[match.end():]
            else:
                progress.update(1)
            progress.set_postfix_str(line[:_POSTFIX])

        # Lines printed while the bar is up are written above it (tqdm clears and redraws the bar around them).
        with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
            yield update
