"""A restarted coordinator (`recycle coordinator` run again with the same command) rebuilds the run from what the
node launchers and the workers tell its empty store: the generation, the live set, the steps still to report, the
newest complete checkpoint. `rebuild` is the decision, a pure function of those reports; `collect_hellos` and
`collect_resyncs` gather them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from recycle.runtime.protocol.channels import Channels, JobStore
from recycle.runtime.protocol.records import Announcement, NodeHello, RecordError, WorkerResync

__all__ = ["Rebuilt", "rebuild", "collect_hellos", "collect_resyncs", "is_restart"]

T = TypeVar("T")


@dataclass(frozen=True)
class Rebuilt:
    """The run as a restarted coordinator takes it over."""

    generation: int
    live: frozenset[int]  # the generation's members not known to be dead (finished ones included)
    done: frozenset[int]  # members that ran every step and exited
    next_step: int  # the first 0-based step whose records every member still holds
    member_from: tuple[tuple[int, int], ...]  # (rank, first step it reports): the generation's replacements
    latest_checkpoint: int | None
    unrecorded: frozenset[int]  # finished members whose step records this store will never see
    lost_steps: tuple[int, int] | None  # [first, last) steps run while no coordinator could record them


def is_restart(hellos: dict[int, NodeHello]) -> bool:
    """Some node's workers were training before this coordinator started: it is a restarted one."""
    return any(hello.state == "running" for hello in hellos.values())


def rebuild(initial_live: frozenset[int], hellos: dict[int, NodeHello], resyncs: dict[int, WorkerResync],
            announcement: Callable[[int], Announcement | None], latest_checkpoint: int | None, start_step: int,
            end_step: int, reported_through: int | None) -> Rebuilt:
    """The run from the reports of a restarted coordinator's store.

    - The generation is the newest that a worker is in (training, stopped in it, or finished); its members are its
      announcement's live set (generation 0: the run's starting plan). A member that died while the coordinator was
      away stays a member here: its launcher's exit report (or its silence) makes it an ordinary failure next.
    - Members whose launcher reports a clean exit are done.
    - Steps are reported from the first one every member still holds a record of (each keeps its newest ones), and
      never again one the --metrics file already has (`reported_through`, 1-based); the steps in between ran while
      no coordinator could record them, and are said to be lost (their training is not: only their records)."""
    in_run = {r: s for r, s in resyncs.items() if s.phase != "admitting"}
    generation = max((s.generation for s in in_run.values()), default=0)
    joining: tuple[int, ...] = ()
    redo = start_step
    if generation > 0:
        announced = announcement(generation)
        if announced is None:
            raise RecordError(f"no worker told the restarted coordinator generation {generation}'s announcement")
        live = frozenset(announced.live)
        joining, redo = announced.joining, announced.redo_step
    else:
        live = initial_live
    exits = {rank: code for hello in hellos.values() for rank, code in hello.exited}
    done = frozenset(r for r in live if exits.get(r) == 0)
    unrecorded = frozenset(r for r in done if r not in in_run)
    holding = [s.oldest_record for r, s in in_run.items() if r in live and r not in unrecorded]
    first_held = max(holding, default=end_step)
    next_step = max(first_held, start_step, 0 if reported_through is None else reported_through)
    next_step = min(next_step, end_step)
    floor = max(start_step, 0 if reported_through is None else reported_through)
    lost = (floor, next_step) if next_step > floor else None
    return Rebuilt(generation, live, done, next_step, tuple((r, redo) for r in joining if r in live),
                   latest_checkpoint, unrecorded, lost)


def collect_hellos(jobs: JobStore, nodes: range, window_s: float, progress: Callable[[str], None] | None,
                   poll_s: float = 0.05) -> dict[int, NodeHello]:
    """The node launchers' first words: every node's, or those in by `window_s` after the first one came."""
    hellos: dict[int, NodeHello] = {}
    first: float | None = None
    told = False
    while len(hellos) < len(nodes):
        for node in nodes:
            if node not in hellos:
                hello = _read(jobs, lambda: jobs.read(Channels.HELLO, node))
                if hello is not None:
                    hellos[node] = hello
                    first = time.monotonic() if first is None else first
        if first is not None and time.monotonic() - first > window_s:
            break
        if first is not None and is_restart(hellos) and not told and progress is not None:
            progress("coordinator: the run's nodes are training already: this is a restarted coordinator; "
                     "rebuilding the run from what the launchers and workers report")
            told = True
        time.sleep(poll_s)
    return hellos


def collect_resyncs(jobs: JobStore, ranks: frozenset[int], window_s: float,
                    poll_s: float = 0.05) -> dict[int, WorkerResync]:
    """The workers' accounts of where they stand: every one of `ranks`, or those in by `window_s`."""
    resyncs: dict[int, WorkerResync] = {}
    deadline = time.monotonic() + window_s
    while True:
        for rank in sorted(ranks - set(resyncs)):
            found = _read(jobs, lambda: jobs.read(Channels.RESYNC, rank))
            if found is not None:
                resyncs[rank] = found
        if len(resyncs) == len(ranks) or time.monotonic() > deadline:
            return resyncs
        time.sleep(poll_s)


def _read(jobs: JobStore, read: Callable[[], T | None]) -> T | None:
    try:
        return read()
    except RecordError:
        return None  # only the job's own processes can write; a record of another version is no report
