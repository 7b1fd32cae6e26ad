"""Emulated costs: pacing rules on a fake clock (fast), and real 12-process runs of the paper's toy whose measured
steady-state period matches the simulator's prediction within 10 % (slow)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from recycle.config import load_config, parse_config
from recycle.errors import ConfigError
from recycle.ir import Action, Kind, Plan
from recycle.runtime.protocol.messages import Channel, Message
from recycle.runtime.worker.emulate import CostPacer, Emulation, PacedComm, action_cost, pacing_seconds_per_unit
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

pytestmark = [pytest.mark.timing]
TOY = "configs/toy.toml"


def toy_config(seq_len: int = 16):
    raw = load_config(TOY).to_dict()
    raw["workload"]["seq_len"] = seq_len  # the tiny model's real work stays far below one slot
    raw["training"]["steps"] = 6
    return parse_config(raw, name="toy-emulated")


# -- pacing rules on a fake clock ---------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class RecordingComm:
    """A transport that logs what reaches it, with receives that take `recv_wait` seconds on the fake clock."""

    def __init__(self, clock: FakeClock, recv_wait: float = 0.0) -> None:
        self.clock, self.recv_wait = clock, recv_wait
        self.sent: list[tuple[float, Message]] = []
        self.collectives = 0

    def send(self, message, tensor) -> None:
        self.sent.append((self.clock.now, message))

    def recv(self, message, shape, dtype):
        self.clock.now += self.recv_wait
        return torch.zeros(shape, dtype=dtype)

    def flush(self) -> None:
        pass

    def stage_allreduce_sum(self, stage, tensor) -> None:
        self.clock.now += 0.5  # waiting for the slowest peer
        self.collectives += 1

    def world_allreduce_sum(self, tensor) -> None:
        self.clock.now += 0.5
        self.collectives += 1

    def barrier(self) -> None:
        self.world_allreduce_sum(torch.zeros(1))


def make_pacer(plan: Plan, rank: int, config, clock: FakeClock, inner: RecordingComm) -> CostPacer:
    comm = PacedComm(inner, clock=clock)
    return CostPacer(config, plan, rank, Emulation(slot_ms=1000.0), comm, clock=clock, sleep=clock.sleep)


def test_actions_are_padded_to_their_cost_and_messages_leave_at_the_padded_end() -> None:
    config = toy_config()
    plan = build_schedule(config, "1f1b", staggered=True)
    clock = FakeClock()
    inner = RecordingComm(clock)
    pacer = make_pacer(plan, 0, config, clock, inner)
    message = Message(Channel.ACTIVATION, 0, 0, 1)

    def forward(action: Action) -> None:
        clock.now += 0.1  # real work: a tenth of a slot
        pacer.comm.send(message, torch.ones(2))
        assert inner.sent == []  # held back: the consumer must not start before the emulated producer ends

    pacer.run(Action(Kind.F, 0, 0), forward)
    assert clock.now == pytest.approx(1.0)  # F costs one slot of 1 s
    assert inner.sent == [(pytest.approx(1.0), message)]
    pacer.run(Action(Kind.F, 0, 1), lambda a: None)
    assert clock.now == pytest.approx(2.0)
    assert pacer.stats.overruns == 0 and pacer.stats.actions == 2


def test_start_is_the_inputs_arrival_and_overshoot_does_not_add_up() -> None:
    config = toy_config()
    plan = build_schedule(config, "1f1b", staggered=True)
    clock = FakeClock()
    inner = RecordingComm(clock, recv_wait=2.5)  # the activation arrives 2.5 s after the action began
    pacer = make_pacer(plan, 1, config, clock, inner)
    pacer.run(Action(Kind.F, 1, 0), lambda a: pacer.comm.recv(Message(Channel.ACTIVATION, 0, 0, 1), (1,),
                                                                torch.float32))
    assert clock.now == pytest.approx(3.5)  # arrival 2.5 + one slot
    clock.now += 0.2  # the process woke late / did bookkeeping: not part of the cost model
    pacer.run(Action(Kind.F, 1, 1), lambda a: None)
    assert clock.now == pytest.approx(4.5)  # starts at the previous emulated end, not at 3.7


def test_real_work_longer_than_the_cost_is_an_overrun_not_a_shortcut() -> None:
    config = toy_config()
    plan = build_schedule(config, "1f1b", staggered=True)
    clock = FakeClock()
    pacer = make_pacer(plan, 0, config, clock, RecordingComm(clock))

    def slow(action: Action) -> None:
        clock.now += 1.7

    pacer.run(Action(Kind.F, 0, 0), slow)
    assert clock.now == pytest.approx(1.7)
    assert pacer.stats.overruns == 1 and pacer.stats.worst_overrun_s == pytest.approx(0.7)


def test_opt_starts_at_the_first_collective_and_lasts_allreduce_plus_optimizer() -> None:
    config = toy_config()
    coupled = build_schedule(config, "1f1b", staggered=False)
    clock = FakeClock()
    inner = RecordingComm(clock)
    pacer = make_pacer(coupled, 0, config, clock, inner)

    def opt(action: Action) -> None:  # what the executor does for a coupled OPT: barrier, then the stage reduce
        pacer.comm.barrier()
        pacer.comm.stage_allreduce_sum(0, torch.zeros(3))

    pacer.run(Action(Kind.OPT, 0), opt)
    assert inner.collectives == 2
    assert clock.now == pytest.approx(0.5 + 3.0)  # met at the barrier (0.5), then optimizer = 3 slots


def test_action_costs_and_units() -> None:
    config = toy_config()
    plan = build_schedule(config, "zb-h1", staggered=True)
    assert action_cost(config, plan, Action(Kind.W, 2, 0)) == 1.0
    assert action_cost(config, plan, Action(Kind.OPT, 2)) == 3.0
    assert pacing_seconds_per_unit(config, Emulation(slot_ms=40)) == pytest.approx(0.04)
    us = parse_config({"time_unit": "us", "topology": {"num_replicas": 2, "num_stages": 2},
                       "workload": {"num_microbatches": 2},
                       "costs": {"forward": 100, "backward_input": 100, "backward_weight": 100, "optimizer": 50},
                       "communication": {"allreduce_latency": 10, "gradient_bytes": 1000,
                                         "allreduce_bandwidth": 100}})
    plan_us = build_schedule(us, "1f1b", staggered=True)
    assert action_cost(us, plan_us, Action(Kind.OPT, 0)) == pytest.approx(2 * 10 + 1000 / 100 + 50)
    assert pacing_seconds_per_unit(us, Emulation(scale=10)) == pytest.approx(1e-5)
    with pytest.raises(ConfigError, match="--slot-ms"):
        Emulation(slot_ms=0)


# -- real processes ------------------------------------------------------------------------------------------------
def measured_period(metrics_path, warmup: int = 2) -> float:
    """Mean steady-state period from the launcher's metrics JSONL, skipping the warm-up steps."""
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    return statistics.mean(s["period_s"] for s in steps[warmup:])


