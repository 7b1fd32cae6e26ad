"""The shipped cluster job files use only flags `recycle train` has, and leave the node role to the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recycle.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
ROLE_FLAGS = {"--nnodes", "--node-rank", "--master-port"}


def _flags(command: str = "train") -> set[str]:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if a.dest == "command")
    return {flag for action in sub.choices[command]._actions for flag in action.option_strings}


def _train_flags() -> set[str]:
    return _flags("train")


@pytest.mark.parametrize("path, start, end", [
    ("examples/slurm/train.sbatch", "JOB=(", "COORDINATOR="),  # the flags every process gets, the coordinator too
    ("examples/kubernetes/coordinator.yaml", 'command: ["recycle", "coordinator"]', "---")])
def test_coordinator_flags_are_real(path: str, start: str, end: str) -> None:
    text = (ROOT / path).read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    part = code[code.index(start):]
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", part[:part.index(end)]))
    assert used and used <= _flags("coordinator"), sorted(used - _flags("coordinator"))


@pytest.mark.parametrize("path, start", [("examples/slurm/train.sbatch", "JOB=("),
                                         ("examples/kubernetes/pytorchjob.yaml", 'command: ["recycle", "train"]'),
                                         ("examples/kubernetes/coordinator.yaml", 'command: ["recycle", "train"]')])
def test_job_files_use_real_flags_and_no_role_flags(path: str, start: str) -> None:
    text = (ROOT / path).read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments may name any flag
    assert code.count(start) >= 1
    rest = code[code.index(start):]
    # srun's own flags (in the sbatch file, on the line that starts it) are not recycle's
    rest = "\n".join(line for line in rest.splitlines() if not line.lstrip().startswith("srun "))
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest))
    assert used and used <= _train_flags(), sorted(used - _train_flags())
    assert not used & ROLE_FLAGS  # nnodes, rank and port come from the cluster's variables
