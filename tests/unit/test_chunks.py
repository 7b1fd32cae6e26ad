"""Several chunks (virtual stages) per worker: the layouts, the chunked planner's plans (valid, dependencies kept,
memory cap in full-stage activations, re-routing after failures), the simulator's chunk costs, torch's own two-chunk
schedules timed by our simulator, the CSV export loaded by torch's runtime, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from recycle.cli import main
from recycle.config import parse_config
from recycle.errors import ConfigError, PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.chunks import chunk_worker, worker_chunks
from recycle.ir.pipelining import pipelining_csv
from recycle.ir.plan import Plan
from recycle.ir.validate import validate_plan
from recycle.planner.api import baseline_1f1b_period, make_plan, plan_for_key
from recycle.planner.chunked import canonical_chunked_routing, chunked_routing, schedule_chunked
from recycle.planner.options import PlannerOptions
from recycle.sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")


def chunked(D: int, S: int, M: int, layout: str = "v", chunks: int = 2, f: float = 1.0, b: float = 1.0,
            w: float = 1.0, opt: float = 0.0):
    return parse_config({"topology": {"num_replicas": D, "num_stages": S, "chunks_per_worker": chunks,
                                      "chunk_layout": layout},
                         "workload": {"num_microbatches": M},
                         "costs": {"forward": f, "backward_input": b, "backward_weight": w, "optimizer": opt}})


# -- layout -----------------------------------------------------------------------------------------------------

def test_interleaved_layout_puts_chunk_v_on_worker_v_mod_s() -> None:
    assert [chunk_worker(v, 4, 2, "interleaved") for v in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert worker_chunks(1, 4, 3, "interleaved") == (1, 5, 9)


def test_v_layout_goes_down_the_workers_and_back_up() -> None:
    assert [chunk_worker(v, 4, 2, "v") for v in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    for w in range(4):
        assert worker_chunks(w, 4, 2, "v") == (w, 7 - w)


def test_one_chunk_is_the_identity() -> None:
    assert [chunk_worker(v, 5, 1, "interleaved") for v in range(5)] == list(range(5))


# -- config errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("topology,match", [
    ({"chunks_per_worker": 0}, r"chunks_per_worker = 0 must be in \[1, 8\].*use 1 for one stage per worker"),
    ({"chunks_per_worker": 9}, r"chunks_per_worker = 9 must be in \[1, 8\]"),
    ({"chunk_layout": "zigzag", "chunks_per_worker": 2}, r"chunk_layout = 'zigzag' is unknown; choose one of "
                                                         r"\['interleaved', 'v'\]"),
    ({"chunk_layout": "v", "chunks_per_worker": 3}, r"'v' needs chunks_per_worker = 2.*but chunks_per_worker = 3; "
                                                    r"set chunks_per_worker = 2"),
    ({"chunk_layout": "v"}, r"'v' needs chunks_per_worker = 2"),
    ({"chunks_per_worker": "2"}, r"chunks_per_worker = '2' must be an integer"),
])
def test_bad_chunk_settings_are_refused_naming_value_rule_and_fix(topology: dict, match: str) -> None:
    raw = {"topology": {"num_replicas": 2, "num_stages": 4, **topology}, "workload": {"num_microbatches": 4},
           "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}}
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_one_chunk_configs_keep_their_fingerprint() -> None:
    """Plan stores are keyed by the fingerprint: the new keys at their defaults must not change it."""
    one = parse_config({"topology": {"num_replicas": 2, "num_stages": 4}, "workload": {"num_microbatches": 4},
                        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}})
    assert "chunks_per_worker" not in one.planning_dict()["topology"]
    assert chunked(2, 4, 4).fingerprint() != one.fingerprint()
    assert chunked(2, 4, 4).one_chunk().fingerprint() == one.fingerprint()


# -- the planner's fault-free chunked schedules ------------------------------------------------------------------

def _check_dependencies_in_time(plan: Plan, config) -> None:
    """In the simulated timeline every action starts after its producer ends (the chain runs over chunks)."""
    result = simulate(plan, config, iterations=1, record=True)
    when = {token: (start, end) for _, _, token, start, end in result.timeline}
    V = plan.num_chunks
    for token, (start, _) in when.items():
        a = Action.parse(token)
        if a.kind is Kind.F and a.stage > 0:
            assert when[f"{a.stage - 1}F{a.mb}"][1] <= start + 1e-9, token
        if a.kind in (Kind.B, Kind.BW):
            if a.stage == V - 1:
                assert when[f"{a.stage}F{a.mb}"][1] <= start + 1e-9, token
            else:
                nxt = f"{a.stage + 1}B{a.mb}" if f"{a.stage + 1}B{a.mb}" in when else f"{a.stage + 1}BW{a.mb}"
                assert when[nxt][1] <= start + 1e-9, token
        if a.kind is Kind.W:
            assert when[f"{a.stage}B{a.mb}"][1] <= start + 1e-9, token


@pytest.mark.parametrize("layout", ["v", "interleaved"])
@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (3, 5)])
def test_fault_free_chunked_plans_are_valid_keep_dependencies_and_the_cap(layout: str, S: int, M: int) -> None:
    config = chunked(2, S, M, layout)
    options = PlannerOptions(staggered=False, memory_cap=(S,) * S)  # ZB-H1's S full-stage activations per worker
    plan = schedule_chunked(config, (), options)
    validate_plan(plan)
    assert plan.chunks == 2 and plan.chunk_layout == layout and len(plan.host) == 2 * S
    for rank, acts in enumerate(plan.actions):
        worker_stage = rank % S
        assert {a.stage for a in acts if a.kind is not Kind.OPT} == set(worker_chunks(worker_stage, S, 2, layout))
    result = simulate(plan, config)
    assert max(result.peak_activations) <= 2 * S  # chunk activations: a chunk's counts 1/2
    assert result.period == plan.meta.predicted_period
    _check_dependencies_in_time(plan, config)


def test_a_chunk_costs_one_over_c_of_its_workers_stage() -> None:
    config = chunked(1, 2, 2, "v", f=2.0, b=3.0, w=1.0)
    plan = schedule_chunked(config, (), PlannerOptions(staggered=False))
    result = simulate(plan, config, iterations=1, record=True)
    spans = {Action.parse(tok).kind: e - s for _, _, tok, s, e in result.timeline if "OPT" not in tok}
    assert spans == {Kind.F: 1.0, Kind.B: 1.5, Kind.W: 0.5}


def test_v_shape_zero_bubble_matches_torchs_zbv_and_beats_one_chunk_zb_h1_at_equal_memory() -> None:
    """Unit F=B=W, S=4, M=8, a cap of S full-stage activations (ZB-H1's and ZBV's peak): ZB-H1 27, ZBV 25.5."""
    from recycle.schedules.fault_free import build_schedule

    config = chunked(1, 4, 8, "v")
    ours = simulate(schedule_chunked(config, (), PlannerOptions(staggered=False, memory_cap=(4,) * 4)), config)
    one = config.one_chunk()
    zb_h1 = simulate(build_schedule(one, "zb-h1"), one)
    assert zb_h1.period == 27.0
    assert ours.period == 25.5 and max(ours.peak_activations) <= 8


def test_interleaved_1f1b_without_decoupling_is_a_fused_backward_plan() -> None:
    config = chunked(1, 4, 8, "interleaved")
    plan = schedule_chunked(config, (), PlannerOptions(decoupled=False, staggered=False, memory_cap=(4,) * 4))
    kinds = {a.kind for acts in plan.actions for a in acts}
    assert kinds == {Kind.F, Kind.BW, Kind.OPT}
    result = simulate(plan, config)
    one = config.one_chunk()
    from recycle.schedules.fault_free import build_schedule

    assert result.period < simulate(build_schedule(one, "1f1b"), one).period  # interleaving shrinks the bubble


def test_an_impossible_cap_is_a_clear_error() -> None:
    config = chunked(1, 4, 8, "v")
    with pytest.raises(PlanError, match="raise --memory-cap"):
        schedule_chunked(config, (), PlannerOptions(staggered=False), caps=(1,) * 4)


# -- re-routing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("failed", [[(1, 2)], [(0, 0), (2, 3)], [(1, 1), (2, 1)]])
@pytest.mark.parametrize("layout", ["v", "interleaved"])
def test_a_dead_workers_chunks_go_to_the_same_chunks_on_its_peers(failed, layout: str) -> None:
    config = chunked(3, 4, 4, layout)
    plan = make_plan(config, failed, PlannerOptions(memory_cap=(6,) * 4))
    validate_plan(plan)
    assert plan.failed == frozenset(failed)
    for p, s in failed:
        assert plan.worker_actions(p, s) == ()
    if plan.meta.routing_fallback:
        # A non-nested set whose canonical routing is faster (tests/unit/test_chunks_after_failures.py): it moves
        # healthy micro-batches and says so.
        assert plan.host == canonical_chunked_routing(config, frozenset(failed))
        assert plan.meta.routing_fallback.startswith("canonical routing: period ")
    else:
        for p, s in failed:
            for v in worker_chunks(s, 4, 2, layout):
                orphans = range(p * 4, (p + 1) * 4)
                hosts = {plan.host[v][mb] for mb in orphans}
                assert all((h, s) not in plan.failed for h in hosts)
                assert len(hosts) == 3 - sum(1 for q, t in failed if t == s)  # dealt over every live peer
        # only the failed workers' micro-batches move
        for v, row in enumerate(plan.host):
            s = plan.chunk_stage(v)
            for mb, h in enumerate(row):
                if (mb // 4, s) not in plan.failed:
                    assert h == mb // 4
    result = simulate(plan, config)
    assert max(result.peak_activations) <= 12
    assert plan.meta.predicted_period == result.period
    assert result.period >= plan.meta.lower_bound - 1e-9


def test_chunked_routing_gives_every_chunk_of_a_worker_its_workers_row() -> None:
    config = chunked(3, 4, 4, "v")
    host = chunked_routing(config, frozenset({(1, 2)}))
    assert host[2] == host[5]  # chunks 2 and 5 both live on stage-2 workers
    assert host[2] != host[1]


def test_plan_for_key_and_the_exact_solver() -> None:
    config = chunked(3, 4, 4, "v")
    plan = plan_for_key(config, (0, 0, 1, 0))
    assert plan.failed == frozenset({(0, 2)}) and plan.chunks == 2
    with pytest.raises(PlanError, match=r"solver 'exact' plans one stage per worker.*use --solver heuristic"):
        plan_for_key(config, (0, 0, 1, 0), solver="exact")


def test_the_1f1b_reference_of_a_chunked_config_is_one_chunk_1f1b() -> None:
    config = chunked(2, 4, 8, "v")
    assert baseline_1f1b_period(config) == baseline_1f1b_period(config.one_chunk())


# -- the plan file, the simulator's checks ------------------------------------------------------------------------

def test_a_chunked_plan_round_trips_through_json_and_one_chunk_json_is_unchanged() -> None:
    config = chunked(2, 3, 3, "v")
    plan = schedule_chunked(config, [(1, 1)], PlannerOptions())
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert '"chunks":2' in plan.to_json() and '"chunk_layout":"v"' in plan.to_json()
    one = make_plan(config.one_chunk(), [(1, 1)])
    assert "chunks" not in one.to_json()


def test_simulating_a_chunked_plan_on_a_one_chunk_config_is_refused() -> None:
    config = chunked(2, 3, 3, "v")
    plan = schedule_chunked(config, (), PlannerOptions())
    with pytest.raises(PlanError, match=r"2 chunk\(s\) per worker \(v layout\) but the config has \[topology\] "
                                        r"chunks_per_worker = 1"):
        simulate(plan, config.one_chunk())


def test_the_validator_refuses_a_chunk_on_the_wrong_worker() -> None:
    config = chunked(1, 2, 1, "v")
    plan = schedule_chunked(config, (), PlannerOptions())
    bad = list(plan.actions)
    bad[0] = tuple(Action(a.kind, 1, a.mb) if a.kind is Kind.F and a.stage == 0 else a for a in bad[0])
    with pytest.raises(PlanError, match=r"only runs its own stage; worker \(0,0\) holds chunks \[0, 3\]"):
        validate_plan(Plan(1, 2, 1, plan.host, tuple(bad), chunks=2, chunk_layout="v"))


# -- torch's own schedules, read without processes -----------------------------------------------------------------

@pytest.mark.parametrize("name,layout", [("zbv", "v"), ("dualpipev", "v"), ("interleaved-zb", "interleaved"),
                                         ("interleaved-1f1b", "interleaved")])
def test_torchs_two_chunk_schedules_become_valid_plans_of_ours(name: str, layout: str) -> None:
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from recycle.schedules.torch_chunks import torch_chunk_plan

    config = chunked(1, 4, 8, layout)
    plan = torch_chunk_plan(config, name)
    assert plan.chunks == 2 and sum(1 for acts in plan.actions for a in acts if a.kind is Kind.F) == 8 * 8
    period = simulate(plan, config).period
    assert period >= 24  # each worker's work: 8 micro-batches x (1 + 1 + 1)
    if name == "zbv":
        assert period == 25.5  # the figure: bubble (S-1)/2


# -- CSV export of a V-shape plan, loaded by torch's runtime -------------------------------------------------------

class _StageStandIn:
    """What _PipelineScheduleRuntime's constructor and CSV loader read from a stage (no process group, no model)."""

    def __init__(self, num_stages: int, stage_index: int, group_size: int) -> None:
        self.num_stages, self.group_size, self.group_rank = num_stages, group_size, 0
        self.stage_index, self.is_first, self.is_last = stage_index, stage_index == 0, stage_index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


