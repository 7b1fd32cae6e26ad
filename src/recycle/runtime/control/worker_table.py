"""Which process is which worker: the table a launcher prints once its workers have started (node, worker R:S,
rank, pid), and the line for each replacement it starts, so an operator can name a process before it dies."""

from __future__ import annotations

from dataclasses import dataclass

from recycle.ir.worker import Worker

__all__ = ["WorkerRow", "worker_table", "replacement_line"]

_HEADER = ("node", "worker", "rank", "pid")


@dataclass(frozen=True)
class WorkerRow:
    node: int
    worker: Worker
    rank: int
    pid: int | None  # None: the process has not started (it is not in the table then)


def _cells(row: WorkerRow) -> tuple[str, str, str, str]:
    return str(row.node), str(row.worker), str(row.rank), "-" if row.pid is None else str(row.pid)


def worker_table(rows: list[WorkerRow]) -> list[str]:
    """The table's lines, right-aligned columns under a header:
         node  worker  rank    pid
            0     0:0     0  41233
    """
    cells = [_HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_HEADER))]
    return ["  " + "  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]


def replacement_line(row: WorkerRow, reason: str = "") -> str:
    """A replacement's line: 'node 0: worker 1:1 (rank 3) replaced: pid 41290 (after: worker 1:1 ... died)'."""
    pid = "-" if row.pid is None else row.pid
    return (f"node {row.node}: worker {row.worker} (rank {row.rank}) replaced: pid {pid}"
            + (f" ({reason})" if reason else ""))
