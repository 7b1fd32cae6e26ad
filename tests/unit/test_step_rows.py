"""A node's step records as columns (records.StepRows inside NodeSteps): they round-trip exactly, bad columns are
clear errors, and the reporter's metrics from them are those it computed from one StepRecord per worker."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from recycle.runtime.control.node_steps import HeldSteps
from recycle.runtime.control.reporter import Reporter, StepMetrics, grad_norm, learning_rate, replica_mismatch
from recycle.runtime.protocol.records import NodeSteps, RecordError, StepRecord, StepRows, from_json, to_json

NUM_STAGES = 3


def _records(replicas: int, step: int = 0, lr_by_stage: tuple[float, ...] = (3e-4, 3e-4, 3e-4)) -> list[StepRecord]:
    """One record per worker, with values that differ per worker in every field the metrics read."""
    out = []
    for replica in range(replicas):
        for stage in range(NUM_STAGES):
            rank = replica * NUM_STAGES + stage
            last = stage == NUM_STAGES - 1
            out.append(StepRecord(
                replica, stage, generation=1 + rank % 2, start=1700000000.0 + step + rank / 7,
                end=1700000001.0 + step + rank / 3, cpu_s=0.1 + rank / 11,
                loss_sum=2.5 / (rank + 1) if last else None, stage_loss=2.25 if last else None, grad_norm=None,
                grad_sq=(stage + 1) / 9, digest=f"{stage:02d}ab" * 4 if rank % 3 else "",
                timings=(("F0", 0.1 * rank, 0.2 * rank),) if rank % 2 else (), lr=lr_by_stage[stage]))
    return out


def _old_step_metrics(reporter: Reporter, step: int, records: list[StepRecord]) -> StepMetrics:
    """The reporter's metrics as it computed them from one StepRecord per worker before the columns (reference)."""
    first = min(r.start for r in records)
    last = max(r.end for r in records)
    period = last - reporter.previous_end if reporter.previous_end is not None else last - first
    reporter.previous_end = last
    losses = [r.stage_loss for r in records if r.stage_loss is not None]
    norms = [r.grad_norm for r in records if r.grad_norm is not None]
    squares: dict[int, float] = {}
    for r in records:
        if r.grad_sq is not None:
            squares.setdefault(r.stage, r.grad_sq)
    norm = norms[0] if norms else (sum(squares[s] for s in range(NUM_STAGES)) ** 0.5
                                   if len(squares) == NUM_STAGES else None)
    by_stage: dict[int, float] = {}
    for r in records:
        if r.lr is not None:
            by_stage.setdefault(r.stage, r.lr)
    lr = by_stage[min(by_stage)] if by_stage else None
    lr_by_stage = () if len(set(by_stage.values())) <= 1 else tuple(by_stage.get(s, float("nan"))
                                                                    for s in range(NUM_STAGES))
    tokens_per_s = reporter.tokens_per_step / period if period > 0 else 0.0
    gpus = len({r.worker for r in records}) * reporter.gpus_per_worker
    return StepMetrics(
        step=step + 1, loss=losses[0] if losses else 0.0, tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / gpus if gpus else 0.0, period_s=period, step_time_s=last - first,
        elapsed_s=0.0, grad_norm=norm, lr=lr, lr_by_stage=lr_by_stage,
        worker_time_s={r.worker: r.end - r.start for r in records},
        digests={r.worker: r.digest for r in records if r.digest},
        worker_cpu_s={r.worker: r.cpu_s for r in records},
        generation=max(r.generation for r in records), end_time=last)


def _through_nodes(records: list[StepRecord], per_node: int, step: int) -> StepRows:
    """`records` as the coordinator gets them: one NodeSteps per node through JSON, held, then gathered by rank."""
    held = HeldSteps()
    for node, first in enumerate(range(0, len(records), per_node)):
        text = to_json(NodeSteps(node, step, StepRows.of(records[first:first + per_node])))
        held.add(from_json(NodeSteps, text), lambda replica, stage: replica * NUM_STAGES + stage, step)
    got = held.get(step)
    return StepRows.gather([got[rank] for rank in sorted(got)])