@pytest.mark.parametrize("layout", ["v", "interleaved"])
def test_a_chunked_plans_csv_loads_in_torchs_runtime(tmp_path, layout: str) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    S, M = 4, 8
    config = chunked(2, S, M, layout)
    plan = make_plan(config, (), PlannerOptions(memory_cap=(S,) * S))
    path = tmp_path / "plan.csv"
    path.write_text(pipelining_csv(plan, 1))
    mine = worker_chunks(0, S, 2, layout)
    runtime = schedules._PipelineScheduleRuntime([_StageStandIn(2 * S, v, S) for v in mine], M)
    runtime._load_csv(str(path))
    expected = {s: [f"{a.stage}{ {'F': 'F', 'B': 'I', 'W': 'W', 'BW': 'B'}[a.kind.value] }{a.mb - M}".replace(" ", "")
                    for a in plan.worker_actions(1, s) if a.kind is not Kind.OPT] for s in range(S)}
    assert {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order.items()} == expected
    assert runtime.stage_index_to_group_rank == {v: chunk_worker(v, S, 2, layout) for v in range(2 * S)}
    sends = [str(a) for a in runtime.pipeline_order_with_comms[0] if "SEND_F" in str(a)]
    # worker 0 sends chunk 0's output to worker 1 (and, interleaved, chunk S's too); V: its last chunk sends nothing
    assert len(sends) == (M if layout == "v" else 2 * M)
    # torch's own dry run of the lowered compute and send/recv ops (matching, deadlocks) passes; it knows no
    # UNSHARD / RESHARD / REDUCE_GRAD, so those are left out
    kept = {"F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    lowered = {r: [a for a in acts if a.computation_type.value in kept]
               for r, acts in runtime.pipeline_order_with_comms.items()}
    steps = schedules._simulate_comms_compute(lowered, lambda s: runtime.stage_index_to_group_rank[s], 2 * S)
    assert all(sum(1 for a in row if a is not None) == len(lowered[r]) for r, row in steps.items())


