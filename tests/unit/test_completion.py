"""ir.completion: finishing an interrupted iteration from what the survivors kept, checked by playing every kill
moment of a plan symbolically: each weight-gradient is summed exactly once, each loss counted once, every step's
input is there when it runs, and the steps never wait on each other."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import pytest

from recycle.config import parse_config
from recycle.errors import PlanError
from recycle.ir import Kind, Plan
from recycle.ir.completion import (SEND_ACTIVATION, SEND_GRADIENT, Completion, CompletionViews, WorkerProgress,
                                   complete_iteration)
from recycle.schedules.fault_free import build_schedule

K = 1  # the interrupted iteration


@functools.lru_cache(maxsize=None)
def plan_for(D: int, S: int, M: int, schedule: str = "zb-h1", staggered: bool = True) -> Plan:
    config = parse_config({"topology": {"num_replicas": D, "num_stages": S},
                           "workload": {"num_microbatches": M, "microbatch_size": 1, "seq_len": 4},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                           "model": {"preset": "tiny"}}, name=f"completion-{D}x{S}")
    return build_schedule(config, schedule, staggered=staggered)


def rerouted(old: Plan, dead: set[int]) -> Plan:
    """A plan for the next generation: every dead worker's micro-batches go round-robin to its stage's survivors."""
    failed = frozenset(old.worker(r) for r in dead) | old.failed
    host = [list(row) for row in old.host]
    for stage in range(old.num_stages):
        live = [p for p in range(old.num_replicas) if (p, stage) not in failed]
        turn = 0
        for mb, replica in enumerate(host[stage]):
            if (replica, stage) in failed:
                host[stage][mb] = live[turn % len(live)]
                turn += 1
    return replace(old, host=tuple(tuple(r) for r in host), failed=failed)


def timeline(plan: Plan) -> dict[int, list[int]]:
    """Each rank's action finish ticks in a unit-time run of one iteration (staggered or coupled optimizer)."""
    done: dict[tuple[Kind, int, int], int] = {}
    finish: dict[int, list[int]] = {r: [] for r in plan.live_ranks()}
    position = {r: 0 for r in plan.live_ranks()}
    tick = 0
    while any(position[r] < len(plan.actions[r]) for r in position):
        tick += 1
        ran = []
        for r, i in position.items():
            if i >= len(plan.actions[r]):
                continue
            a = plan.actions[r][i]
            stage = a.stage
            if a.kind is Kind.F:
                ready = stage == 0 or (Kind.F, stage - 1, a.mb) in done
            elif a.kind in (Kind.B, Kind.BW):
                ready = stage == plan.num_stages - 1 or (Kind.B, stage + 1, a.mb) in done
            elif a.kind is Kind.W:
                ready = True
            else:  # the all-reduce: every replica of the stage (every worker, when the step is coupled) at its OPT
                ready = all(position[q] == len(plan.actions[q]) - 1 for q in position
                            if not plan.staggered or plan.worker(q)[1] == stage)
            if ready:
                ran.append((r, a))
        assert ran, "the plan deadlocks"
        for r, a in ran:
            kind = Kind.B if a.kind is Kind.BW else a.kind
            done[(kind, a.stage, a.mb)] = tick
            position[r] += 1
            finish[r].append(tick)
    return finish


@dataclass
class _Rank:
    graph: set[int] = field(default_factory=set)
    grad_out: set[int] = field(default_factory=set)
    weighed: set[int] = field(default_factory=set)
    losses: set[int] = field(default_factory=set)
    sent: set[tuple[str, int]] = field(default_factory=set)
    inbox: set[tuple[str, int]] = field(default_factory=set)
    stepped: bool = False


