"""Layer re-partitioning: per-layer costs, balanced partitions, memory caps, the plan's partition field, ReCycle+."""

from __future__ import annotations

import json

import pytest

from recycle.config import load_config, parse_config
from recycle.errors import ConfigError, PlanError
from recycle.ir.plan import Plan
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import (balanced_partition, best_partition, layer_costs, make_repartitioned_plan,
                                       migration_bytes, partition_bound, partition_caps, partition_config,
                                       partition_period, stage_work, worker_memory_bytes)
from recycle.sim.simulator import simulate
from recycle.traces.jobsim import replay
from recycle.traces.mapping import UnitTimeline
from recycle.traces.model import JobContext, JobCosts
from recycle.traces.repartition import PartitionModel, ReCyclePlusSystem
from recycle.traces.throughput import ThroughputModel

pytestmark = pytest.mark.timeout(60)


def _config(D: int = 2, S: int = 2, M: int = 2, layers: list[int] | None = None, **memory) -> object:
    """Slot units, F = B = W = 2 per stage of 2 layers (1 per layer), 12 MB of state per stage, 1 MB per slot."""
    layers = layers or [2] * S
    raw = {
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": M},
        "costs": {"forward": [float(n) for n in layers], "backward_input": [float(n) for n in layers],
                  "backward_weight": [float(n) for n in layers]},
        "memory": {"parameter_bytes": [2_000_000 * n for n in layers],
                   "optimizer_state_bytes": [4_000_000 * n for n in layers], **memory},
        "communication": {"p2p_bandwidth": 1_000_000.0},
        "model": {"layers_per_stage": layers},
    }
    return parse_config(raw, name="part")


def test_per_layer_costs_of_gpt3_are_the_config_comments() -> None:
    config = load_config("configs/gpt3-6.7b-a100.toml")
    costs = layer_costs(config)
    assert costs.layers == (8, 8, 8, 8)
    assert costs.per_layer["forward"] == pytest.approx(95291.0 / 8)
    # Stage 3's surplus is the LM head (2hV FLOP per token in F), stage 0's state surplus the embeddings.
    assert costs.fixed["forward"] == pytest.approx((0, 0, 0, 106533.3 - 95291.0))
    assert costs.fixed["parameter_bytes"][0] == pytest.approx(2 * (205_852_672 + 8_388_608))
    assert costs.moved_bytes_per_layer() == pytest.approx(14 * 201_379_840)  # bf16 weights + fp32 master + Adam
    same = partition_config(config, (8, 8, 8, 8))
    assert same.costs == config.costs and same.memory.parameter_bytes == config.memory.parameter_bytes


def test_balanced_partition_hand_checked() -> None:
    # D=2, S=2, stage 0 lost a replica: its one survivor runs both pipelines' micro-batches (2M per worker, 3 per
    # layer each), stage 1's two workers M each. (1, 3): max(2*2*3*1, 2*3*3) = 18 < (2, 2): max(24, 12).
    config = _config()
    assert balanced_partition(config, (1, 0)) == (1, 3)
    assert balanced_partition(config, (0, 0)) == (2, 2)
    # S=3, 6 layers, the middle stage lost half: it gets one layer, the others share the rest (max work 9M).
    config3 = _config(S=3)
    part = balanced_partition(config3, (0, 1, 0))
    costs = layer_costs(config3)
    assert part[1] == 1 and sum(part) == 6
    assert max(stage_work(config3, costs, s, n, live) for s, (n, live) in enumerate(zip(part, (2, 1, 2)))) == 18


def test_best_partition_beats_rerouting_and_the_plan_records_it() -> None:
    config = _config(M=4)
    choice = best_partition(config, (1, 0))
    assert choice.partition == (1, 3) and choice.period < choice.configured_period
    assert choice.ideal_period <= choice.period
    plan, again = make_repartitioned_plan(config, [(0, 0)])
    assert plan.partition == (1, 3) and again.partition == (1, 3)
    # The simulator times the plan on its own layers: the derived config's per-stage costs.
    assert simulate(plan, partition_config(config, plan.partition)).period == pytest.approx(choice.period)
    assert best_partition(config, (0, 0)).partition == (2, 2)  # nothing failed: the configured layout stays


def test_memory_caps_follow_the_partition() -> None:
    # 10 MB activation budget; 1 MB of activations per layer per micro-batch; 6 MB (+2 MB of gradients: 0 here)
    # of state per layer. Stage 1 taking a third layer: room 10 - 6 = 4 MB for 3 MB micro-batches -> 1.
    config = _config(activation_bytes=[2_000_000, 2_000_000], capacity_bytes=10_000_000)
    assert partition_caps(config, (2, 2)) == (5, 5)
    assert partition_caps(config, (1, 3)) == (16, 1)
    with pytest.raises(PlanError, match="stage 1 with 3 layers"):
        partition_caps(_config(activation_bytes=[2_000_000, 2_000_000], capacity_bytes=8_000_000), (1, 3))


