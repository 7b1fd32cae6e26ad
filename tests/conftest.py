"""Shared pieces of every test tier: the tiny GPT job (D x S x M, float64 by default) as a parsed Config."""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO, Any, Callable, Iterator

import pytest

# One intra-op thread in the suite and in every process it starts (they inherit OMP_NUM_THREADS), as a worker runs
# (runtime.worker): ops on tiny tensors gain nothing from a second thread, and on a busy 2-core machine its spinning
# cost 8-14x the CPU of one thread (the single-process reference of a 28-step tiny run: 7.7-13.7 s of CPU against
# 0.75-0.95 s, 9-37 s wall against 2-4.5 s, at a load of 5). A value the caller sets wins.
_THREADS = os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch reads it once, at import)

if _THREADS.isdigit() and int(_THREADS) > 0:  # (in case something imported torch before this file)
    torch.set_num_threads(int(_THREADS))

from recycle.config import Config, parse_config

# tests/run_suite.py names a folder here: each pytest process that runs tests writes which test it starts and ends
# there, and dumps every thread's stack there on SIGUSR1, so a run that hangs can say where.
PROGRESS_DIR_ENV = "RECYCLE_SUITE_PROGRESS_DIR"


class _Progress:
    """Writes `start <test>` / `end <test>` lines as this process runs tests, flushed at once."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.out.write(f"start {nodeid}\n")
        self.out.flush()

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.out.write(f"end {nodeid}\n")
        self.out.flush()


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get(PROGRESS_DIR_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not folder or (worker is None and getattr(config.option, "numprocesses", None)):
        return  # not asked, or an xdist controller (its workers run the tests and write their own)
    stem = os.path.join(folder, f"{worker or 'pytest'}-{os.getpid()}")
    progress = open(f"{stem}.progress", "w", buffering=1)
    stacks = open(f"{stem}.stacks", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    config.pluginmanager.register(_Progress(progress), "recycle-suite-progress")


def make_tiny_config(D: int = 2, S: int = 2, M: int = 2, dtype: str = "float64", steps: int = 2, seed: int = 7,
                     name: str = "tiny", **training: Any) -> Config:
    """The "tiny" GPT preset, micro-batches of 2 x 8 tokens, unit costs; `training` adds [training] keys."""
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": M, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": steps, "lr": 0.01, "weight_decay": 0.1, "dtype": dtype, "seed": seed, **training},
    }, name=name)


@pytest.fixture()
def tiny_config() -> Callable[..., Config]:
    """make_tiny_config, for tests to call with their own D, S, M, dtype, steps and [training] keys."""
    return make_tiny_config


@pytest.fixture()
def cli_error(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str]], str]:
    """Run the CLI's main() in-process on arguments that must be refused, and check the user-facing contract: exit
    code 2, nothing on stdout, one `error:` line on stderr and no traceback. Returns that line. (`python -m recycle`
    exits with main()'s return value; tests that check the real process keep a subprocess.)"""

    def run(argv: list[str]) -> str:
        from recycle.cli import main

        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, (code, err)
        assert out == "" and "Traceback" not in err, (out, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        return lines[0]

    return run


@pytest.fixture(autouse=True)
def _workers_fork_from_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """`recycle train` run as a subprocess starts its workers from a forkserver (torch imported once per launcher,
    not once per worker): a fresh-clone run took 21:22 this way against 23:54 with spawn. The CLI's default, spawn,
    keeps tests of its own: they pass --start-method spawn."""
    if "RECYCLE_START_METHOD" not in os.environ:
        monkeypatch.setenv("RECYCLE_START_METHOD", "forkserver")


@pytest.fixture(autouse=True)
def _plan_cache_outside_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`recycle simulate` keeps plans in the user's cache folder by default: tests keep theirs in a temporary one."""
    monkeypatch.setenv("RECYCLE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "plan-cache"))


@pytest.fixture()
def one_torch_thread() -> Iterator[None]:
    """Every worker runs with one intra-op thread, as a worker process does (runtime.worker). Several worker threads
    sharing the default pool oversubscribe a small machine: the same test then took 1 s or 20 s by the load. Files
    that run workers on threads use it for every test (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

