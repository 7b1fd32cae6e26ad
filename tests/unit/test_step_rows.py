"""A node's step records packed (records.PackedRows inside NodeSteps) and a step's gathered as columns
(records.StepRows): they round-trip exactly, bad packed columns are clear errors, and the reporter's metrics from
them are those it computed from one StepRecord per worker."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, fields

import pytest

from recycle.runtime.control.node_steps import HeldSteps
from recycle.runtime.control.reporter import Reporter, StepMetrics, grad_norm, learning_rate, replica_mismatch
from recycle.runtime.protocol.channels import Channels, JobStore
from recycle.runtime.protocol.records import NodeSteps, PackedRows, RecordError, StepRecord, StepRows, to_json
from recycle.runtime.protocol.store import LocalStore
from recycle.runtime.protocol.store.data import KeyValue

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
    """`records` as the coordinator gets them: one NodeSteps per node through its bytes, held, then gathered by
    rank."""
    held = HeldSteps()
    for node, first in enumerate(range(0, len(records), per_node)):
        raw = NodeSteps(node, step, StepRows.of(records[first:first + per_node])).encode()
        held.add(NodeSteps.decode(raw), lambda replica, stage: replica * NUM_STAGES + stage, step)
    got = held.get(step)
    return StepRows.gather([got[rank] for rank in sorted(got)])


def test_the_columns_are_the_step_records_fields_in_order() -> None:
    assert [f.name for f in fields(StepRows)] == [f.name for f in fields(StepRecord)]


HEADER = struct.Struct("<8sqqqI")  # NodeSteps' header: magic, node, step, rows, the tail's length
ROW_BYTES = 3 * 8 + 8 * 8 + 5  # replica, stage, generation; eight floats; five presence bytes


def test_a_node_batch_round_trips_exactly() -> None:
    records = _records(2)
    batch = NodeSteps(4, 9, StepRows.of(records))
    raw = batch.encode()
    back = NodeSteps.decode(raw)
    assert back == batch and back.records == tuple(records)  # floats keep every bit, timings come back as tuples
    magic, node, step, count, tail = HEADER.unpack_from(raw)
    assert (magic, node, step, count) == (b"RCYSTEP1", 4, 9, 6)
    assert len(raw) == HEADER.size + ROW_BYTES * len(records) + tail and tail > 0  # digests and timings: the tail


def test_rows_with_no_digest_or_timing_have_no_tail() -> None:
    records = [StepRecord(0, s, 1, 1.0, 2.0, 0.1, None, None, None, 1.0) for s in range(3)]
    raw = NodeSteps(0, 1, StepRows.of(records)).encode()
    assert len(raw) == HEADER.size + ROW_BYTES * 3
    assert NodeSteps.decode(raw).records == tuple(records)


def test_packed_floats_keep_every_bit_and_absent_ones_stay_absent() -> None:
    odd = [float("nan"), float("inf"), -0.0, 5e-324, 0.0, 1.0]
    records = [StepRecord(0, stage, 1, 1700000000.1, 1700000000.3, cpu, loss, None if stage else 0.0, None, sq)
               for stage, (cpu, loss, sq) in enumerate(zip(odd, [None, 0.0, float("-inf")] * 2, reversed(odd)))]
    back = NodeSteps.decode(NodeSteps(0, 1, StepRows.of(records)).encode()).records
    for got, sent in zip(back, records):
        for name in ("cpu_s", "loss_sum", "stage_loss", "grad_norm", "grad_sq", "lr"):
            mine, theirs = getattr(got, name), getattr(sent, name)
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert math.copysign(1.0, mine) == math.copysign(1.0, theirs)
                assert mine == theirs or (math.isnan(mine) and math.isnan(theirs))


def _with_header(raw: bytes, **changes: int) -> bytes:
    magic, node, step, count, tail = HEADER.unpack_from(raw)
    fields_now = {"node": node, "step": step, "count": count, "tail": tail, **changes}
    return HEADER.pack(magic, *fields_now.values()) + raw[HEADER.size:]


def _with_tail(raw: bytes, change) -> bytes:
    """`raw` with its JSON tail (digest and timings) changed by `change` (given the parsed tail, returns bytes)."""
    _, _, _, count, tail = HEADER.unpack_from(raw)
    rows_end = HEADER.size + ROW_BYTES * count
    new_tail = change(json.loads(raw[rows_end:]))
    return _with_header(raw[:rows_end] + new_tail, tail=len(new_tail))


def _json(change):
    def changed(tail: dict) -> bytes:
        change(tail)
        return json.dumps(tail).encode()
    return changed


BAD_BATCHES = [
    (lambda raw: to_json(_records(1)[0]).encode(),
     r"""a NodeSteps record holds b'\{"kind": "step", .*', not a node's packed step records """
     r"\(they start with b'RCYSTEP1'\)"),
    (lambda raw: raw[:5], r"holds b'RCYST', not a node's packed step records"),
    (lambda raw: raw[:-1],
     r"holds \d+ bytes, not the 36 of its header, 93 for each of its 6 rows and its \d+-byte tail"),
    (lambda raw: _with_header(raw, count=7), r"not the 36 of its header, 93 for each of its 7 rows"),
    (lambda raw: _with_header(raw, count=-1), r"93 for each of its -1 rows"),
    (lambda raw: _with_tail(raw, lambda tail: b"[1"), r"its tail None is not the digest and timings columns as lists"),
    (lambda raw: _with_tail(raw, _json(lambda tail: tail.pop("timings"))), r"its tail \{'digest': .* is not the"),
    (lambda raw: _with_tail(raw, _json(lambda tail: tail["digest"].pop())),
     r"column 'digest' holds 5 values, not one value for each of the 6 rows"),
    (lambda raw: _with_tail(raw, _json(lambda tail: tail["digest"].__setitem__(1, None))),
     r"column 'digest' holds None \(NoneType\), not str"),
    (lambda raw: _with_tail(raw, _json(lambda tail: tail["timings"].__setitem__(1, [["F0", 1.0]]))),
     r"a timing is \('F0', 1.0\), not \(action, start"),
    (lambda raw: _with_tail(raw, _json(lambda tail: tail["timings"].__setitem__(0, 0))),
     r"column 'timings' holds 0 \(int\), not tuple"),
]