def test_migration_bytes_hand_checked() -> None:
    costs = layer_costs(_config())
    # (2, 2) -> (1, 3), stage 0 has one live worker: it sends layer 1 to both stage-1 workers.
    assert migration_bytes(costs, (2, 2), (1, 3), (1, 2)) == (6_000_000, 12_000_000)
    assert migration_bytes(costs, (1, 3), (2, 2), (2, 2)) == (6_000_000, 6_000_000)


def test_layers_per_stage_bad_values_are_clear_errors() -> None:
    base = {"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 2},
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}
    with pytest.raises(ConfigError, match="one count >= 1 per stage"):
        parse_config({**base, "model": {"layers_per_stage": [4, 0]}})
    with pytest.raises(ConfigError, match="one count >= 1 per stage"):
        parse_config({**base, "model": {"layers_per_stage": [4]}})
    with pytest.raises(ConfigError, match="sums to 8 layers but \\[model\\] n_layer = 6"):
        parse_config({**base, "model": {"layers_per_stage": [4, 4], "n_layer": 6}})
    with pytest.raises(ConfigError, match="list of whole numbers"):
        parse_config({**base, "model": {"layers_per_stage": "4,4"}})
    assert parse_config({**base, "model": {"layers_per_stage": [3, 5]}}).model.n_layer == 8


def test_plan_json_round_trip_with_and_without_partition() -> None:
    plan, _ = make_repartitioned_plan(_config(M=4), [(0, 0)])
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.partition == (1, 3)
    plain = Plan.from_json(plan.to_json().replace(',"partition":[1,3]', ""))
    assert plain.partition == () and "partition" not in json.loads(plain.to_json())
    bad = json.loads(plan.to_json())
    for value in ([1, 0], [1, 2, 3], "1,3", [1.5, 2]):
        bad["partition"] = value
        with pytest.raises(PlanError, match="partition"):
            Plan.from_dict(bad)


class _FakePartitions(PartitionModel):
    """Hand-set periods (slots = s): re-routing alone 10 + 5 per failure, re-partitioned (1, 3) 10 + 2."""

    def period(self, key, partition):
        return 10.0 + (5.0 if partition == self.configured else 2.0) * sum(key)

    def choice(self, key):
        return (1, 3) if any(key) else self.configured


def _plus(prior_s: float = 60.0) -> tuple[ReCyclePlusSystem, float]:
    config = _config()
    costs = JobCosts(detect_s=2, plan_switch_s=1, fallback_checkpoint_interval_s=1e9, reshape=False,
                     repartition_prior_s=prior_s)
    model = ThroughputModel(config, lambda key: 10.0 + 5.0 * sum(key), 1.0, "fake")
    ctx = JobContext(config, model.fault_free(), 1.0, costs)
    return ReCyclePlusSystem(ctx, model, _FakePartitions(model)), ctx.fault_free_rate


def _timeline(points: list[tuple[float, set[int]]], end: float) -> UnitTimeline:
    return UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), end, 1, 1)


def test_policy_reroutes_a_short_failure_and_repartitions_a_long_one() -> None:
    # Units 0..3 hold (0,0), (0,1), (1,0), (1,1); unit 2 = (1, 0) fails. Moving layer 1 to stage 1 costs 12 s (6 MB
    # to each of 2 receivers from the one live sender, 1 MB/s; the failure's own plan switch is the one to the
    # re-partitioned plan). Expected state duration = (prior 60 s + gaps seen) / (1 + gaps): 35 s after a failure
    # at 10 s -> gain 1/3*(35-12) - 4/15*35 < 0; 1830 s after a failure at 3600 s -> gain > 0.
    short, _ = _plus()
    replay(short, _timeline([(0, {0, 1, 2, 3}), (10, {0, 1, 3}), (20, {0, 1, 2, 3})], 100), 0.4)
    assert [p for _, p, _ in short.policy_log if p in ("re-route", "repartition")] == ["re-route"]
    long, _ = _plus()
    replay(long, _timeline([(0, {0, 1, 2, 3}), (3600, {0, 1, 3}), (7200, {0, 1, 2, 3})], 9000), 0.4)
    assert [p for _, p, _ in long.policy_log if p in ("repartition", "layers back")] == ["repartition",
                                                                                         "layers back"]


