"""Shared pieces of the integration tests: the tiny two-by-two job as a TOML file."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

TINY_TOML = """{name}
[topology]
num_replicas = 2
num_stages = {num_stages}
[workload]
num_microbatches = 2
microbatch_size = 2
seq_len = 8
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[model]
preset = "tiny"
[training]
steps = {steps}
lr = 0.01
dtype = "float64"
{training}
"""


@pytest.fixture()
def tiny_config_file(tmp_path: Path) -> Callable[..., Path]:
    """Write the tiny D=2 x S=2 job (float64, M=2, micro-batch 2 x 8 tokens) and return its path; `training` adds
    lines to its [training] section."""

    def write(steps: int = 3, num_stages: int = 2, name: str = "", training: str = "",
              file: str = "cfg.toml") -> Path:
        path = tmp_path / file
        path.write_text(TINY_TOML.format(name=f'name = "{name}"' if name else "", num_stages=num_stages,
                                         steps=steps, training=training))
        return path

    return write


@pytest.fixture(autouse=True)
def _no_cluster_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`recycle train` takes its node role from cluster variables (docs/cluster.md); a suite run inside a SLURM job
    or a pod must not turn every single-node test into one node of a multi-node job."""
    import os

    for name in list(os.environ):
        if name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE") \
                or name.startswith(("SLURM_", "PET_")):
            monkeypatch.delenv(name)
