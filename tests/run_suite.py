"""`make test`: the whole suite as two pytest processes side by side, the multi-process tests in one (one after the
other, as they need the cores and time their re-joins) and the in-process tests in the other; exits non-zero if
either fails. Extra arguments go to both."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

NOTHING_SELECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def main(argv: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", "-q", "--durations=10", *argv]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as in_process_log:
        # Its output waits in a file and follows the multi-process run's, which streams: one report at a time.
        in_process = subprocess.Popen([*base, "-m", "not processes"], stdout=in_process_log, stderr=subprocess.STDOUT)
        try:
            print("== multi-process tests (the in-process tests run beside them; their report follows)", flush=True)
            processes_code = subprocess.call([*base, "-m", "processes"])
            in_process_code = in_process.wait()
        finally:
            if in_process.poll() is None:
                in_process.kill()
                in_process.wait()
        in_process_log.seek(0)
        print("\n== in-process tests")
        print(in_process_log.read(), end="", flush=True)
    elapsed = time.monotonic() - started
    print(f"\n== whole suite in {int(elapsed // 60)}:{int(elapsed % 60):02d}: multi-process tests "
          f"{_outcome(processes_code)}, in-process tests {_outcome(in_process_code)}")
    codes = {processes_code, in_process_code}
    # Exit 5 is pytest's "no test selected": fine for one half (arguments naming only one kind), not for both.
    return 0 if codes <= {0, NOTHING_SELECTED} and codes != {NOTHING_SELECTED} else 1


def _outcome(code: int) -> str:
    return {0: "passed", NOTHING_SELECTED: "none selected"}.get(code, f"FAILED (exit {code})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
