"""A design probe for issue 23's steady coordinator CPU (not the runtime's code): what the coordinator pays for a
node's step records of one step as today's JSON columns (NodeSteps.read_unchecked + HeldSteps.add on arrival,
StepRows.gather when the step is reported) against the same rows as packed binary columns (int64 and float64
arrays, the optional floats with a presence mask, base64 in a small JSON envelope): decoded on arrival only as far as
the ranks, the float columns joined as bytes at the step's gather. At 16,384 ranks (2,048 nodes of 8) the
coordinator reads 2,048 such records per step.

Run: .venv/bin/python benchmarks/step_rows_packed_probe.py [--nodes 2048] [--rounds 5]
Prints the best round of each, side by side, and the ratios. The packed gather stops at the joined float columns;
the runtime would also build the reporter's per-worker values from them."""

from __future__ import annotations

import argparse
import array
import base64
import json
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from control_plane_nodes import node_steps_json  # noqa: E402

from recycle.runtime.control.node_steps import HeldSteps  # noqa: E402
from recycle.runtime.protocol.records import NodeSteps, StepRows  # noqa: E402

RANKS_PER_NODE = 8
STAGES = 8
OPTIONAL = ("loss_sum", "stage_loss", "grad_norm", "grad_sq", "lr")


def _rank_of(replica: int, stage: int) -> int:
    return replica * STAGES + stage


def json_records(nodes: int) -> list[bytes]:
    """Each node's NodeSteps of step 100, byte for byte as a launcher writes it (the benchmark's stand-ins' text)."""
    return [node_steps_json(node, 100, [(node * RANKS_PER_NODE // STAGES + i // STAGES, (node * RANKS_PER_NODE + i)
                                         % STAGES) for i in range(RANKS_PER_NODE)], 0, 1000.123456, 1002.123456,
                            STAGES - 1) for node in range(nodes)]


def packed_record(text: bytes) -> bytes:
    """The same rows as packed columns: replica, stage, generation (int64); start, end, cpu_s (float64); the optional
    floats (float64, 0.0 where absent) and their presence mask (one byte per value)."""
    data = json.loads(text)
    rows = data["rows"]
    optional = [value for name in OPTIONAL for value in rows[name]]
    body = (array.array("q", rows["replica"] + rows["stage"] + rows["generation"]).tobytes()
            + array.array("d", rows["start"] + rows["end"] + rows["cpu_s"]).tobytes()
            + array.array("d", [0.0 if value is None else value for value in optional]).tobytes()
            + bytes(value is not None for value in optional))
    return json.dumps({"kind": "node_steps_packed", "node": data["node"], "step": data["step"],
                       "rows": len(rows["replica"]), "columns": base64.b64encode(body).decode()}).encode()


def read_json(records: list[bytes]) -> tuple[float, float]:
    """(us per record on arrival, ms for the step's gather) as the coordinator does it today."""
    held = HeldSteps()
    start = time.perf_counter()
    for text in records:
        held.add(NodeSteps.read_unchecked(text), _rank_of, 0)
    arrived = time.perf_counter()
    step = held.get(100)
    StepRows.gather([step[rank] for rank in sorted(step)])
    return (arrived - start) / len(records) * 1e6, (time.perf_counter() - arrived) * 1e3


def read_packed(records: list[bytes]) -> tuple[float, float]:
    """The same with packed columns: the ranks read on arrival, the float columns joined at the gather."""
    held: dict[int, tuple[bytes, int]] = {}
    start = time.perf_counter()
    for text in records:
        data = json.loads(text)
        rows, body = data["rows"], base64.b64decode(data["columns"])
        ints = array.array("q")
        ints.frombytes(body[:16 * rows])
        for rank in map(_rank_of, ints[:rows], ints[rows:]):
            held[rank] = (body, rows)
    arrived = time.perf_counter()
    floats = array.array("d")
    for body, rows in dict((id(body), (body, rows)) for body, rows in held.values()).values():
        floats.frombytes(body[24 * rows:48 * rows])
    return (arrived - start) / len(records) * 1e6, (time.perf_counter() - arrived) * 1e3


def best(reader: Callable[[list[bytes]], tuple[float, float]], records: list[bytes], rounds: int) -> Any:
    return min(reader(records) for _ in range(rounds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.rounds < 1:
        parser.error(f"--nodes {args.nodes} and --rounds {args.rounds} must be at least 1")
    records = json_records(args.nodes)
    packed = [packed_record(text) for text in records]
    today, proto = best(read_json, records, args.rounds), best(read_packed, packed, args.rounds)
    print(f"{args.nodes} nodes x {RANKS_PER_NODE} ranks, best of {args.rounds} rounds, one after the other")
    print(f"arrival, per record:  JSON columns {today[0]:.1f} us   packed {proto[0]:.1f} us   "
          f"ratio {today[0] / proto[0]:.2f}x")
    print(f"the step's gather:    JSON columns {today[1]:.1f} ms   packed {proto[1]:.1f} ms   "
          f"ratio {today[1] / proto[1]:.1f}x")
    print(f"record size:          JSON columns {len(records[0])} B   packed {len(packed[0])} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
