"""The launch options: each sub-config refuses its bad values when it is made, the flat keyword names of
recycle.train reach their fields, the launcher's checks against the config and plan, and the split of ranks over
nodes."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

import pytest

from recycle.errors import ConfigError
from recycle.runtime.control.launcher import _check_options, node_ranks
from recycle.runtime.options import (KEYWORDS, CheckpointOptions, ClusterOptions, DebugOptions, FaultOptions,
                                     LaunchOptions, OutputOptions, RecoveryOptions, with_keywords)
from recycle.runtime.tools.faults import FaultInjection
from recycle.schedules.fault_free import build_schedule


def test_launch_option_errors(tiny_config, tmp_path) -> None:
    config = tiny_config()
    plan = build_schedule(config, "1f1b")
    with pytest.raises(ConfigError, match="no checkpoint"):
        _check_options(config, plan, LaunchOptions(checkpoint=CheckpointOptions(resume_dir=str(tmp_path))))
    assert node_ranks([0, 1, 2, 3, 4], 2, 0) == [0, 1, 2] and node_ranks([0, 1, 2, 3, 4], 2, 1) == [3, 4]


@pytest.mark.parametrize("make,needle", [
    (lambda: CheckpointOptions(every=2), "--checkpoint-every 2 needs --checkpoint-dir DIR"),
    (lambda: OutputOptions(grad_norm="no"), r"grad_norm 'no' must be True \(always\), False \(never\) or None"),
    (lambda: CheckpointOptions(dir="ck", every=-1), "--checkpoint-every -1 needs"),
    (lambda: CheckpointOptions(dir="ck"), "would never write a checkpoint"),
    (lambda: CheckpointOptions(dir="ck", every=1, keep=0), "--keep-checkpoints 0 must be an integer >= 1"),
    (lambda: CheckpointOptions(dir="ck", every=1, keep=2.5), "must be an integer >= 1"),
    (lambda: CheckpointOptions(keep=2), "--keep-checkpoints 2 needs --checkpoint-dir"),
    (lambda: RecoveryOptions(timeout_s=math.nan), "--timeout nan must be a positive number"),
    (lambda: RecoveryOptions(timeout_s=0.5), "--timeout 0.5 s is below 1 s"),
    (lambda: RecoveryOptions(hang_timeout_s=0), "--hang-timeout 0 s must be > 0"),
    (lambda: RecoveryOptions(hang_timeout_s=math.inf), "--hang-timeout inf must be a finite number"),
    (lambda: RecoveryOptions(heartbeat_timeout_s=0.5), r"must be at least twice the heartbeat interval \(0.5 s\)"),
    (lambda: RecoveryOptions(stage_loss="wait"), "--on-stage-loss 'wait' is not a policy; use one of reshape, respawn"),
    (lambda: RecoveryOptions(redo="step"), "--redo 'step' is not a policy; use lost"),
    (lambda: ClusterOptions(master_port=70000), "--master-port 70000 is not a TCP port"),
    (lambda: ClusterOptions(node_rank=1), r"--node-rank 1 must be in \[0, --nnodes 1\)"),
    (lambda: ClusterOptions(nnodes=2, node_rank=1, token="x" * 48), "needs a fixed --master-port"),
    (lambda: ClusterOptions(nnodes=2, master_port=29500), "needs a job secret shared by every node"),
    (lambda: ClusterOptions(backend="mpi"), "backend 'mpi' is not supported; use one of nccl, gloo"),
    (lambda: ClusterOptions(start_method="fork"), "start method 'fork' is not supported"),
    (lambda: FaultOptions(respawn_after_s=-1.0), "--respawn-after -1 must be >= 0 seconds"),
    (lambda: FaultOptions(respawn_after_s=math.nan), "--respawn-after nan must be >= 0 seconds"),
    (lambda: LaunchOptions(steps=-1), "--steps -1 must be >= 0"),
])
def test_each_sub_config_refuses_its_bad_values_with_the_fix(make, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make()


def test_the_defaults_are_valid_and_checkpoints_fall_due_every_k_steps() -> None:
    assert LaunchOptions().checkpoint.enabled is False
    every_two = CheckpointOptions(dir="ck", every=2)
    assert every_two.enabled and [s for s in range(1, 7) if every_two.due(s)] == [2, 4, 6]
    assert not CheckpointOptions().due(2)
    fault = FaultInjection(step=1)
    faults = FaultOptions(injections=((3, fault), (1, FaultInjection(step=2)), (3, FaultInjection(step=4))))
    assert faults.of(3) == (fault, FaultInjection(step=4)) and faults.of(0) == ()


def test_every_option_has_exactly_one_flat_keyword() -> None:
    groups = {f.name for f in fields(LaunchOptions) if is_dataclass(f.default)}
    assert groups == {"outputs", "checkpoint", "recovery", "cluster", "faults", "debug"}
    leaves = {("", f.name) for f in fields(LaunchOptions) if f.name not in groups}
    for group in groups:
        leaves |= {(group, f.name) for f in fields(getattr(LaunchOptions(), group))}
    assert sorted(KEYWORDS.values()) == sorted(leaves)


def test_flat_keywords_land_in_their_sub_configs_checked_together() -> None:
    def progress(line: str) -> None:
        del line

    options = with_keywords(LaunchOptions(debug=DebugOptions(record_timings=True)), dict(
        steps=3, save_path="out.pt", checkpoint_dir="ck", checkpoint_every=2, keep_checkpoints=1, timeout_s=5.0,
        stage_loss="respawn", start_method="forkserver", faults=((1, FaultInjection(step=0)),), verify_replicas=True,
        progress=progress))
    assert options.steps == 3 and options.outputs == OutputOptions(save_path="out.pt")
    assert options.checkpoint == CheckpointOptions(dir="ck", every=2, keep=1)  # dir and interval set as one
    assert options.recovery == RecoveryOptions(timeout_s=5.0, stage_loss="respawn")
    assert options.cluster == ClusterOptions(start_method="forkserver")
    assert options.faults.of(1) == (FaultInjection(step=0),) and options.progress is progress
    assert options.debug == DebugOptions(record_timings=True, verify_replicas=True)  # the base's other values stay
    with pytest.raises(ConfigError, match="--checkpoint-every 2 needs --checkpoint-dir"):
        with_keywords(LaunchOptions(), {"checkpoint_every": 2})


def test_the_grad_norm_metric_is_on_when_a_report_wants_it() -> None:
    """Auto (None): on with --metrics or a sink (--tensorboard), off otherwise; True or False decides alone."""
    class Sink:
        def on_step(self, metrics: object) -> None: ...
        def on_eval(self, evaluation: object) -> None: ...
        def on_recovery(self, recovery: object) -> None: ...
        def on_chaos(self, event: object) -> None: ...

    assert LaunchOptions().wants_grad_norm is False
    assert LaunchOptions(outputs=OutputOptions(metrics_path="m.jsonl")).wants_grad_norm is True
    assert LaunchOptions(sink=Sink()).wants_grad_norm is True
    assert with_keywords(LaunchOptions(), {"grad_norm": True}).wants_grad_norm is True
    assert with_keywords(LaunchOptions(sink=Sink()), {"grad_norm": False, "metrics_path": "m.jsonl"}) \
        .wants_grad_norm is False