def adaptive_toy_plan(config) -> Plan:
    from recycle.planner.api import make_plan  # the test may use the planner; the runtime may not
    from recycle.planner.options import PlannerOptions

    return make_plan(config, [(1, 2)], PlannerOptions(decoupled=True, staggered=True))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["1f1b", "adaptive-1:2-down"])
def test_emulated_period_matches_the_simulator(which: str, tmp_path) -> None:
    from recycle.runtime.control.launcher import launch
    from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions, RecoveryOptions

    config = toy_config()
    plan = build_schedule(config, "1f1b", staggered=False) if which == "1f1b" else adaptive_toy_plan(config)
    slot_ms = 50.0
    predicted = simulate(plan, config).period * slot_ms / 1e3
    metrics = tmp_path / "metrics.jsonl"
    launch(config, plan, LaunchOptions(steps=6, debug=DebugOptions(emulation=Emulation(slot_ms=slot_ms)),
                                       outputs=OutputOptions(metrics_path=str(metrics)),
                                       cluster=ClusterOptions(start_method="forkserver"),
                                       recovery=RecoveryOptions(timeout_s=60), progress=None))
    period = measured_period(metrics)
    assert abs(period / predicted - 1) < 0.10, (which, period, predicted)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_cli_flag_paces_the_run(tmp_path, capsys) -> None:
    """`recycle train --emulate-costs --slot-ms` reaches the workers: the tiny job's steps last what the plan says,
    about 20x longer than its real work."""
    from recycle.cli import main

    config = load_config("configs/tiny-gpt.toml")
    slot_ms = 30.0
    predicted = simulate(build_schedule(config, "1f1b", staggered=True), config).period * slot_ms / 1e3
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--config", "configs/tiny-gpt.toml", "--schedule", "1f1b", "--steps", "5",
                 "--emulate-costs", "--slot-ms", str(slot_ms), "--metrics", str(metrics)]) == 0
    assert abs(measured_period(metrics) / predicted - 1) < 0.15
    assert main(["train", "--config", "configs/tiny-gpt.toml", "--emulate-costs", "--slot-ms", "0"]) == 2
    assert "--slot-ms 0" in capsys.readouterr().err


def test_a_send_that_fails_at_release_is_never_sent_on_a_later_transport() -> None:
    """A peer dies while a finished action waits for its padded end: the release raises, and that message must not
    reach the next generation's transport (found by benchmarks/bench_recovery.py)."""
    clock = FakeClock()
    comm = PacedComm(RecordingComm(clock), clock)
    stale = Message(Channel.ACTIVATION, 0, 0, 1)

    class Broken:
        def send(self, message: Message, tensor: torch.Tensor) -> None:
            raise RuntimeError("Connection closed by peer")

    comm.inner = Broken()
    comm.send(stale, torch.ones(1))
    with pytest.raises(RuntimeError):
        comm.release()
    fresh = RecordingComm(clock)
    comm.inner = fresh
    comm.send(Message(Channel.ACTIVATION, 1, 0, 1), torch.ones(1))
    comm.release()
    assert [m.mb for _, m in fresh.sent] == [1]


def test_a_resend_has_no_cost_and_its_message_leaves_at_once() -> None:
    """A completion's re-send of a logged tensor (ir.completion SA/SG) is no paced action: held for the next paced
    action, it reached its consumer only after this worker's next receive, which waited on that very consumer (every
    paced recovery that re-sent a message sat out the collective timeout, 30 s, before this)."""
    config = toy_config()
    plan = build_schedule(config, "1f1b", staggered=True)
    clock = FakeClock()
    inner = RecordingComm(clock)
    pacer = make_pacer(plan, 0, config, clock, inner)
    pacer.run(Action(Kind.F, 0, 0), lambda a: None)
    resent = Message(Channel.ACTIVATION, 1, 0, 1)
    pacer.run_untimed(lambda: pacer.comm.send(resent, torch.ones(2)))
    assert inner.sent == [(pytest.approx(1.0), resent)]  # out at once, no slot added to the clock
    assert pacer.stats.actions == 1

    def broken() -> None:
        pacer.comm.send(Message(Channel.ACTIVATION, 2, 0, 1), torch.ones(2))
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError):
        pacer.run_untimed(broken)
    assert pacer.comm.held == []  # a failed re-send's message never reaches a later transport
