"""make test's runner refuses a deadline that is not a whole number of seconds with one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "run_suite.py"


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_a_bad_deadline_is_one_error_line_naming_the_value_and_the_fix(value: str) -> None:
    result = subprocess.run([sys.executable, str(RUNNER)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RECYCLE_SUITE_DEADLINE_S": value})
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (f"error: RECYCLE_SUITE_DEADLINE_S={value!r} is not a whole number of seconds > "
                                     "0; unset it for 2400 s")