def test_repartition_timeline_hand_computed() -> None:
    system, ff = _plus()
    run = replay(system, _timeline([(0, {0, 1, 2, 3}), (3600, {0, 1, 3}), (7200, {0, 1, 2, 3})], 9000), ff)
    assert ff == pytest.approx(0.4)  # 4 samples / 10 s
    # 0-3600 at 0.4. 3600: detect 2 + the interrupted iteration's half redone on the re-routed plan 7.5 (2 samples
    # at 4/15 per s) + plan switch 1 (to the re-partitioned plan: one switch per event) + the migration 12 s ->
    # 3622.5, then the re-partitioned rate
    # 4 / 12. 7200: unit 2 re-joins, copying its 12 MB of stage state for 12 s while training goes on; 7212: plan
    # switch 1 + layers back 6 (6 MB: the two stage-0 workers each take layer 1 from a stage-1 peer) -> 7219,
    # then 0.4 until 9000.
    expected = 3600 * 0.4 + (7212 - 3622.5) * 4 / 12 + (9000 - 7219) * 0.4
    assert run.processed_samples == pytest.approx(expected)
    assert run.series == ((0.0, 0.4), (3600.0, 0.0), (3622.5, pytest.approx(1 / 3)), (7212.0, 0.0),
                          (7219.0, 0.4))
    assert run.lost_s["reconfiguration"] == pytest.approx(12 + 6) and run.lost_s["redone iteration"] == pytest.approx(7.5)
    assert run.lost_s["plan switch"] == pytest.approx(2)
    assert run.useful_samples / ff + sum(run.lost_s.values()) == pytest.approx(9000)


_TOML = """
[topology]
num_replicas = 2
num_stages = 2
[workload]
num_microbatches = 4
[costs]
forward = 2
backward_input = 2
backward_weight = 2
[model]
layers_per_stage = [2, 2]
"""


