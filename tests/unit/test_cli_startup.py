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


_WARM_PROBE = ("import sys\nfrom multiprocessing import forkserver\n"
               "def probe():\n    print('WARM torch=%s' % ('torch' in sys.modules))\n    raise SystemExit(0)\n"
               "forkserver.ensure_running = probe\nfrom recycle.cli import main\n"
               "main(['train', '--config', 'configs/tiny-gpt.toml', '--steps', '1', '--start-method', {method!r}])\n"
               "print('no warm start')")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_forkserver_starts_before_the_launcher_imports_torch(method: str) -> None:
    """With forkserver, `recycle train` starts the server (which imports torch and the worker's modules) before the
    launcher imports torch itself, so the two imports overlap on two cores; spawn starts no server."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    probe = _WARM_PROBE.format(method=method)
    if method == "spawn":  # no server: stop the run where its workers would start, before any heavy work
        probe = probe.replace("from recycle.cli import main",
                              "import recycle.api\nrecycle.api.train = lambda *a, **k: sys.exit(print('no warm start'))"
                              "\nfrom recycle.cli import main")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    if method == "forkserver":
        assert out.stdout.splitlines()[-1] == "WARM torch=False", out.stdout
    else:
        assert "WARM" not in out.stdout and out.stdout.splitlines()[-1] == "no warm start", out.stdout
