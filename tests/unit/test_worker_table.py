"""Which process is which worker: the launcher's start-up table and replacement lines, and the process title."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recycle.ir.worker import Worker
from recycle.runtime.control.worker_table import WorkerRow, replacement_line, worker_table
from recycle.runtime.worker.title import set_process_title

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_the_table_maps_each_pid_to_its_worker_in_aligned_columns() -> None:
    rows = [WorkerRow(0, Worker(0, 0), 0, 41233), WorkerRow(0, Worker(0, 1), 1, 41234),
            WorkerRow(1, Worker(10, 1), 21, 7), WorkerRow(1, Worker(10, 0), 20, None)]
    assert worker_table(rows) == [
        "  node  worker  rank    pid",
        "     0     0:0     0  41233",
        "     0     0:1     1  41234",
        "     1    10:1    21      7",
        "     1    10:0    20      -",
    ]


def test_a_replacement_gets_its_own_line_with_the_reason() -> None:
    row = WorkerRow(0, Worker(1, 1), 3, 41290)
    assert replacement_line(row, "its machine is repaired") == \
        "node 0: worker 1:1 (rank 3) replaced: pid 41290 (its machine is repaired)"
    assert replacement_line(row) == "node 0: worker 1:1 (rank 3) replaced: pid 41290"


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="no /proc/self/comm (not Linux)")
def test_the_process_title_names_the_process_and_its_later_threads() -> None:
    code = ("import sys, threading\n"
            f"sys.path.insert(0, {SRC!r})\n"
            "from recycle.runtime.worker.title import set_process_title\n"
            "assert set_process_title('recycle 12:34-and-more')\n"
            "names = []\n"
            "t = threading.Thread(target=lambda: names.append(open(f'/proc/self/task/{threading.get_native_id()}/comm')"
            ".read()))\n"
            "t.start(); t.join()\n"
            "print(open('/proc/self/comm').read().strip(), '|', names[0].strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    title, thread = (part.strip() for part in out.stdout.split("|"))
    assert title == "recycle 12:34-a"  # cut to the kernel's 15 bytes
    if sys.version_info < (3, 14):  # 3.14 names new OS threads after their Python name instead
        assert thread == title  # gloo's threads, started later, carry the worker's name too


def test_without_proc_the_title_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("/proc/self/comm")

    monkeypatch.setattr("builtins.open", no_proc)
    assert set_process_title("recycle 0:0") is False
