"""The launcher's option checks before any worker starts, and the split of ranks over nodes."""

from __future__ import annotations

import pytest

from recycle.errors import ConfigError
from recycle.runtime.launcher import LaunchOptions, _check_options, node_ranks
from recycle.schedules.fault_free import build_schedule


def test_launch_option_errors(tiny_config, tmp_path) -> None:
    config = tiny_config()
    plan = build_schedule(config, "1f1b")
    with pytest.raises(ConfigError, match="no checkpoint"):
        _check_options(config, plan, LaunchOptions(resume_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        _check_options(config, plan, LaunchOptions(checkpoint_every=2))
    assert node_ranks([0, 1, 2, 3, 4], 2, 0) == [0, 1, 2] and node_ranks([0, 1, 2, 3, 4], 2, 1) == [3, 4]
