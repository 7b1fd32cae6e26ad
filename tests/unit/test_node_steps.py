"""Step records per node: a node launcher hands its workers' records to the coordinator as one NodeSteps record per
step and look (control.node_steps.StepForwarder), and the coordinator holds them until their step is reported
(HeldSteps), leaving out the stale ones a recovery made."""

from __future__ import annotations

from recycle.runtime.control.node_steps import KEPT_STEPS, HeldSteps, StepForwarder
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import NodeSteps, StepRecord, StepRows
from recycle.runtime.protocol.store import LocalStore
from recycle.runtime.protocol.store.data import KeyValue

NUM_STAGES = 2


def _record(rank: int, step: int, generation: int = 0) -> StepRecord:
    replica, stage = divmod(rank, NUM_STAGES)
    return StepRecord(replica, stage, generation, float(step), step + 0.5, 0.1, None, None, None, float(rank))


def _batch(node: int, step: int, *records: StepRecord) -> NodeSteps:
    return NodeSteps(node, step, StepRows.of(list(records)))


def _rank(replica: int, stage: int) -> int:
    return replica * NUM_STAGES + stage


class _Node:
    """A node's store with its launcher's forwarder, and the coordinator's store it forwards to."""

    def __init__(self, node: int = 3) -> None:
        self.data = KeyValue()
        self.workers = JobStore(LocalStore(self.data))  # what the node's workers write to
        self.forwarder = StepForwarder(node, LocalStore(self.data), self.data.subscribe((b"metrics/",)))
        self.job_data = KeyValue()
        self.feed = self.job_data.subscribe((b"node_metrics/",))
        self.jobs = JobStore(LocalStore(self.job_data))

    def write(self, rank: int, step: int, generation: int = 0) -> None:
        self.workers.put(Channels.METRICS, _record(rank, step, generation), step, rank)

    def batches(self) -> list[NodeSteps]:
        """What the coordinator's store got since the last call, read once and deleted (as the coordinator does)."""
        out = []
        for key in self.feed.drain():
            step, node, seq = (int(part) for part in key.decode().split("/")[1:])
            batch = self.jobs.read(Channels.NODE_METRICS, step, node, seq)
            assert batch is not None
            self.jobs.raw.delete_key(Keys.node_metrics(step, node, seq))
            out.append(batch)
        return out


def test_a_node_hands_on_one_record_per_step_with_only_what_came_in_since_its_last_look() -> None:
    node = _Node()
    for rank in (0, 1, 2):
        node.write(rank, 0)
    node.write(0, 1)
    node.forwarder.forward(node.jobs)
    batches = node.batches()
    assert [(b.node, b.step, [r.grad_sq for r in b.records]) for b in batches] == [(3, 0, [0.0, 1.0, 2.0]),
                                                                                   (3, 1, [0.0])]
    assert not node.workers.raw.check([Keys.metrics(0, 0)])  # the node's store keeps nothing it handed on
    node.write(1, 1)
    node.forwarder.forward(node.jobs)
    assert [(b.step, [r.grad_sq for r in b.records]) for b in node.batches()] == [(1, [1.0])]  # only the new one
    node.forwarder.forward(node.jobs)
    assert node.batches() == []  # nothing new, nothing written
    assert node.forwarder.sent == 3


def test_a_restarted_coordinator_gets_every_held_step_again_and_an_outage_keeps_the_newest() -> None:
    node = _Node()
    for step in range(KEPT_STEPS + 5):
        node.write(0, step)
        node.forwarder.take()  # the coordinator is away: nothing is sent
    assert sorted(node.forwarder.held) == list(range(5, KEPT_STEPS + 5))
    assert node.forwarder.dropped == 5  # steps pushed out before they could be sent are counted
    node.forwarder.send(node.jobs)
    assert [b.step for b in node.batches()] == list(range(5, KEPT_STEPS + 5))
    node.forwarder.resend()  # a new store: it lacks them all
    node.forwarder.send(node.jobs)
    assert [b.step for b in node.batches()] == list(range(5, KEPT_STEPS + 5))


def test_a_record_of_another_kind_on_the_nodes_store_is_dropped_not_handed_on() -> None:
    node = _Node()
    node.workers.raw.set(Keys.metrics(0, 1), b'{"kind": "eval", "loss": 1.0}')
    node.write(0, 0)
    node.forwarder.forward(node.jobs)
    assert [(b.step, [r.stage for r in b.records]) for b in node.batches()] == [(0, [0])]
    assert not node.workers.raw.check([Keys.metrics(0, 1)])


def test_the_coordinator_holds_records_until_reported_and_leaves_out_stale_and_reported_steps() -> None:
    held = HeldSteps()
    assert held.add(_batch(0, 4, _record(0, 4), _record(1, 4)), _rank, next_step=4) == [0, 1]
    assert held.add(_batch(1, 3, _record(2, 3)), _rank, next_step=4) == []  # step 3 is reported already
    assert sorted(held.get(4)) == [0, 1]
    # A recovery in generation 2 runs steps 4 on again: what was held of them is stale, and so is a record of
    # generation 0 or 1 that a launcher hands on late.
    held.forget_from(4, 2)
    assert held.get(4) == {}
    assert held.add(_batch(0, 5, _record(0, 5, generation=1)), _rank, next_step=4) == []
    assert held.add(_batch(0, 5, _record(0, 5, generation=2), _record(1, 5, generation=1)), _rank, 4) == [0]
    assert held.add(_batch(0, 3, _record(0, 3, generation=1)), _rank, next_step=3) == [0]  # before step 4
    # A later recovery from an earlier step replaces the floors from there on.
    held.forget_from(2, 3)
    assert held.fresh_generation(5) == 3 and held.fresh_generation(1) == 0
    held.pop(5)
    assert held.get(5) == {}
