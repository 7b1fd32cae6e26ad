"""Micro-batches split into pieces: the global-token loss rule (a piece's gradients are its share of the whole
micro-batch's), the IR field that carries pieces, their validation, costs and data."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recycle.ir.pieces import Piece, loss_weight
from recycle.models.gpt import full_model
from recycle.runtime.worker.data import data_source


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_whole_microbatch_weight_is_bitwise_one_over_the_global_count() -> None:
    for m in (1, 2, 3, 4, 7, 8):
        for total in (1, 3, 6, 12, 35, 1000):
            assert loss_weight(m, m, total) == 1.0 / total


@pytest.mark.parametrize("cuts", [(0, 1, 4), (0, 2, 4), (0, 1, 2, 4), (0, 3, 4)])
def test_gradients_of_the_pieces_sum_to_the_whole_microbatch(tiny_config, cuts: tuple[int, ...]) -> None:
    config = tiny_config(D=2, M=3)
    config = replace(config, workload=replace(config.workload, microbatch_size=4))
    m, total = 4, config.num_replicas * config.num_microbatches
    model = full_model(config.model, config.workload.seq_len, config.training.seed, "float64")
    tokens, targets = data_source(config)(1, 4)
    assert tokens.shape[0] == m
    whole = _grads(model, model(tokens, targets) * loss_weight(m, m, total))
    summed: dict[str, torch.Tensor] = {}
    for start, stop in zip(cuts, cuts[1:]):
        piece = Piece(4, start, stop)
        loss = model(tokens[start:stop], targets[start:stop]) * loss_weight(piece.samples, m, total)
        for name, grad in _grads(model, loss).items():
            summed[name] = summed[name] + grad if name in summed else grad
    assert summed.keys() == whole.keys()
    worst = max(float((summed[k] - whole[k]).abs().max()) for k in whole)
    assert worst <= 1e-12
    # the pieces' own gradients differ from the whole one's: the sum is what makes them equal (the test can fail)
    single = _grads(model, model(tokens[:cuts[1]], targets[:cuts[1]]) * loss_weight(cuts[1], m, total))
    assert max(float((single[k] - whole[k]).abs().max()) for k in whole) > 1e-6


# -- the IR: pieces in a plan ------------------------------------------------------------------------------------

from recycle.errors import PlanError  # noqa: E402
from recycle.ir import Action, Plan, validate_plan  # noqa: E402
from recycle.ir.pieces import make_pieces  # noqa: E402
from recycle.ir.worker_view import PlanViews, read_worker_view  # noqa: E402
from recycle.runtime.worker.emulate import action_cost  # noqa: E402
from recycle.runtime.worker.pieces import load_piece, piece_shape  # noqa: E402
from recycle.sim.simulator import simulate  # noqa: E402


def _one_worker_plan(pieces: tuple[Piece, ...] = (), size: int = 0) -> Plan:
    """D = S = M = 1: micro-batch 0, whole or as pieces (ids 0 and 1)."""
    ids = len(pieces) or 1
    tokens = [f"0F{mb} 0BW{mb}" for mb in range(ids)]
    return Plan.from_worker_lists(1, 1, 1, [[Action.parse(t) for t in " ".join(tokens + ["0OPT"]).split()]],
                                  pieces=pieces, microbatch_size=size)


def test_make_pieces_keeps_ids_and_appends_the_extra_pieces() -> None:
    pieces = make_pieces(4, 6, {1: [2, 4], 3: [1, 2, 3]})
    assert [p.to_list() for p in pieces] == [[0, 0, 6], [1, 0, 2], [2, 0, 6], [3, 0, 1], [1, 2, 6], [3, 1, 3],
                                             [3, 3, 6]]


def test_a_split_plan_round_trips_through_json_and_an_unsplit_one_has_no_new_fields() -> None:
    whole = validate_plan(_one_worker_plan())
    assert "pieces" not in whole.to_json() and "microbatch_size" not in whole.to_json()
    assert Plan.from_json(whole.to_json()).to_json() == whole.to_json()
    split = validate_plan(_one_worker_plan(make_pieces(1, 2, {0: [1, 1]}), 2))
    text = split.to_json()
    assert '"microbatch_size":2,"pieces":[[0,0,1],[0,1,2]]' in text
    back = Plan.from_json(text)
    assert back == split and back.to_json() == text
    assert back.num_microbatch_ids == 2 and back.owner(1) == 0 and back.source(1) == 0
    assert back.work_fraction(1) == 0.5 and back.loss_weight(1) == 0.5


@pytest.mark.parametrize("pieces,size,words", [
    ([[0, 0, 1], [0, 2, 2]], 2, "empty piece"),
    ([[0, 0, 1], [0, 1, 1]], 2, "empty piece"),
    ([[0, 0, 1]], 2, "end at sample 1, not 2"),
    ([[0, 0, 2], [0, 1, 2]], 2, "overlaps"),
    ([[0, 1, 2], [0, 1, 2]], 2, "leaves samples [0, 1) out"),
    ([[0, 0, 1], [1, 1, 2]], 2, "outside [0, 1)"),
    ([[0, 0, 1], [0, 1, 2]], 0, "microbatch_size"),
    ([[0, 0, 1], [0, 1, 2]], 3, "end at sample 2, not 3"),
    ([[0, 0, "1"]], 2, "[source, start, stop]"),
])
def test_bad_pieces_are_refused_with_the_rule(pieces, size, words: str) -> None:
    d = _one_worker_plan(make_pieces(1, 2, {0: [1, 1]}), 2).to_dict()
    d["pieces"], d["microbatch_size"] = pieces, size
    with pytest.raises(PlanError, match=r"pieces|microbatch_size") as err:
        Plan.from_dict(d)
    assert words in str(err.value)


def test_the_first_ids_must_be_their_own_microbatch() -> None:
    with pytest.raises(PlanError, match="ids below 2 are"):
        Plan.from_dict({**_one_worker_plan().to_dict(), "num_replicas": 2,
                        "pieces": [[1, 0, 2], [0, 0, 2]], "microbatch_size": 2})


def test_a_piece_costs_its_share_in_the_simulator_and_in_emulated_pacing(tiny_config) -> None:
    config = tiny_config(D=1, S=1, M=1)
    split = _one_worker_plan(make_pieces(1, 4, {0: [1, 3]}), 4)
    timeline = simulate(split, config, iterations=1, record=True).timeline
    durations = {token: end - start for _, _, token, start, end in timeline}
    whole = {token: end - start for _, _, token, start, end in
             simulate(_one_worker_plan(), config, iterations=1, record=True).timeline}
    assert durations["0F0"] == 0.25 * whole["0F0"] and durations["0F1"] == 0.75 * whole["0F0"]
    assert durations["0BW1"] == 0.75 * whole["0BW0"]
    assert action_cost(config, split, Action.parse("0BW0")) == 0.25 * action_cost(config, _one_worker_plan(),
                                                                                  Action.parse("0BW0"))


def test_a_worker_view_keeps_the_pieces() -> None:
    split = validate_plan(_one_worker_plan(make_pieces(1, 2, {0: [1, 1]}), 2))
    view = read_worker_view(PlanViews(split).json_for(0), 0)
    assert view == split


def test_a_piece_loads_its_samples_and_receives_its_share_of_the_shape(tiny_config) -> None:
    config = tiny_config(D=1, S=1, M=1)
    config = replace(config, workload=replace(config.workload, microbatch_size=4))
    load = data_source(config)
    split = _one_worker_plan(make_pieces(1, 4, {0: [1, 3]}), 4)
    tokens, targets = load(0, 0)
    got, want = load_piece(load, split, 0, 1), (tokens[1:], targets[1:])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert piece_shape(split, 1, (4, 8, 16)) == (3, 8, 16) and piece_shape(split, 0, (4, 8, 16)) == (1, 8, 16)
    with pytest.raises(RuntimeError, match="first dimension"):
        piece_shape(split, 1, (8, 4))
    with pytest.raises(RuntimeError, match="splits micro-batches of 4 samples"):
        load_piece(lambda it, mb: (tokens[:2], targets[:2]), split, 0, 1)


# -- the planner chooses the split ---------------------------------------------------------------------------------

from recycle.config import parse_config  # noqa: E402
from recycle.planner.api import make_plan  # noqa: E402
from recycle.planner.options import PlannerOptions  # noqa: E402
from recycle.planner.split import plan_cuts  # noqa: E402

SPLIT = PlannerOptions(split_microbatches=True)


def _config(D: int, S: int, M: int, samples: int = 6, costs: tuple = (1, 1, 1)):
    return parse_config({"topology": {"num_replicas": D, "num_stages": S},
                         "workload": {"num_microbatches": M, "microbatch_size": samples, "seq_len": 8},
                         "costs": {"forward": costs[0], "backward_input": costs[1], "backward_weight": costs[2],
                                   "optimizer": 1},
                         "model": {"preset": "tiny"}}, name="split")


def _samples_per_survivor(plan: Plan, stage: int) -> dict[int, int]:
    carried = {p: 0 for p in plan.live_replicas(stage)}
    for mb, replica in enumerate(plan.host[stage]):
        carried[replica] += plan.pieces[mb].samples if plan.pieces else plan.microbatch_size
    return carried


def test_the_planner_splits_where_whole_microbatches_cannot_be_shared_evenly_and_it_is_faster() -> None:
    config = _config(4, 3, 4)  # 4 orphans over 3 survivors: 2 + 1 + 1 whole
    whole = make_plan(config, {(0, 0)})
    split = make_plan(config, {(0, 0)}, SPLIT)
    assert not whole.pieces and split.pieces
    assert split.meta.predicted_period < whole.meta.predicted_period
    carried = _samples_per_survivor(split, 0)
    assert max(carried.values()) - min(carried.values()) <= 1  # equal shares (to the sample) of 16 x 6 samples
    assert sum(carried.values()) == 16 * 6
    assert "split micro-batches: period" in split.meta.notes
    # the whole-micro-batch bound does not hold for the split plan; the bound for pieces does
    assert split.meta.predicted_period < whole.meta.lower_bound
    assert split.meta.lower_bound is not None and split.meta.lower_bound <= split.meta.predicted_period
    validate_plan(split)
    assert Plan.from_json(split.to_json()) == split
    # the simulator agrees with the meta: the split plan's own period
    assert simulate(split, config).period <= split.meta.predicted_period + 1e-9


@pytest.mark.parametrize("failed", [{(0, 1), (1, 0)}, {(1, 1)}, {(0, 2), (2, 2)}])
def test_split_plans_of_other_failure_sets_are_valid_and_never_slower(failed) -> None:
    config = _config(5, 3, 5, costs=(2, 3, 1))
    whole = make_plan(config, failed)
    split = make_plan(config, failed, SPLIT)
    assert split.meta.predicted_period <= whole.meta.predicted_period
    assert split.failed == frozenset(failed)
    validate_plan(split)
    assert "split micro-batches" in split.meta.notes


def test_no_split_where_survivors_already_carry_equal_shares_or_a_microbatch_has_one_sample() -> None:
    even = make_plan(_config(3, 4, 6), {(1, 2)}, SPLIT)  # 6 orphans over 2 survivors
    assert not even.pieces and "already carry equal shares" in even.meta.notes
    single = make_plan(_config(4, 3, 4, samples=1), {(0, 0)}, SPLIT)
    assert not single.pieces and "holds 1 sample" in single.meta.notes
    assert not make_plan(_config(4, 3, 4), {(0, 0)}).pieces  # off by default


def test_cuts_give_each_survivor_its_equal_share() -> None:
    config = _config(4, 4, 8)  # 8 orphans over 3 survivors: 3 + 3 + 2 whole, 8/3 each when cut
    whole = make_plan(config, {(1, 2)})
    cuts = plan_cuts(whole, 6)
    assert len(cuts) == 2 and all(c.stage == 2 for c in cuts)
    assert all(sum(n for _, n in c.shares) == 6 for c in cuts)
    split = make_plan(config, {(1, 2)}, SPLIT)
    assert split.pieces and split.meta.predicted_period < whole.meta.predicted_period
    carried = _samples_per_survivor(split, 2)
    assert max(carried.values()) - min(carried.values()) <= 1


# -- lower bounds for the finer unit ------------------------------------------------------------------------------

from recycle.planner.bounds import period_lower_bound  # noqa: E402
from recycle.planner.partition import partition_bound  # noqa: E402


@pytest.mark.parametrize("D,S,M,failed,costs", [
    (4, 3, 4, {(0, 0)}, (1, 1, 1)), (4, 2, 4, {(0, 1)}, (1, 1, 1)), (5, 3, 5, {(0, 1)}, (2, 3, 1)),
    (4, 4, 8, {(1, 2)}, (2, 3, 1)), (6, 3, 4, {(0, 1), (1, 0)}, (1, 1, 1)), (3, 2, 3, {(0, 0)}, (2, 3, 1)),
])
def test_the_bound_for_pieces_holds_for_split_plans_and_is_no_higher_than_the_whole_bound(D, S, M, failed,
                                                                                          costs) -> None:
    config = _config(D, S, M, costs=costs)
    whole = make_plan(config, failed)
    split = make_plan(config, failed, SPLIT)
    key = whole.meta.failure_key
    bound = period_lower_bound(config, key, SPLIT)
    assert bound <= period_lower_bound(config, key, PlannerOptions()) + 1e-9
    assert simulate(split, config).period >= bound * (1 - 1e-9)
    assert split.meta.lower_bound is None or split.meta.lower_bound <= split.meta.predicted_period


def test_the_whole_bound_is_unchanged_bit_for_bit_without_the_option() -> None:
    config = _config(4, 3, 4, samples=1)  # one sample per micro-batch: the finer unit is the micro-batch
    for key in [(1, 0, 0), (0, 2, 0), (1, 1, 1)]:
        assert period_lower_bound(config, key, SPLIT) == period_lower_bound(config, key, PlannerOptions())
    six = _config(4, 3, 4, samples=6)
    assert period_lower_bound(six, (1, 0, 0), SPLIT) < period_lower_bound(six, (1, 0, 0), PlannerOptions())


def test_partition_bound_for_the_finer_unit_is_no_higher() -> None:
    config = parse_config({"topology": {"num_replicas": 4, "num_stages": 2},
                           "workload": {"num_microbatches": 4, "microbatch_size": 6, "seq_len": 8},
                           "costs": {"forward": 2, "backward_input": 2, "backward_weight": 2, "optimizer": 1},
                           "model": {"preset": "tiny", "n_layer": 4}}, name="split-partition")
    whole = partition_bound(config, (1, 0))
    split = partition_bound(config, (1, 0), SPLIT)
    assert split.bound < whole.bound  # 4 x 4 micro-batches over 3 survivors: 6 whole on one, 5.33 each when cut


def test_a_plan_store_keeps_split_plans_and_its_option(tmp_path) -> None:
    from recycle.planner.store import PlanStore, build_store

    config = _config(4, 3, 4)
    build_store(config, 1, tmp_path / "store", SPLIT)
    store = PlanStore.load(tmp_path / "store", config)
    assert store.options.split_microbatches
    plan = store.lookup({(2, 0)})
    assert plan.pieces and plan.failed == frozenset({(2, 0)})
    validate_plan(plan)
    assert all(plan.owner(mb) != 2 or plan.host[0][mb] != 2 for mb in range(plan.num_microbatch_ids))
    whole = tmp_path / "whole"
    build_store(config, 1, whole, PlannerOptions())
    assert "split_microbatches" not in (whole / "index.json").read_text()  # old stores' bytes unchanged


def test_a_piece_holds_its_share_of_an_activation_slot_in_the_cap_check() -> None:
    from recycle.planner.split import held_samples_peaks, within_cap

    config = _config(4, 3, 4)  # micro-batches of 6 samples
    whole = make_plan(config, {(0, 0)})
    split = make_plan(config, {(0, 0)}, SPLIT)
    assert split.pieces
    whole_sim, split_sim = simulate(whole, config), simulate(split, config)
    # Whole micro-batches: the simulator's slot count, in samples (1 a micro-batch when no size is set).
    assert held_samples_peaks(whole) == whole_sim.peak_activations
    samples = held_samples_peaks(split)
    # A piece counts its samples, never more than a whole slot: at most 6 x the simulator's count, below it where
    # a worker holds a piece (the survivors that took pieces of the cut micro-batch).
    assert all(n <= 6 * peak for n, peak in zip(samples, split_sim.peak_activations))
    assert any(n < 6 * peak for n, peak in zip(samples, split_sim.peak_activations))
    # The cap check takes micro-batches' worth: the busiest stage's ceil(samples / 6) passes, one less does not.
    caps = [max(-(-samples[r] // 6) for r in split.live_ranks() if split.worker(r)[1] == s) for s in range(3)]
    assert within_cap(split, caps)
    busiest = max(split.live_ranks(), key=lambda r: samples[r])
    tighter = list(caps)
    tighter[split.worker(busiest)[1]] -= 1
    assert not within_cap(split, tighter)