def test_the_columns_are_the_step_records_fields_in_order() -> None:
    assert [f.name for f in fields(StepRows)] == [f.name for f in fields(StepRecord)]


def test_a_node_batch_round_trips_exactly() -> None:
    records = _records(2)
    batch = NodeSteps(4, 9, StepRows.of(records))
    back = from_json(NodeSteps, to_json(batch))
    assert back == batch and back.records == tuple(records)  # floats keep every bit, timings come back as tuples
    assert json.loads(to_json(batch))["rows"]["start"] == [r.start for r in records]  # one array per field


BAD_COLUMNS = [
    (lambda rows: rows.pop("cpu_s"), r"lack the column\(s\) cpu_s"),
    (lambda rows: rows.update(digest="ab"), r"lack the column\(s\) digest \(or hold no list there\)"),
    (lambda rows: rows["end"].pop(), r"column 'end' holds 5 values, not a list of 6 values like 'replica'"),
    (lambda rows: rows["start"].__setitem__(2, "soon"), r"column 'start' holds 'soon' \(str\), not one of float, int"),
    (lambda rows: rows["stage"].__setitem__(0, 1.0), r"column 'stage' holds 1.0 \(float\), not one of int"),
    (lambda rows: rows["replica"].__setitem__(0, True), r"column 'replica' holds True \(bool\)"),
    (lambda rows: rows["lr"].__setitem__(1, [1]), r"column 'lr' holds \[1\] \(list\), not one of NoneType, float"),
    (lambda rows: rows["digest"].__setitem__(1, None), r"column 'digest' holds None \(NoneType\), not one of str"),
    (lambda rows: rows["timings"].__setitem__(1, [["F0", 1.0]]), r"a timing is \('F0', 1.0\), not \(action, start"),
    (lambda rows: rows["timings"].__setitem__(0, 0), r"column 'timings' holds 0 \(int\), not one of tuple"),
    (lambda rows: rows.update(kind="step"), r"a NodeSteps record holds .* where step rows \(kind 'step_rows'\)"),
]


@pytest.mark.parametrize("change, message", BAD_COLUMNS)
def test_bad_columns_are_clear_errors(change, message) -> None:
    data = json.loads(to_json(NodeSteps(0, 1, StepRows.of(_records(2)))))
    change(data["rows"])
    with pytest.raises(RecordError, match=message) as caught:
        from_json(NodeSteps, json.dumps(data))
    assert str(caught.value).endswith("every process of a run must be the same recycle version")


@pytest.mark.parametrize("change, message", BAD_COLUMNS)
def test_a_batch_read_unchecked_is_refused_with_the_same_error_when_its_step_is_gathered(change, message) -> None:
    """The coordinator reads a batch checking only its shape and its replica, stage and generation columns; the
    other values are checked when the step is gathered: every bad batch is still refused, with the same words."""
    data = json.loads(to_json(NodeSteps(0, 1, StepRows.of(_records(2)))))
    change(data["rows"])
    with pytest.raises(RecordError, match=message):
        batch = NodeSteps.read_unchecked(json.dumps(data))
        StepRows.gather([(batch.rows, i) for i in range(len(batch.rows))])


def test_a_batch_read_unchecked_gathers_to_what_from_json_reads() -> None:
    records = _records(3)
    text = to_json(NodeSteps(2, 7, StepRows.of(records)))
    batch = NodeSteps.read_unchecked(text)
    assert (batch.node, batch.step) == (2, 7)
    assert StepRows.gather([(batch.rows, i) for i in range(len(records))]) == from_json(NodeSteps, text).rows
    with pytest.raises(RecordError, match=r"the key holds a StepRecord \(kind 'step'\)"):
        NodeSteps.read_unchecked(to_json(records[0]))
    with pytest.raises(RecordError, match="is not JSON"):
        NodeSteps.read_unchecked(b"{")


