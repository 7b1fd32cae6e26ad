"""Scripted faults (`recycle train --inject kill:1:1@3.5`): parsing, and arming them in a worker so they fire at an
exact point of its work. An outside `kill -9` is handled the same way; these only make the point reproducible."""

from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass

from recycle.errors import ConfigError
from recycle.ir.worker import Worker

__all__ = ["FaultInjection", "MODES", "POINTS", "parse_fault", "parse_rejoin", "fire"]

MODES = ("kill", "hang", "stall", "raise")
POINTS = ("action", "ckpt", "recovery", "eval")

_SPEC = re.compile(r"^(?P<mode>[a-z]+):(?P<replica>\d+):(?P<stage>\d+)(?::(?P<tp>\d+))?@(?P<step>\d+)(?:\.(?P<point>\d+|[a-z]+))?$")


@dataclass(frozen=True)
class FaultInjection:
    """At iteration `step` (0-based) the worker SIGKILLs itself ("kill"), freezes with SIGSTOP ("hang": only a
    heartbeat or the timeout can catch it), blocks its main thread for good while its heartbeat goes on ("stall": a
    deadlocked compute thread; only the progress check catches it) or raises ("raise"). `point` says where: before action `index` of its
    action list ("action"), in the middle of writing its checkpoint file after the step ("ckpt"), as soon as it
    stops for a recovery in that iteration or later ("recovery": a failure during a recovery), or before its first
    forward of the evaluation after the step ("eval", [training] eval_every). `tp_rank`: which of a
    tensor-parallel worker's processes it hits (any one of them takes the whole worker down)."""

    step: int
    index: int = 0
    mode: str = "kill"
    point: str = "action"
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.mode == "freeze":  # the name older callers use
            object.__setattr__(self, "mode", "hang")
        if self.mode not in MODES:
            raise ConfigError(f"fault mode {self.mode!r} is unknown; use one of {', '.join(MODES)}")
        if self.point not in POINTS:
            raise ConfigError(f"fault point {self.point!r} is unknown; use an action index or one of "
                              f"{', '.join(POINTS[1:])}")

    def describe(self) -> str:
        where = f"action {self.index}" if self.point == "action" else self.point
        rank = f" of TP rank {self.tp_rank}" if self.tp_rank else ""
        return f"{self.mode}{rank} at step {self.step + 1}, {where}"


def parse_fault(spec: str, num_replicas: int, num_stages: int,
                tp_degree: int = 1) -> tuple[tuple[int, int], FaultInjection]:
    """'kill:1:1@3.5' -> ((1, 1), FaultInjection(step=2, index=5)); STEP is 1-based as the progress lines print it;
    the part after the dot is an action index (0-based, in the worker's action list), 'ckpt', 'recovery' or
    'eval'. 'kill:1:1:1@3.5' hits TP rank 1 of worker 1:1 (a worker of `tp_degree` > 1 processes)."""
    match = _SPEC.match(spec.strip())
    rule = ("--inject takes MODE:REPLICA:STAGE@STEP[.ACTION], e.g. kill:1:1@3.5 (MODE kill, hang, stall or raise; STEP "
            "1-based; ACTION an index into the worker's action list, or 'ckpt', 'recovery' or 'eval'), "
            "MODE:REPLICA:STAGE:TP_RANK@STEP[.ACTION] for one process of a tensor-parallel worker, or "
            "rejoin:R:S@STEP")
    if not match:
        raise ConfigError(f"--inject {spec!r}: {rule}")
    mode = match["mode"]
    if mode not in MODES:
        raise ConfigError(f"--inject {spec!r}: mode {mode!r} is unknown; {rule}")
    (replica, stage), step = _worker_and_step(spec, match, num_replicas, num_stages)
    tp_rank = int(match["tp"] or 0)
    if tp_rank >= tp_degree:
        raise ConfigError(f"--inject {spec!r}: TP rank {tp_rank} is outside the worker's {tp_degree} process(es) "
                          f"([topology] gpus_per_worker = {tp_degree}); use TP_RANK < {tp_degree}")
    point_text = match["point"] or "0"
    if point_text.isdigit():
        return (replica, stage), FaultInjection(step - 1, int(point_text), mode, "action", tp_rank)
    if point_text not in POINTS[1:]:
        raise ConfigError(f"--inject {spec!r}: {point_text!r} is not an action index, 'ckpt', 'recovery' or "
                          "'eval'")
    return (replica, stage), FaultInjection(step - 1, 0, mode, point_text, tp_rank)


def parse_rejoin(spec: str, num_replicas: int, num_stages: int) -> tuple[tuple[int, int], int]:
    """'rejoin:1:1@8' -> ((1, 1), 7): bring worker 1:1 back (if it is down) once 7 steps are done."""
    match = _SPEC.match(spec.strip())
    if not match or match["mode"] != "rejoin" or match["point"] is not None or match["tp"] is not None:
        raise ConfigError(f"--inject {spec!r}: a re-join is rejoin:REPLICA:STAGE@STEP, e.g. rejoin:1:1@8 (STEP "
                          "1-based: the worker is started again when that step begins)")
    (replica, stage), step = _worker_and_step(spec, match, num_replicas, num_stages)
    return (replica, stage), step - 1


def _worker_and_step(spec: str, match: re.Match[str], num_replicas: int, num_stages: int) -> tuple[tuple[int, int], int]:
    """The (replica, stage) and 1-based STEP of a matched spec, checked against the topology."""
    replica, stage, step = int(match["replica"]), int(match["stage"]), int(match["step"])
    if not (0 <= replica < num_replicas and 0 <= stage < num_stages):
        raise ConfigError(f"--inject {spec!r}: worker {Worker(replica, stage)} is outside the topology (D={num_replicas}, "
                          f"S={num_stages}); use REPLICA < {num_replicas} and STAGE < {num_stages}")
    if step < 1:
        raise ConfigError(f"--inject {spec!r}: STEP {step} must be >= 1 (steps count from 1)")
    return (replica, stage), step


def fire(fault: FaultInjection, where: str) -> None:
    """Carry the fault out now."""
    if fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.mode == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # if ever continued, it carries on as a slow worker would
    elif fault.mode == "stall":
        threading.Event().wait()  # nothing ever sets it: the main thread is stuck, the watcher thread beats on
    else:
        raise ValueError(f"injected fault ({fault.describe()}) at {where}")
