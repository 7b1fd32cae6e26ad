"""`make test`: the whole suite as two pytest runs side by side: the tests marked `timing` (their outcome depends on
real time: heartbeat timeouts, paced runs a re-joining worker must catch) one after the other in one, every other test
in the other, on two xdist workers at a lower CPU priority (nice), so that a timing test gets a core when it needs
one; exits non-zero if either fails, or if the two have not ended by a deadline: then it prints the tests still
running, every thread's stack in the pytest processes and the processes left, and kills them. Extra arguments go to
both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOTHING_SELECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
OTHERS_NICENESS = 10  # CFS weight 110 against 1024: the timing run gets ~90 % of a contended core
# A whole run takes 11-13 min on this kind of machine; CI stops a run at 90 min and then shows nothing of it.
DEADLINE_ENV = "RECYCLE_SUITE_DEADLINE_S"
DEFAULT_DEADLINE_S = 40 * 60
PROGRESS_DIR_ENV = "RECYCLE_SUITE_PROGRESS_DIR"  # read by tests/conftest.py
STACK_DUMP_WAIT_S = 3.0


def main(argv: list[str]) -> int:
    deadline_s = _deadline_s()
    base = [sys.executable, "-m", "pytest", "-q", "--durations=10", *argv]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as others_log, tempfile.TemporaryDirectory(prefix="recycle-suite-") as progress:
        env = {**os.environ, PROGRESS_DIR_ENV: progress}
        # Each run in its own session: at the deadline every process it started can be found and killed.
        # The others' report waits in a file and follows the timing run's, which streams: one report at a time.
        others = subprocess.Popen([*base, "-m", "not timing", "-n", "2", "--dist", "worksteal"], stdout=others_log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  preexec_fn=lambda: os.nice(OTHERS_NICENESS))
        print("== tests marked timing (the other tests run beside them; their report follows)", flush=True)
        timing = subprocess.Popen([*base, "-m", "timing"], env=env, start_new_session=True)
        runs = {"timing tests": timing, "other tests": others}
        try:
            while any(run.poll() is None for run in runs.values()) and time.monotonic() - started < deadline_s:
                time.sleep(1.0)
            hung = [name for name, run in runs.items() if run.poll() is None]
            if hung:
                _report_hang(hung, deadline_s, Path(progress), [run.pid for run in runs.values()])
        finally:
            for run in runs.values():
                _kill_session(run.pid)
                run.wait()
        others_log.seek(0)
        print("\n== the other tests")
        print(others_log.read(), end="", flush=True)
    elapsed = time.monotonic() - started
    timing_code, others_code = timing.returncode, others.returncode
    print(f"\n== whole suite in {int(elapsed // 60)}:{int(elapsed % 60):02d}: timing tests "
          f"{_outcome(timing_code)}, other tests {_outcome(others_code)}")
    if hung:
        print(f"== FAILED: {' and '.join(hung)} still running at the deadline, {deadline_s} s ({DEADLINE_ENV}); "
              "where they were is printed above")
        return 1
    codes = {timing_code, others_code}
    # Exit 5 is pytest's "no test selected": fine for one half (arguments naming only one kind), not for both.
    return 0 if codes <= {0, NOTHING_SELECTED} and codes != {NOTHING_SELECTED} else 1


def _deadline_s() -> int:
    raw = os.environ.get(DEADLINE_ENV, str(DEFAULT_DEADLINE_S))
    if not raw.isdigit() or int(raw) <= 0:
        sys.exit(f"error: {DEADLINE_ENV}={raw!r} is not a whole number of seconds > 0; unset it for "
                 f"{DEFAULT_DEADLINE_S} s")
    return int(raw)


def _report_hang(hung: list[str], deadline_s: int, progress: Path, sessions: list[int]) -> None:
    """Prints the tests started and not ended, every thread's stack in each pytest process that runs tests, and
    every process left in the runs' sessions (state T: stopped, D: in the kernel)."""
    print(f"\n== {' and '.join(hung)} still running after {deadline_s} s", flush=True)
    for path in sorted(progress.glob("*.progress")):
        pid = int(path.stem.rsplit("-", 1)[1])
        try:
            os.kill(pid, signal.SIGUSR1)  # tests/conftest.py registered a stack dump on it
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_S)
    left = _processes(sessions)
    for path in sorted(progress.glob("*.progress")):
        running: dict[str, None] = {}
        for line in path.read_text().splitlines():
            event, _, test = line.partition(" ")
            if event == "start":
                running[test] = None
            else:
                running.pop(test, None)
        print(f"-- pytest process {path.stem}: tests started and not ended: {list(running) or 'none'}")
        stacks = path.with_suffix(".stacks").read_text()
        if stacks and path.stem.rsplit("-", 1)[1] in left:
            print(stacks, end="")
    print("-- processes left:")
    for pid, (state, command) in sorted(left.items()):
        print(f"   {pid} {state} {command[:200]}")
    sys.stdout.flush()


def _processes(sessions: list[int]) -> dict[str, tuple[str, str]]:
    """pid -> (state, command line) of every process in the given sessions."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
            if int(fields[3]) in sessions:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found[entry.name] = (fields[0], command)
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return found


def _kill_session(session: int) -> None:
    """SIGKILLs every process left in `session` (a stopped one included), the run's own process first."""
    for pid in [str(session), *_processes([session])]:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _outcome(code: int) -> str:
    return {0: "passed", NOTHING_SELECTED: "none selected"}.get(code, f"FAILED (exit {code})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
