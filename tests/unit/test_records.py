"""The typed store records between worker and launcher: every kind round-trips bit-exactly through JSON, and a
record of an unknown or another kind is refused with a clear error."""

from __future__ import annotations

import json

import pytest

from recycle.runtime.protocol.records import (Announcement, ErrorRecord, EvalRecord, FaultRecord, JoinReady,
                                              MigrationRecord, RecordError, StepRecord, StoppedReport, Timestamp,
                                              TransferRecord, from_json, to_json)

RECORDS = [
    StepRecord(1, 0, 2, 1700000000.123456, 1700000000.5, 0.1 + 0.2, 0.3, 1 / 3, None, 2.0 ** -40, "ab12",
               (("0F0", 1.5, 1.75), ("0B0", 1.75, 2.0))),
    StepRecord(0, 1, 0, 1.0, 2.0, 0.5, None, None, 7.25, None, lr=1e-3 / 3),
    EvalRecord(4.304127 + 1e-12, 8, 1700000000.25, 1700000000.5, 2),
    ErrorRecord("RuntimeError", "boom", False, 12.5, "Traceback ...\n"),
    FaultRecord(3.25, "action 4", "kill"),
    JoinReady(4.5, 12345),
    Timestamp(1700000000.000001),
    TransferRecord(4096, 0.02, "1:0"),
    MigrationRecord((2, 5), 1, 0, 8192, 0.01),
    StoppedReport(3, 1, 4, 5, 2, 0.25, 7, 1.5, "Connection closed by peer", 12.5),
    Announcement(2, (0, 1, 2), 5, 10, "worker 1:1 died", joining=(3,), restore_step=4),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_exactly(record: object) -> None:
    assert from_json(type(record), to_json(record)) == record
    assert from_json(type(record), to_json(record).encode()) == record  # the store hands back bytes


def test_step_record_names_its_worker() -> None:
    assert RECORDS[0].worker == "1:0"


def test_unknown_kind_other_kind_and_missing_fields_are_clear_errors() -> None:
    text = to_json(FaultRecord(1.0, "action 0", "kill"))
    with pytest.raises(RecordError, match="kind 'telemetry', which is unknown .*same recycle version"):
        from_json(FaultRecord, json.dumps({**json.loads(text), "kind": "telemetry"}))
    with pytest.raises(RecordError, match="kind None, which is unknown"):
        from_json(FaultRecord, json.dumps({"time": 1.0}))  # written without a kind
    with pytest.raises(RecordError, match="a StepRecord store record was expected, but the key holds a FaultRecord"):
        from_json(StepRecord, text)
    with pytest.raises(RecordError, match="lacks a field"):
        from_json(FaultRecord, json.dumps({"kind": "fault", "time": 1.0}))
    with pytest.raises(RecordError, match="is not JSON"):
        from_json(FaultRecord, b"\xff not json")
    with pytest.raises(TypeError, match="dict is not a store record"):
        to_json({"time": 1.0})


def test_fields_a_newer_writer_adds_are_ignored() -> None:
    data = {**json.loads(to_json(JoinReady(1.0, 7))), "host": "node-3"}
    assert from_json(JoinReady, json.dumps(data)) == JoinReady(1.0, 7)
