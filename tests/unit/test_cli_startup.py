"""CLI start-up: `recycle --help` lists every command without importing heavy modules (torch, ortools, matplotlib)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from recycle.cli import COMMAND_HELP, build_parser

HEAVY = ("torch", "ortools", "matplotlib", "tqdm", "tensorboard", "logging")
_PROBE = ("import sys\nfrom recycle.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
          "print('HEAVY:' + ' '.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")


def test_help_lines_match_the_command_modules() -> None:
    parser = build_parser()  # every command registered from its own module
    sub = next(a for a in parser._actions if a.dest == "command")
    registered = {choice.dest: choice.help for choice in sub._choices_actions}
    assert registered == COMMAND_HELP


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["schedule", "--help"], ["simulate", "--help"],
                                  ["train", "--help"]])
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "usage: recycle" in out.stdout
    heavy = [line for line in out.stderr.splitlines() if line.startswith("HEAVY:")]
    assert heavy == ["HEAVY:"], f"recycle {' '.join(argv)} imported {heavy}"