def survivors_state(plan: Plan, finished: dict[int, int], iteration_done: set[int]) -> dict[int, _Rank]:
    state = {}
    for r, count in finished.items():
        s = _Rank()
        acts = plan.actions[r] if r in iteration_done else plan.actions[r][:count]
        for a in acts:
            if a.kind is Kind.F:
                s.graph.add(a.mb)
                if a.stage == plan.num_stages - 1:
                    s.losses.add(a.mb)
                s.sent.add(("A", a.mb))
            elif a.kind is Kind.B:
                s.grad_out.add(a.mb)
                s.sent.add(("G", a.mb))
            elif a.kind is Kind.W:
                s.weighed.add(a.mb)
                s.graph.discard(a.mb)
                s.grad_out.discard(a.mb)
            elif a.kind is Kind.BW:
                s.weighed.add(a.mb)
                s.graph.discard(a.mb)
                s.sent.add(("G", a.mb))
            else:
                s.stepped = True
        state[r] = s
    return state


def play(plan: Plan, completion: Completion, state: dict[int, _Rank]) -> None:
    """Run the completion's steps rank by rank as the runtime does (a receive blocks until its sender sent) and
    check what every step needs and what the iteration ends with."""
    S = plan.num_stages
    position = {r: 0 for r in state}
    channel: set[tuple[str, int, int, int]] = set()  # (kind, mb, src, dst) sent and not yet taken
    progress = True
    while progress:
        progress = False
        for r, s in state.items():
            steps = completion.steps[r]
            while position[r] < len(steps):
                step = steps[position[r]]
                if step.src >= 0:
                    key = ("A" if step.kind == "F" else "G", step.mb, step.src, r)
                    if key not in channel:
                        break  # blocked on its receive
                    channel.discard(key)
                if step.kind in (SEND_ACTIVATION, SEND_GRADIENT):
                    tag = "A" if step.kind == SEND_ACTIVATION else "G"
                    assert (tag, step.mb) in s.sent, f"rank {r} re-sends {step} it never sent"
                    channel.add((tag, step.mb, r, step.dst))
                elif step.kind == "F":
                    assert step.mb not in s.graph, f"rank {r} runs {step} again over a live graph"
                    assert step.stage == 0 or step.src >= 0
                    s.graph.add(step.mb)
                    if step.stage == S - 1:
                        s.losses.add(step.mb)
                    if step.dst >= 0:
                        channel.add(("A", step.mb, r, step.dst))
                elif step.kind == "B":
                    assert step.mb in s.graph, f"rank {r} runs {step} without its forward"
                    assert step.stage == S - 1 or step.src >= 0
                    s.grad_out.add(step.mb)
                    if step.dst >= 0:
                        channel.add(("G", step.mb, r, step.dst))
                elif step.kind == "W":
                    assert step.mb in s.graph and step.mb in s.grad_out, f"rank {r}: {step} lacks its inputs"
                    assert step.mb not in s.weighed, f"rank {r} sums micro-batch {step.mb}'s gradient twice"
                    s.weighed.add(step.mb)
                    s.graph.discard(step.mb)
                else:
                    assert not s.stepped, f"rank {r} steps twice"
                    s.stepped = True
                position[r] += 1
                progress = True
    stuck = {r: completion.steps[r][position[r]] for r in state if position[r] < len(completion.steps[r])}
    assert not stuck, f"the completion deadlocks: {stuck}"
    assert not channel, f"messages nobody took: {sorted(channel)}"
    for stage in range(S):
        ranks = [r for r in state if plan.worker(r)[1] == stage]
        assert all(state[r].stepped for r in ranks), f"stage {stage} did not step"
        if stage in completion.applied_stages:
            continue
        weighed = [mb for r in ranks for mb in state[r].weighed]
        assert sorted(weighed) == list(range(plan.total_microbatches)), (stage, sorted(weighed))
    last = [mb for r in state if plan.worker(r)[1] == S - 1 for mb in state[r].losses]
    if S - 1 not in completion.applied_stages:
        assert sorted(last) == list(range(plan.total_microbatches)), sorted(last)