def test_plan_cli_prints_and_saves_the_partition(tmp_path, capsys) -> None:
    from recycle.cli import main

    config = tmp_path / "c.toml"
    config.write_text(_TOML)
    saved = tmp_path / "plan.json"
    assert main(["plan", "--config", str(config), "--fail", "0:0", "--repartition", "--json", "--save",
                 str(saved)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["partition"]["partition"] == [1, 3] and printed["partition"]["configured"] == [2, 2]
    assert printed["period"] == pytest.approx(printed["partition"]["period"])
    assert printed["period"] < printed["partition"]["configured_period"]
    assert Plan.from_json(saved.read_text()).partition == (1, 3)
    assert main(["plan", "--config", str(config), "--fail", "0:0", "--repartition"]) == 0
    assert "layers per stage  1/3; configured 2/2" in capsys.readouterr().out
    code = main(["plan", "--config", str(config), "--max-failures", "1", "--out", str(tmp_path / "s"),
                 "--repartition"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and "--repartition" in err and "Traceback" not in err


def test_job_with_the_closed_form_estimate_runs_recycle_plus_and_skips_it_without_layers() -> None:
    from recycle.traces.experiments import JobSetup, job_grid, run_job
    from recycle.traces.generate import parse_generate_spec

    config = load_config("configs/gpt3-6.7b-a100.toml")
    trace = parse_generate_spec("paper-gcp:placement=spread", grid=job_grid(config), placement="random", seed=0)
    result = run_job(config, trace, systems=["recycle", "recycle-plus"], setup=JobSetup(period_model="estimate"))
    runs = result.runs
    assert runs["recycle-plus"].goodput >= runs["recycle"].goodput
    assert result.extra["partitions"] and any(p["partition"] != [8, 8, 8, 8] for p in result.extra["partitions"])
    assert any(e["policy"] == "repartition" for e in result.extra["recycle_plus_policy"])
    toy = load_config("configs/toy.toml")
    skipped = run_job(toy, parse_generate_spec("poisson:nodes=12,hours=1,mtbf_h=2,repair_h=0.5,seed=1"),
                      systems=["recycle", "recycle-plus"], setup=JobSetup(period_model="estimate", slot_seconds=0.01))
    assert set(skipped.runs) == {"recycle"} and "no [model] layers_per_stage" in skipped.extra["skipped"][
        "recycle-plus"]


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for n in range(1, total - parts + 2):
        for rest in _compositions(total - n, parts - 1):
            yield (n,) + rest


def _uneven(D: int = 3, M: int = 2) -> object:
    """S=3, 7 layers as 3/2/2 with a heavier last stage (an LM head): every partition differs."""
    raw = {
        "topology": {"num_replicas": D, "num_stages": 3},
        "workload": {"num_microbatches": M},
        "costs": {"forward": [3.0, 2.0, 4.0], "backward_input": [3.0, 2.0, 5.0], "backward_weight": [3.0, 2.0, 3.0]},
        "communication": {"allreduce_bandwidth": 1_000_000.0, "allreduce_latency": 0.1},
        "memory": {"parameter_bytes": [3_000_000, 2_000_000, 2_000_000]},
        "model": {"layers_per_stage": [3, 2, 2]},
    }
    return parse_config(raw, name="uneven")


def test_partition_bound_is_the_smallest_bound_over_every_partition() -> None:
    from recycle.planner.bounds import period_lower_bound

    config = _uneven()
    for key in ((1, 0, 0), (0, 0, 2), (1, 1, 0)):
        brute = min(period_lower_bound(partition_config(config, p), key) for p in _compositions(7, 3))
        found = partition_bound(config, key)
        assert found.exact and found.bound == pytest.approx(brute)
        assert period_lower_bound(partition_config(config, found.partition), key) == pytest.approx(brute)
        # No plan beats it: the branch and bound's choice is at or above it.
        assert best_partition(config, key, PlannerOptions(search=False)).period >= found.bound - 1e-9


def test_branch_and_bound_finds_the_best_screened_partition() -> None:
    # Screen only (no polish): the search must return the partition with the smallest priority-rules period of
    # all 15, though it plans far fewer of them.
    config = _uneven()
    screen = PlannerOptions(search=False)
    for key in ((1, 0, 0), (0, 0, 2), (1, 1, 0), (0, 1, 1)):
        periods = {p: partition_period(config, key, p, screen) for p in _compositions(7, 3)}
        choice = best_partition(config, key, screen, max_evaluations=99)
        assert choice.period == pytest.approx(min(periods.values()))
        assert choice.evaluated < len(periods)


def test_memory_caps_use_the_whole_device_of_a_lighter_stage() -> None:
    # Stage 0 holds 1 MB more state (an embedding): every device holds capacity 10 MB + stage 0's 13 MB = 23 MB.
    # Stage 1 taking a third layer holds 18 MB of state: 5 MB left for 3 MB micro-batches -> 1 (the old rule,
    # capacity + its own 12 MB today - 18 MB, left 4 MB). A stage that keeps its layers keeps its configured cap.
    config = _config(activation_bytes=[2_000_000, 2_000_000], capacity_bytes=10_000_000)
    raw = config.to_dict()
    raw["memory"]["parameter_bytes"] = [5_000_000, 4_000_000]
    config = parse_config(raw, name="embed")
    assert worker_memory_bytes(config) == 23_000_000
    assert partition_caps(config, (2, 2)) == (5, 5)
    assert partition_caps(config, (1, 3)) == ((23_000_000 - 7_000_000) // 1_000_000, 1)
    raw["memory"]["capacity_bytes"] = 8_000_000  # 21 MB devices: stage 1 with 3 layers has 3 MB left -> 1
    assert partition_caps(parse_config(raw, name="embed"), (1, 3))[1] == 1
    raw["memory"]["capacity_bytes"] = 7_000_000  # 20 MB: 2 MB left, less than one 3 MB micro-batch
    with pytest.raises(PlanError, match="stage 1 with 3 layers"):
        partition_caps(parse_config(raw, name="embed"), (1, 3))


def test_time_by_state_accounts_for_the_whole_replay() -> None:
    system, ff = _plus()
    replay(system, _timeline([(0, {0, 1, 2, 3}), (3600, {0, 1, 3}), (7200, {0, 1, 2, 3})], 9000), ff)
    states = {(tuple(s["key"]), tuple(s["partition"])): s for s in system.time_by_state(9000)}
    # As in test_repartition_timeline_hand_computed: 3612 s with 22.5 s of pauses on the re-partitioned layout until
    # the re-joined worker is ready at 7212 s; the configured layout before and after, 7 s of pauses on return.
    moved, home = states[((1, 0), (1, 3))], states[((0, 0), (2, 2))]
    assert moved["seconds"] == pytest.approx(3612) and moved["running_s"] == pytest.approx(3612 - 22.5)
    assert home["seconds"] == pytest.approx(3600 + 1788) and home["running_s"] == pytest.approx(3600 + 1788 - 7)
    assert moved["rate"] == pytest.approx(4 / 12) and set(states) == {((1, 0), (1, 3)), ((0, 0), (2, 2))}


def test_a_reshape_is_weighed_at_the_partition_chosen_for_each_layout() -> None:
    system, _ = _plus()
    current = system.current
    assert current.throughput_for_key((1, 0)) == pytest.approx(4 / 15)  # the configured layers: 10 + 5 slots
    current.best = True  # as while ReCycleSystem._maybe_reshape runs under ReCycle+
    assert current.throughput_for_key((1, 0)) == pytest.approx(4 / 12)  # (1, 3), chosen for the key: 10 + 2
    assert current.throughput_for_key((0, 0)) == pytest.approx(4 / 10)
    current.best = False
    system.layout.place_all(frozenset({0, 1, 2, 3}))
    assert system._maybe_reshape(0.0, frozenset({0, 1, 2, 3})) is None and current.best is False
