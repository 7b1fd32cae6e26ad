"""The runtime's layer re-partition decision (planner.provider.RepartitioningProvider with planner.policy): a state
moves layers only when the faster plan repays the migration pause within the state's expected duration."""

from __future__ import annotations

import pytest

from recycle.config import parse_config
from recycle.ir import PlanChoice
from recycle.planner.api import make_plan
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import best_partition
from recycle.planner.policy import DurationEstimate, LayerDecision
from recycle.planner.provider import RepartitioningProvider

pytestmark = pytest.mark.timeout(60)


def _config():
    """D=2, S=2, M=4, slot units; 2 layers per stage at 1 slot per layer for F, B and W; 6 MB of parameters and
    optimizer state per layer, 1 MB per slot over p2p: one layer moved to both stage-1 workers by the single
    surviving stage-0 worker is 12 MB sent, a 12-slot pause."""
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 4},
        "costs": {"forward": [2.0, 2.0], "backward_input": [2.0, 2.0], "backward_weight": [2.0, 2.0]},
        "memory": {"parameter_bytes": [4_000_000, 4_000_000], "optimizer_state_bytes": [8_000_000, 8_000_000]},
        "communication": {"p2p_bandwidth": 1_000_000.0},
        "model": {"layers_per_stage": [2, 2]},
    }, name="provider")


def _provider(prior_s: float, clock: list[float]) -> RepartitioningProvider:
    config = _config()
    return RepartitioningProvider(config, PlannerOptions(), lambda failed: PlanChoice(make_plan(config, failed), "store",
                                                                                      0.0),
                                  seconds_per_unit=1.0, prior_s=prior_s, clock=lambda: clock[0])


def test_the_break_even_duration_is_the_hand_computed_one() -> None:
    choice = best_partition(_config(), (1, 0))
    assert choice.partition == (1, 3) and choice.period < choice.configured_period
    # Moving pays once rate_new * (E - 12) > rate_old * E, i.e. E > 12 * P_old / (P_old - P_new).
    break_even = 12 * choice.configured_period / (choice.configured_period - choice.period)
    for expected, moves in ((break_even * 0.9, False), (break_even * 1.1, True)):
        decision = LayerDecision((1, 0), (2, 2), (1, 3), 1 / choice.configured_period, 1 / choice.period, 12.0,
                                 expected)
        assert decision.move is moves
    back = LayerDecision((0, 0), (1, 3), (2, 2), 1.0, 1.0, 12.0, 1.0)
    assert back.move and back.gain < 0 and back.describe().startswith("layers back")


def test_a_short_state_keeps_rerouting_and_a_long_one_moves_layers() -> None:
    clock = [0.0]
    short = _provider(prior_s=5.0, clock=clock)(frozenset({(0, 0)}))
    assert short.plan.partition in ((), (2, 2)) and short.source == "store"
    assert short.note.startswith("no layer move: layers 2/2 -> 1/3") and "predicted gain -" in short.note
    long = _provider(prior_s=10_000.0, clock=clock)(frozenset({(0, 0)}))
    assert long.plan.partition == (1, 3) and long.source == "re-partition planner"
    assert long.note.startswith("re-partition: layers 2/2 -> 1/3") and "predicted gain +" in long.note


def test_the_expected_duration_follows_the_gaps_the_run_has_seen() -> None:
    estimate = DurationEstimate(100.0)
    for now in (0.0, 10.0, 20.0):
        estimate.observe(now)
    assert estimate.expected_s == pytest.approx((100 + 10 + 10) / 3)
    # A run whose failures come and go every second learns to keep re-routing even with a long prior.
    clock = [0.0]
    provide = _provider(prior_s=200.0, clock=clock)
    first = provide(frozenset({(0, 0)}))
    assert first.plan.partition == (1, 3)  # 200 s expected: worth the 12 s pause
    for step in range(1, 40):
        clock[0] = float(step)
        last = provide(frozenset() if step % 2 else frozenset({(0, 0)}))
    assert clock[0] == 39.0 and last.plan.partition in ((), (2, 2))  # every worker back: layers back
    clock[0] = 40.0
    again = provide(frozenset({(0, 0)}))  # expected (200 + 39) / 41 = 5.8 s now: not worth 12 s
    assert again.plan.partition in ((), (2, 2)) and again.note.startswith("no layer move")


def test_layers_stay_where_they_are_when_moving_them_back_would_not_pay() -> None:
    clock = [0.0]
    provide = _provider(prior_s=60.0, clock=clock)
    assert provide(frozenset({(0, 0)})).plan.partition == (1, 3)  # 60 s expected > the 48 s break-even
    for step, failed in enumerate(({(1, 0)}, {(0, 0)}, {(1, 0)}), start=1):  # stage 0 flaps every 0.1 s
        clock[0] = step / 10
        assert provide(frozenset(failed)).plan.partition == (1, 3)
    clock[0] = 0.4  # expected (60 + 0.4) / 5 = 12 s now
    both = provide(frozenset({(0, 0), (1, 1)}))
    # One worker per stage: 2/2 would be faster, but 12 s is too short to repay the 6 s move back.
    assert both.plan.partition == (1, 3) and both.source == "re-partition planner"
    assert both.note.startswith("no layer move: layers 1/3 -> 2/2") and set(both.plan.live_ranks()) == {1, 2}


def test_periods_are_turned_into_seconds_by_the_pacing_or_a_profiled_config() -> None:
    from recycle.api import _seconds_per_unit
    from recycle.runtime.worker.emulate import Emulation

    slot_config = _config()
    assert _seconds_per_unit(slot_config, Emulation(20.0, 1.0)) == pytest.approx(0.02)
    assert _seconds_per_unit(slot_config, None) is None  # no clock: the faster plan wins
    us_config = parse_config({"time_unit": "us", "topology": {"num_replicas": 2, "num_stages": 2},
                              "workload": {"num_microbatches": 4},
                              "costs": {"forward": 100, "backward_input": 100, "backward_weight": 100}})
    assert _seconds_per_unit(us_config, None) == pytest.approx(1e-6)


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_a_bad_prior_is_one_error_line(cli_error, value: str) -> None:
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml")
    line = cli_error(["train", "--config", config, "--steps", "1", "--repartition", f"--repartition-prior-s={value}"])
    assert "--repartition-prior-s" in line and "positive number of seconds" in line


def test_every_worker_back_brings_the_layers_back_and_says_so() -> None:
    clock = [0.0]
    provide = _provider(prior_s=10_000.0, clock=clock)
    assert provide(frozenset({(0, 0)})).plan.partition == (1, 3)
    clock[0] = 5.0
    back = provide(frozenset())
    assert back.plan.partition in ((), (2, 2)) and back.note == "layers back: 1/3 -> 2/2"
    clock[0] = 6.0
    assert provide(frozenset()).note == ""  # already there: nothing to say