def kill_moments(plan: Plan):
    """(dead rank, tick): every worker killed after each tick of the iteration."""
    finish = timeline(plan)
    end = max(t for ticks in finish.values() for t in ticks)
    for dead in plan.live_ranks():
        for tick in range(0, end + 1):
            yield dead, tick, finish


def progress_at(plan: Plan, dead: int, tick: int, finish: dict[int, list[int]]):
    """The survivors' stop reports when `dead` dies after `tick`: each has finished what ended by then. A stage whose
    survivors all stepped counts as being in the next iteration with nothing of it kept."""
    progress, done = {}, set()
    for r, ticks in finish.items():
        if r == dead:
            continue
        count = sum(1 for t in ticks if t <= tick)
        if count == len(ticks):
            done.add(r)
            progress[r] = WorkerProgress(r, K, K + 1, 0)
        else:
            progress[r] = WorkerProgress(r, K - 1, K, count)
    return progress, done


SHAPES = [(2, 2, 2, "zb-h1", True), (2, 2, 4, "1f1b", True), (3, 3, 3, "zb-h1", True), (4, 2, 4, "zb-h1", True),
          (2, 4, 4, "zb-h1", True), (3, 2, 3, "1f1b", False)]


@pytest.mark.parametrize("D,S,M,schedule,staggered", SHAPES)
def test_every_kill_moment_is_finished_exactly(D: int, S: int, M: int, schedule: str, staggered: bool) -> None:
    plan = plan_for(D, S, M, schedule, staggered)
    kept = fell_back = 0
    for dead, tick, finish in kill_moments(plan):
        progress, done = progress_at(plan, dead, tick, finish)
        completion = complete_iteration(plan, rerouted(plan, {dead}), K, progress, collective_step=not staggered)
        if isinstance(completion, str):
            fell_back += 1
            continue
        kept += 1
        state = survivors_state(plan, {r: p.finished for r, p in progress.items()}, done)
        play(plan, completion, state)
        share = len(plan.actions[dead])
        assert completion.redone_actions <= 2 * share, (dead, tick, completion.redone_actions, share)
        if plan.worker(dead)[1] not in completion.applied_stages:  # an upper bound on what the dead worker lost
            assert completion.lost_actions >= sum(1 for t in finish[dead] if t <= tick), (dead, tick)
        assert Completion.from_json(completion.to_json(), plan) == completion
    assert kept > fell_back, (kept, fell_back)


def test_two_dead_workers_in_adjacent_stages_of_one_pipeline() -> None:
    plan = plan_for(3, 3, 3)
    finish = timeline(plan)
    dead = {plan.rank(1, 0), plan.rank(1, 1)}
    for tick in range(0, max(max(t) for t in finish.values()) + 1):
        progress = {r: WorkerProgress(r, K - 1, K, sum(1 for t in ticks if t <= tick))
                    for r, ticks in finish.items() if r not in dead}
        if any(p.finished == len(plan.actions[p.rank]) for p in progress.values()):
            break  # some stage stepped: covered above
        completion = complete_iteration(plan, rerouted(plan, dead), K, progress)
        if isinstance(completion, str):
            continue
        play(plan, completion, survivors_state(plan, {r: p.finished for r, p in progress.items()}, set()))


def test_a_bw_whose_send_failed_keeps_its_weight_gradient_and_recomputes_the_rest() -> None:
    plan = plan_for(2, 2, 2, "1f1b")
    dead = plan.rank(1, 0)
    survivor = plan.rank(1, 1)  # its first BW of iteration K sends to the dead worker: the send fails
    index = next(i for i, a in enumerate(plan.actions[survivor]) if a.kind is Kind.BW)
    finish = timeline(plan)
    tick = finish[survivor][index]
    progress, _ = progress_at(plan, dead, tick - 1, finish)
    progress[survivor] = WorkerProgress(survivor, K - 1, K, index, weighed_current=True)
    completion = complete_iteration(plan, rerouted(plan, {dead}), K, progress)
    assert not isinstance(completion, str), completion
    state = survivors_state(plan, {r: p.finished for r, p in progress.items()}, set())
    mb = plan.actions[survivor][index].mb
    state[survivor].weighed.add(mb)
    state[survivor].graph.discard(mb)
    play(plan, completion, state)
    assert all(s.kind != "W" or s.mb != mb for s in completion.steps[survivor])