@pytest.mark.parametrize("change, message", BAD_BATCHES)
def test_bad_batches_are_clear_errors(change, message) -> None:
    """The coordinator refuses every bad batch as it comes in (NodeSteps.decode): a step's gather then meets only
    checked rows."""
    raw = change(NodeSteps(0, 1, StepRows.of(_records(2))).encode())
    with pytest.raises(RecordError, match=message) as caught:
        NodeSteps.decode(raw)
    assert str(caught.value).endswith("every process of a run must be the same recycle version")


def test_a_presence_byte_other_than_0_or_1_is_refused() -> None:
    records = [StepRecord(0, s, 1, 1.0, 2.0, 0.1, None, None, None, 1.0) for s in range(2)]
    raw = NodeSteps(0, 1, StepRows.of(records)).encode()
    with pytest.raises(RecordError, match=r"a presence byte is not 0 or 1"):
        NodeSteps.decode(raw[:-1] + b"\x02")  # (no tail: the last byte is the last row's lr's)


def test_the_job_store_holds_node_steps_as_their_bytes_and_other_records_as_json() -> None:
    jobs = JobStore(LocalStore(KeyValue()))
    batch = NodeSteps(2, 7, StepRows.of(_records(3)))
    jobs.put(Channels.NODE_METRICS, batch, 7, 2, 0)
    assert jobs.raw.get(Channels.NODE_METRICS.key(7, 2, 0)) == batch.encode()
    assert jobs.read(Channels.NODE_METRICS, 7, 2, 0) == batch
    jobs.put(Channels.METRICS, _records(1)[0], 7, 0)
    assert jobs.raw.get(Channels.METRICS.key(7, 0)) == to_json(_records(1)[0]).encode()
    with pytest.raises(TypeError, match="NodeSteps is not a store record"):
        to_json(batch)  # (a JSON record it is not: its bytes are its only form)


def test_rows_built_wrong_in_code_are_refused() -> None:
    with pytest.raises(RecordError, match=r"holds \[1, 2\] where step rows were expected"):
        NodeSteps(0, 1, [1, 2])  # type: ignore[arg-type]
    columns = asdict(StepRows.of(_records(1)))
    with pytest.raises(RecordError, match=r"column 'generation' holds \[1, 2, 1\], not a list of 3"):
        StepRows(**{**columns, "generation": [1, 2, 1]})
    with pytest.raises(RecordError, match=r"column 'start' holds 'soon' \(str\), not one of float, int"):
        PackedRows.of([StepRecord(0, 0, 1, "soon", 2.0, 0.1, None, None, None, 1.0)])  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=r"the packed column 'ints' holds 0 bytes, not 24 bytes for each of the 3"):
        PackedRows(3, b"", b"", b"")
    with pytest.raises(RecordError, match=r"a replica, stage or generation is past int64"):
        PackedRows.of([StepRecord(0, 0, 2 ** 63, 1.0, 2.0, 0.1, None, None, None, 1.0)])


def test_gather_takes_picks_in_order_and_a_whole_batch_as_it_is() -> None:
    records = _records(3)
    first, second = PackedRows.of(records[:4]), StepRows.of(records[4:])  # a node's batch, a worker's own rows
    assert StepRows.gather([(first, i) for i in range(4)]) == StepRows.of(records[:4])
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