def test_a_held_batch_with_a_bad_value_is_left_out_when_its_step_is_gathered() -> None:
    """Node 1's batch has a start time of another version: the step's gather refuses it, drop_unreadable leaves out
    exactly its ranks, and the rest gathers."""
    records = _records(2)
    held = HeldSteps()
    good = to_json(NodeSteps(0, 3, StepRows.of(records[:3])))
    bad = json.loads(to_json(NodeSteps(1, 3, StepRows.of(records[3:]))))
    bad["rows"]["start"][1] = "soon"
    rank_of = lambda replica, stage: replica * NUM_STAGES + stage  # noqa: E731
    assert held.add(NodeSteps.read_unchecked(good), rank_of, 0) == [0, 1, 2]
    assert held.add(NodeSteps.read_unchecked(json.dumps(bad)), rank_of, 0) == [3, 4, 5]
    got = held.get(3)
    with pytest.raises(RecordError, match="column 'start' holds 'soon'"):
        StepRows.gather([got[rank] for rank in sorted(got)])
    assert held.drop_unreadable(3) == [3, 4, 5]
    got = held.get(3)
    assert StepRows.gather([got[rank] for rank in sorted(got)]) == StepRows.of(records[:3])


def test_rows_that_are_not_a_mapping_and_rows_built_wrong_in_code_are_refused() -> None:
    with pytest.raises(RecordError, match=r"holds \[1, 2\] where step rows"):
        from_json(NodeSteps, '{"kind": "node_steps", "node": 0, "step": 1, "rows": [1, 2]}')
    columns = asdict(StepRows.of(_records(1)))
    with pytest.raises(RecordError, match=r"column 'generation' holds \[1, 2, 1\], not a list of 3"):
        StepRows(**{**columns, "generation": [1, 2, 1]})


def test_gather_takes_picks_in_order_and_a_whole_batch_as_it_is() -> None:
    records = _records(3)
    first, second = StepRows.of(records[:4]), StepRows.of(records[4:])
    assert StepRows.gather([(first, i) for i in range(4)]) == first
    picked = StepRows.gather([(second, 1), (first, 0), (first, 1), (second, 0), (first, 3)])
    assert [picked.record(i) for i in range(len(picked))] == [records[5], records[0], records[1], records[4],
                                                              records[3]]


@pytest.mark.parametrize("per_node", [1, 4, 8])
def test_the_metrics_from_node_batches_are_those_from_one_record_per_worker(per_node: int) -> None:
    new, old = Reporter([], 4096, NUM_STAGES, 0.0, gpus_per_worker=2), Reporter([], 4096, NUM_STAGES, 0.0, 2)
    for step, lrs in enumerate([(3e-4, 3e-4, 3e-4), (3e-4, 1e-4, 2e-4)]):
        records = _records(5, step, lrs)
        got = new.step_metrics(step, _through_nodes(records, per_node, step))
        expected = _old_step_metrics(old, step, records)
        assert asdict(got) == {**asdict(expected), "elapsed_s": got.elapsed_s}
        assert list(got.worker_time_s) == list(expected.worker_time_s)  # same order: the --metrics file's
    assert got.lr_by_stage == (3e-4, 1e-4, 2e-4) and got.digests and got.grad_norm is not None


def test_the_step_functions_read_rows_and_record_lists_alike() -> None:
    records = _records(2)
    rows = StepRows.of(records)
    assert grad_norm(rows, NUM_STAGES) == grad_norm(records, NUM_STAGES) is not None
    assert learning_rate(rows, NUM_STAGES) == learning_rate(records, NUM_STAGES) == (3e-4, ())
    differ = [StepRecord(r, 0, 1, 0.0, 1.0, 0.1, None, None, None, 1.0, digest) for r, digest in ((0, "ab"), (1, "cd"))]
    assert replica_mismatch(2, StepRows.of(differ), NUM_STAGES) == replica_mismatch(2, differ, NUM_STAGES) is not None


def test_a_held_row_is_its_workers_record() -> None:
    records = _records(2)
    held = HeldSteps()
    held.add(NodeSteps(0, 3, StepRows.of(records)), lambda replica, stage: replica * NUM_STAGES + stage, 0)
    rows, index = held.get(3)[4]
    assert rows.record(index) == records[4]