def test_the_cli_plans_and_exports_a_v_shape_plan(tmp_path, capsys) -> None:
    path = tmp_path / "v.csv"
    args = ["plan", "--config", TOY, "--set", "topology.chunks_per_worker=2", "--set", 'topology.chunk_layout="v"',
            "--memory-cap", "4", "--json", "--save", str(path), "--format", "pipelining-csv"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert '"chunks_per_worker": 2' in out
    rows = path.read_text().split()
    assert len(rows) == 4 and rows[0].startswith("0F0") and "7F0" in rows[0].split(",")


# -- the runtime refuses what chunks cannot run (tests/unit/test_chunked_runtime.py has the rest) -----------------

def test_recycle_train_refuses_chunks_with_a_model_factory_in_one_error_line(capsys) -> None:
    code = main(["train", "--config", str(ROOT / "configs" / "tiny-gpt.toml"), "--set",
                 "topology.chunks_per_worker=2", "--model-factory", "pkg.mod:stages", "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert "chunks_per_worker = 2 (several model chunks per worker) cannot run with --model-factory" in err[0]
    assert "set chunks_per_worker = 1" in err[0]


def test_recycle_schedule_points_chunked_configs_to_the_planner(capsys) -> None:
    code = main(["schedule", "--config", TOY, "--set", "topology.chunks_per_worker=2", "--schedule", "zb-h1"])
    assert code == 2
    assert "come from the planner: `recycle plan" in capsys.readouterr().err


def test_a_canonical_chunked_plan_maps_onto_real_ranks_of_a_non_nested_failure_set() -> None:
    """What a plan store does: the key's canonical plan relabelled per stage (chunk rows with their worker's stage)."""
    from recycle.planner.failures import normalize

    config = chunked(3, 3, 3, "v")
    state = normalize([(0, 0), (2, 1)], 3, 3)
    assert not state.symmetric
    real = state.to_real(plan_for_key(config, state.key, PlannerOptions()))
    validate_plan(real)
    assert real.failed == frozenset({(0, 0), (2, 1)})
    assert simulate(real, config).period == plan_for_key(config, state.key, PlannerOptions()).meta.predicted_period


def test_reserving_rules_never_deadlock_where_a_greedy_rule_does() -> None:
    """D=4, S=4, M=8, 1:1 and 2:0 down, cap 8 chunk activations: the greedy alternating rule fills survivors with
    shallow chunks and deadlocks; the same rule with reserve admits micro-batches only with room on their whole path."""
    from recycle.planner.chunked import ChunkVariant, list_schedule_chunked

    config = chunked(4, 4, 8, "v")
    failed = frozenset({(1, 1), (2, 0)})
    host = chunked_routing(config, failed)
    greedy = ChunkVariant("mb", "ready", alternate=True)
    with pytest.raises(PlanError, match="could not place every action"):
        list_schedule_chunked(config, failed, host, True, False, (8,) * 4, greedy)
    plan = list_schedule_chunked(config, failed, host, True, False, (8,) * 4,
                                 ChunkVariant("mb", "ready", alternate=True, reserve=True))
    validate_plan(plan)
    assert max(simulate(plan, config).peak_activations) <= 8


def test_a_cap_below_one_microbatchs_chunks_is_refused_by_the_reserving_rule() -> None:
    from recycle.planner.chunked import ChunkVariant, list_schedule_chunked

    config = chunked(1, 3, 3, "v")
    with pytest.raises(PlanError, match=r"runs 2 chunks on worker 0:\d, more than its cap of 1 chunk activations; "
                                        r"raise --memory-cap"):
        list_schedule_chunked(config, frozenset(), chunked_routing(config, frozenset()), True, False, (1,) * 3,
                              ChunkVariant(reserve=True))


@pytest.mark.parametrize("S,M,costs", [(4, 8, (1.0, 1.0, 1.0)), (5, 10, (1.0, 1.0, 1.0)), (3, 6, (2.0, 3.0, 1.0)),
                                       (6, 12, (2.0, 3.0, 1.0))])
def test_ours_is_at_least_as_fast_as_torchs_best_two_chunk_schedule_at_its_peak(S: int, M: int, costs) -> None:
    """benchmarks/bench_chunks.py's claim on a few shapes: same simulator, our cap = torch's best schedule's peak."""
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from recycle.schedules.torch_chunks import TORCH_CHUNK_SCHEDULES, torch_chunk_plan

    f, b, w = costs
    best = None
    for name, (_, layout) in TORCH_CHUNK_SCHEDULES.items():
        config = chunked(1, S, M, layout, f=f, b=b, w=w)
        result = simulate(torch_chunk_plan(config, name), config)
        best = min(best or (result.period, max(result.peak_activations)), (result.period, max(result.peak_activations)))
    period, peak = best
    ours = min(simulate(schedule_chunked(cfg, (), PlannerOptions(staggered=False), caps=(peak,) * S), cfg).period
               for cfg in (chunked(1, S, M, layout, f=f, b=b, w=w) for layout in ("v", "interleaved")))
    assert ours <= period


def test_rotated_routing_sends_a_microbatchs_two_chunks_to_different_peers() -> None:
    config = chunked(3, 4, 4, "v")
    failed = frozenset({(1, 2)})
    same, rotated = chunked_routing(config, failed), chunked_routing(config, failed, rotate=True)
    orphans = range(4, 8)
    assert all(same[2][mb] == same[5][mb] for mb in orphans)
    assert all(rotated[2][mb] != rotated[5][mb] for mb in orphans)
    assert sorted(rotated[5][mb] for mb in orphans) == sorted(same[5][mb] for mb in orphans)  # same loads
    assert rotated[2] == same[2] and all(rotated[5][mb] == mb // 4 for mb in range(12) if mb // 4 != 1)


def test_recycle_train_refuses_a_chunked_plan_file(tmp_path, capsys) -> None:
    path = tmp_path / "v.json"
    assert main(["plan", "--config", TOY, "--set", "topology.chunks_per_worker=2", "--set",
                 'topology.chunk_layout="v"', "--save", str(path)]) == 0
    capsys.readouterr()
    code = main(["train", "--config", str(ROOT / "configs" / "tiny-gpt.toml"), "--plan", str(path), "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the plan has 2 chunks per worker (v layout)" in err[0]
    assert "but the config has [topology] chunks_per_worker = 1; make the plan from this config" in err[0]


@pytest.mark.parametrize("S,M", [(3, 6), (4, 8), (6, 12)])
def test_interleaved_1f1b_matches_torchs_at_its_peak(S: int, M: int) -> None:
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from recycle.schedules.torch_chunks import torch_chunk_plan

    config = chunked(1, S, M, "interleaved", f=2.0, b=3.0, w=1.0)
    theirs = simulate(torch_chunk_plan(config, "interleaved-1f1b"), config)
    peak = max(theirs.peak_activations)
    ours = simulate(schedule_chunked(config, (), PlannerOptions(decoupled=False, staggered=False), caps=(peak,) * S),
                    config)
    assert ours.period <= theirs.period and max(ours.peak_activations) <= peak
