"""Seeded fuzzing of configs and traces (issue 11): every input gives either a valid result or one clean `error:` line
with exit 2, never a traceback. A seeded generator (no extra dependency); a failure prints the input to replay."""

from __future__ import annotations

import json
import math
import os
import random
import tomllib
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.errors import TraceError
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[2]
BASE = tomllib.loads((ROOT / "configs" / "toy.toml").read_text())
WILD = [math.nan, math.inf, -math.inf, -1, 0, 0.5, 1, 3, -0.0, 1e300, 1e16, 10**20, "x", "nan", True, [], [1, 2],
        [1, math.nan, 1, 1], [1, 1, 1, 1], {"a": 1}]
BENIGN = [0, 0.5, 1, 2, 3, [1, 2, 1, 2]]
SMALL_INTS = [-1, 0, 1, 2, 3, 4, 6, 2.0, "2", True]  # topology sizes: wild types, but never a million workers
SEED = int(os.environ.get("RECYCLE_FUZZ_SEED", "20261203"))  # another seed explores further


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _to_toml(raw: dict) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, table in raw.items():
        if isinstance(table, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _mutate(rng: random.Random) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for _ in range(rng.randint(1, 2)):
        section = rng.choice(["topology", "workload", "costs", "memory", "communication", "training"])
        table = raw.setdefault(section, {})
        keys = list(table) + ["capacity_bytes", "activation_bytes", "p2p_bandwidth", "bogus"]
        key = rng.choice(keys)
        if rng.random() < 0.1:
            table.pop(key, None)
        else:
            pool = SMALL_INTS if section in ("topology", "workload") else BENIGN if rng.random() < 0.4 else WILD
            table[key] = rng.choice(pool)
    return raw


def _run_clean(capsys: pytest.CaptureFixture[str], argv: list[str], what: str) -> int:
    try:
        code = main(argv)
    except BaseException as exc:  # noqa: BLE001 -- the point: nothing may escape main()
        pytest.fail(f"{type(exc).__name__}: {exc} escaped main() for {what}")
    out, err = capsys.readouterr()
    if code == 2:
        # Warnings about the input (e.g. fixed trace lines) may come first; then exactly one error line, last.
        lines = err.splitlines()
        assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, (what, err)
        assert "Traceback" not in err, (what, err)
    else:
        assert code == 0, (what, code, err)
        if "--json" in argv:
            json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output for {what}"))
    return code


@pytest.mark.timeout(120)
def test_fuzzed_configs_give_a_result_or_one_clean_error(tmp_path: Path, capsys) -> None:
    rng = random.Random(SEED)
    outcomes = {0: 0, 2: 0}
    for case in range(80):
        text = _to_toml(_mutate(rng))
        path = tmp_path / f"c{case}.toml"
        path.write_text(text)
        command = rng.choice([["schedule", "--json"], ["plan", "--fail", "0:0", "--json"], ["schedule"]])
        outcomes[_run_clean(capsys, [command[0], "--config", str(path), *command[1:]], f"case {case}:\n{text}")] += 1
    assert outcomes[0] >= 3 and outcomes[2] >= 10, outcomes  # both the valid and the error path were exercised


def _trace_line(rng: random.Random) -> str:
    t = rng.choice(["0", "1000", "60000", "-5", "1e20", "nan", "3.5", "", "x", "2021-12-10"])
    kind = rng.random()
    if kind < 0.4:
        return f"{t},{rng.choice(['add', 'remove', 'ADD', 'drop', ''])},{rng.choice(['n1', 'n2', 'n3', '', 'n 4'])}"
    if kind < 0.7:
        return f"{t},{rng.choice(['3', '2', '0', '-1', 'x', '2.5', ''])}"
    if kind < 0.8:
        hour, minute = rng.randint(0, 25), rng.randint(0, 59)  # hour 24 and 25 are invalid on purpose
        return f"2021-12-{rng.randint(9, 12)}, {hour:02d}:{minute:02d}:00, {rng.randint(-1, 9)}"
    return rng.choice(["", "# comment", "time_ms,live", "time_ms,action,node", "\ufeff0,3", "a;b;c", ",,,", "0"])


def _plausible(rng: random.Random) -> list[str]:
    kind = rng.choice(["event", "count", "dated"])
    times = sorted(rng.randint(1, 10**7) for _ in range(rng.randint(1, 8)))
    if rng.random() < 0.3 and len(times) > 1:
        i = rng.randrange(len(times) - 1)
        times[i], times[i + 1] = times[i + 1], times[i]  # one out-of-order pair
    if kind == "event":
        return ["0,add,n1", "0,add,n2", "0,add,n3"] + [
            f"{t},{rng.choice(['add', 'remove'])},n{rng.randint(1, 4)}" for t in times]
    if kind == "count":
        return ["0,4"] + [f"{t},{rng.randint(0, 6)}" for t in times]
    return ["2021-12-10, 00:00:00, 4"] + [
        f"2021-12-10, {t // 3_600_000 % 24:02d}:{t // 60_000 % 60:02d}:{t // 1000 % 60:02d}, {rng.randint(0, 6)}"
        for t in times]


@pytest.mark.timeout(120)
def test_fuzzed_traces_read_cleanly_or_raise_a_trace_error(tmp_path: Path, capsys) -> None:
    rng = random.Random(SEED)
    read = failed = 0
    for case in range(300):
        if rng.random() < 0.5:
            lines = [_trace_line(rng) for _ in range(rng.randint(0, 8))]
        else:  # a plausible trace (any of the three formats, shuffled a little) with at most one odd line
            lines = _plausible(rng)
            if rng.random() < 0.5:
                lines.insert(rng.randint(0, len(lines)), _trace_line(rng))
        path = tmp_path / f"t{case}.csv"
        path.write_text("\n".join(lines) + "\n")
        try:
            trace = read_trace(path, seed=case)
        except TraceError as exc:
            assert str(exc) and "\n" not in str(exc), (case, lines)
            failed += 1
            continue
        except BaseException as exc:  # noqa: BLE001
            pytest.fail(f"{type(exc).__name__}: {exc} escaped read_trace for case {case}: {lines!r}")
        read += 1
        assert trace.end_ms >= 0 and all(e.time_ms >= 0 for e in trace.events), (case, lines)
        if case % 25 == 0:  # a few whole replays through the CLI
            _run_clean(capsys, ["simulate", "--config", str(ROOT / "configs" / "toy.toml"), "--trace", str(path),
                                "--out", str(tmp_path / f"o{case}"), "--systems", "recycle", "fault-scaled",
                                "--period-model", "estimate", "--replicas", "auto", "--json"], f"trace {lines!r}")
    assert read >= 30 and failed >= 30, (read, failed)  # both the valid and the error path were exercised