@pytest.mark.parametrize("why,change", [
    ("disagree", lambda p: {**p, 1: replace(p[1], applied=K, iteration=K + 1, finished=0)}),
    ("no surviving replica", lambda p: {r: v for r, v in p.items() if r != 0}),
    ("had finished any work", lambda p: {r: replace(v, finished=0) for r, v in p.items()}),
])
def test_cases_it_cannot_finish_exactly_say_why(why: str, change) -> None:
    plan = plan_for(2, 2, 2)
    dead = plan.rank(1, 0)
    progress = {r: WorkerProgress(r, K - 1, K, 2) for r in plan.live_ranks() if r != dead}
    reason = complete_iteration(plan, rerouted(plan, {dead}), K, change(progress))
    assert isinstance(reason, str) and why in reason, reason


def test_a_coupled_optimizer_step_never_lets_one_stage_keep_its_step() -> None:
    plan = plan_for(2, 2, 2)
    dead = plan.rank(1, 0)
    progress = {r: WorkerProgress(r, K - 1, K, 3) for r in plan.live_ranks() if r != dead}
    progress[1] = WorkerProgress(1, K, K + 1, 0)
    progress[3] = WorkerProgress(3, K, K + 1, 0)
    assert "waits for every stage" in complete_iteration(plan, rerouted(plan, {dead}), K, progress,
                                                         collective_step=True)
    assert "tied" in complete_iteration(plan, rerouted(plan, {dead}), K, progress, tied=True)


@pytest.mark.parametrize("text", ["[]", '{"iteration": 1}', '{"iteration": 1, "redone_actions": 0, "lost_actions": 0,'
                                  ' "rerouted_actions": 0, "resent": 0, "applied_stages": [], "steps": [[], [], [],'
                                  ' [["X", 0, 0, -1, -1]]]}'])
def test_a_malformed_completion_is_refused_with_one_clear_error(text: str) -> None:
    with pytest.raises(PlanError, match="completion of an interrupted iteration is malformed"):
        Completion.from_json(text, plan_for(2, 2, 2))


def test_each_workers_view_of_a_completion_holds_its_steps_and_its_senders() -> None:
    plan = plan_for(3, 3, 3)
    dead = plan.rank(1, 1)
    new_plan = rerouted(plan, {dead})
    finished = {r: len(plan.actions[r]) // 2 for r in plan.live_ranks() if r != dead}
    progress = {r: WorkerProgress(r, -1, 0, n) for r, n in finished.items()}
    completion = complete_iteration(plan, new_plan, 0, progress)
    assert not isinstance(completion, str), completion
    views = CompletionViews(completion)
    with_senders = 0
    live = new_plan.live_ranks()
    assert views.encoded_views(live) == [views.json_for(rank).encode() for rank in live]  # (what the store gets)
    for rank in live:
        text = views.json_for(rank)
        view = Completion.from_json(text, new_plan, rank)
        assert view.steps[rank] == completion.steps[rank]
        for src, steps in enumerate(completion.steps):
            if any(step.dst == rank for step in steps):
                assert view.steps[src] == steps  # its receive order is their send order
                with_senders += src != rank
            elif src != rank:
                assert view.steps[src] == ()
        assert (view.iteration, view.applied_stages, view.redone_actions) == \
            (completion.iteration, completion.applied_stages, completion.redone_actions)
        with pytest.raises(PlanError, match="not worker"):
            Completion.from_json(text, new_plan, rank + 1)
    assert with_senders > 0
    with pytest.raises(PlanError, match="outside the plan's 9 workers"):
        Completion.from_json(views.json_for(0).replace('"steps_of":{"0"', '"steps_of":{"99"'), new_plan, 0)
