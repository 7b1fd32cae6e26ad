"""The shipped cluster job files use only flags `recycle train` has, and leave the node role to the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recycle.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
ROLE_FLAGS = {"--nnodes", "--node-rank", "--master-port"}


def _train_flags() -> set[str]:
    parser = build_parser(["train"])
    sub = next(a for a in parser._actions if a.dest == "command")
    return {flag for action in sub.choices["train"]._actions for flag in action.option_strings}


@pytest.mark.parametrize("path, start", [("examples/slurm/train.sbatch", "recycle train"),
                                         ("examples/kubernetes/pytorchjob.yaml", 'command: ["recycle", "train"]')])
def test_job_files_use_real_flags_and_no_role_flags(path: str, start: str) -> None:
    text = (ROOT / path).read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments may name any flag
    assert code.count(start) >= 1
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", code[code.index(start):]))
    # srun's own flags precede `recycle train` in the sbatch file and are cut off above
    assert used and used <= _train_flags(), sorted(used - _train_flags())
    assert not used & ROLE_FLAGS  # nnodes, rank and port come from the cluster's variables
