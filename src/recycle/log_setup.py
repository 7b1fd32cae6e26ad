"""The CLI's logging: info lines on stdout as the commands always printed them, warnings and errors on stderr."""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]


class _StdStream(logging.Handler):
    """Writes to sys.stdout or sys.stderr as they are at each message (tests and redirections swap them)."""

    def __init__(self, name: str, level: int = logging.NOTSET, below: int | None = None) -> None:
        super().__init__(level)
        self.stream_name = name
        self.below = below

    def filter(self, record: logging.LogRecord) -> bool:
        return (self.below is None or record.levelno < self.below) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except BrokenPipeError:
            raise
        except Exception:
            self.handleError(record)


class _LevelPrefix(logging.Formatter):
    """"warning: ..." and "error: ..." as the CLI has always printed them; with -v each line names its module."""

    def __init__(self, names: bool) -> None:
        super().__init__()
        self.names = names

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return f"{record.name}: {text}" if self.names else text


def configure_logging(verbose: int = 0, quiet: int = 0, level: str | None = None) -> int:
    """The CLI's logging: info and debug lines on stdout (the progress lines the commands always printed there),
    warnings and errors on stderr. Returns the level set on the `recycle` logger."""
    if level is not None:
        chosen = getattr(logging, level.upper())
    elif verbose:
        chosen = logging.DEBUG
    else:
        chosen = (logging.INFO, logging.WARNING, logging.ERROR)[min(quiet, 2)]
    logger = logging.getLogger("recycle")
    for handler in [h for h in logger.handlers if isinstance(h, _StdStream)]:
        logger.removeHandler(handler)  # main() may run many times in one process (tests)
    formatter = _LevelPrefix(names=chosen <= logging.DEBUG)
    for handler in (_StdStream("stdout", below=logging.WARNING), _StdStream("stderr", level=logging.WARNING)):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(chosen)
    logger.propagate = False  # the lines are ours to print once, not also the root logger's
    return chosen
