"""`make test`: the whole suite as two pytest processes side by side: the tests marked `timing` (multi-process runs
whose outcome depends on timing: heartbeat timeouts, paced runs a re-joining worker must catch) one after the other
in one, every other test in the other; exits non-zero if either fails. Extra arguments go to both."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

NOTHING_SELECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def main(argv: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", "-q", "--durations=10", *argv]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as others_log:
        # Its report waits in a file and follows the timing run's, which streams: one report at a time.
        others = subprocess.Popen([*base, "-m", "not timing"], stdout=others_log, stderr=subprocess.STDOUT)
        try:
            print("== tests marked timing (the other tests run beside them; their report follows)", flush=True)
            timing_code = subprocess.call([*base, "-m", "timing"])
            others_code = others.wait()
        finally:
            if others.poll() is None:
                others.kill()
                others.wait()
        others_log.seek(0)
        print("\n== the other tests")
        print(others_log.read(), end="", flush=True)
    elapsed = time.monotonic() - started
    print(f"\n== whole suite in {int(elapsed // 60)}:{int(elapsed % 60):02d}: timing tests "
          f"{_outcome(timing_code)}, other tests {_outcome(others_code)}")
    codes = {timing_code, others_code}
    # Exit 5 is pytest's "no test selected": fine for one half (arguments naming only one kind), not for both.
    return 0 if codes <= {0, NOTHING_SELECTED} and codes != {NOTHING_SELECTED} else 1


def _outcome(code: int) -> str:
    return {0: "passed", NOTHING_SELECTED: "none selected"}.get(code, f"FAILED (exit {code})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
