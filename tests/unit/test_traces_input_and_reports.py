"""Traces as messy, untrusted input (issue 11, item 8) and trace reports that do not mislead (items 9 and 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.config import uniform_config
from recycle.errors import TraceError
from recycle.report.units import human_seconds, human_time, percent, speed_words, time_axis
from recycle.traces.baselines import CheckpointRestart
from recycle.traces.jobsim import replay
from recycle.traces.mapping import UnitTimeline
from recycle.traces.model import JobContext, JobCosts
from recycle.traces.reader import parse_availability_lines, parse_dated_availability_lines, read_trace
from recycle.traces.report import _margin

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")
GPT3 = str(ROOT / "configs" / "gpt3-6.7b-a100.toml")

# Nine lines of Bamboo's GCP V100 availability log (uclasystem/bamboo, traces/gcloud/v100x1-east1c.txt, MIT): each
# reading is logged three times a minute apart and the next reading may start before the last repeat.
BAMBOO_V100 = """2021-12-10, 21:49:26, 80
2021-12-10, 21:50:26, 80
2021-12-10, 21:51:26, 80
2021-12-10, 21:50:26, 79
2021-12-10, 21:51:26, 79
2021-12-10, 21:52:26, 79
2021-12-10, 21:52:04, 80
2021-12-10, 21:53:04, 80
2021-12-10, 21:54:04, 80
"""


# -- item 8: traces ---------------------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path) -> None:
    events = tmp_path / "events.csv"
    events.write_bytes("\ufefftime_ms,action,node\n0,add,a\n0,add,b\n10,remove,a\n".encode())
    trace = read_trace(events)
    assert trace.initial == {"a", "b"} and trace.notes.header
    counts = tmp_path / "counts.csv"
    counts.write_bytes("\ufeff0,4\n1000,3\n".encode())  # no header: the first line is data, not skipped
    trace = read_trace(counts)
    assert len(trace.initial) == 4 and not trace.notes.header and trace.num_removals() == 1


@pytest.mark.parametrize("first", ["hello world!", "0;4", "abc,add,node1", "node,1,2,3"])
def test_a_first_line_that_is_neither_data_nor_a_header_is_an_error(tmp_path: Path, first: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"{first}\n0,4\n1000,3\n")
    with pytest.raises(TraceError, match=f"{path}:1: first line"):
        read_trace(path)


@pytest.mark.parametrize("header", ["time_ms,live", "t,live", "timestamp (ms), #nodes"])
def test_headers_are_recognised_and_counted(header: str) -> None:
    trace = parse_availability_lines([header, "0,4", "1000,3"], source="h.csv")
    assert trace.notes.header and trace.live == (4, 3)


def test_bamboo_dated_availability_is_read_without_false_flaps(tmp_path: Path) -> None:
    path = tmp_path / "v100.txt"
    path.write_text(BAMBOO_V100)
    avail = parse_dated_availability_lines(BAMBOO_V100.splitlines(), source=str(path))
    # 80 until 21:50:26, then 79 until the reading of 80 at 21:52:04; sorting would give 80 79 80 79 80.
    assert avail.times_ms == (0, 60_000, 158_000) and avail.live == (80, 79, 80)
    assert avail.notes.superseded == 2 and "replaced the samples" in " ".join(avail.notes.messages())
    trace = read_trace(path)  # detected by its date column
    assert trace.num_removals() == 1 and len(trace.initial) == 80 and trace.placement.startswith("random")
    with pytest.raises(TraceError, match=r"v100.txt:4: time 60000 ms is earlier than the line before"):
        read_trace(path, strict=True)


def test_dated_lines_with_a_bad_date_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "v.txt"
    path.write_text("2021-12-10, 21:49:26, 80\n2021-13-10, 21:50:26, 79\n")
    with pytest.raises(TraceError, match=r"v.txt:2: .*not a date and time"):
        read_trace(path)


def test_out_of_order_counts_replace_what_follows_instead_of_being_sorted() -> None:
    trace = parse_availability_lines(["0,10", "100,10", "200,10", "100,8", "300,8"])
    assert (trace.times_ms, trace.live) == ((0, 100), (10, 8))  # 8 from 100 on; the 10 at 200 was superseded
    assert trace.notes.superseded == 1 and trace.notes.out_of_order == 0


# -- items 9 and 10: reports -------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_trace_report_leads_with_goodput_and_explains_a_baseline_that_cannot_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["simulate", "--config", GPT3, "--generate", "paper-gcp", "--systems", "recycle", "checkpoint-restart",
                 "bamboo", "--period-model", "estimate", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    for name in ("checkpoint-restart", "bamboo"):
        assert {"goodput", "mean_throughput", "recycle_ratio_goodput", "recycle_ratio_mean", "reason"} <= set(
            printed[name])
    bamboo = printed["bamboo"]
    assert bamboo["goodput"] == 0 and bamboo["recycle_ratio_goodput"] is None
    assert bamboo["reason"].startswith("cannot run: stage") and "GB" in bamboo["reason"]
    ckpt = printed["checkpoint-restart"]
    assert ckpt["recycle_ratio_goodput"] == pytest.approx(printed["recycle"]["goodput"] / ckpt["goodput"])
    assert ckpt["recycle_ratio_mean"] == pytest.approx(printed["recycle"]["mean_throughput"] / ckpt["mean_throughput"])
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| system | goodput"))
    assert header.index("goodput") < header.index("mean throughput")
    assert "inf" not in report and "n/a (no progress)" in report and bamboo["reason"] in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"]["bamboo"]["reason"] == bamboo["reason"]


def test_a_restart_that_never_completes_is_named() -> None:
    # A failure every 100 s of a worker in use, and a restart takes 701 s: checkpoint-restart never runs again.
    costs = JobCosts(restart_s=701, checkpoint_interval_s=1000)
    ctx = JobContext(uniform_config(2, 2, 4), 10.0, 1.0, costs)
    points = [(0.0, {0, 1, 2, 3})] + [(100.0 * k, {0, 1, 2, 3} - {k % 4}) for k in range(1, 30)]
    timeline = UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), 3000.0, 1, 1)
    run = replay(CheckpointRestart(ctx), timeline, 10.0)
    assert run.useful_samples == 0
    assert run.unable_reason == "all its progress was rolled back: no checkpoint completed before the next failure"
    # Starting below one pipeline, then crashing every 100 s: each 701 s restart is overtaken by the next failure.
    points = [(0.0, {0})] + [(100.0 * k, {0, 1, 2, 3} - {k % 4}) for k in range(1, 30)]
    late = UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), 3000.0, 1, 1)
    run = replay(CheckpointRestart(ctx), late, 10.0)
    assert run.processed_samples == 0
    assert run.unable_reason.startswith("never completes a restart pause: the next failure comes first")


def test_words_match_the_sign() -> None:
    assert speed_words(0.853, 1.0, "1F1B") == "1.172x faster than 1F1B"
    assert speed_words(1.08, 1.0, "1F1B") == "1.080x slower than 1F1B"
    assert speed_words(30, 30, "1F1B") == "as fast as 1F1B"
    assert human_time(3_474_840, "us") == "3.47 s" and human_time(27_500, "us") == "27.5 ms"
    assert human_time(30, "slot") == "30" and human_time(850, "us") == "850 µs"
    assert time_axis("us", 3.4e7) == (1e6, "time (s)") and time_axis("us", 2e4) == (1e3, "time (ms)")
    assert human_seconds(900) == "15 min" and human_seconds(30) == "30 s" and human_seconds(4 * 3600) == "4 h"
    assert percent(0) == "0 %" and percent(3e-6) == "< 0.01 %" and percent(0.0398) == "3.98 %"
    below = _margin(-16.5, 3e-6, 22_680)
    assert below.startswith("below the line for") and "< 0.01 %" in below and "by 16.500" in below
    assert _margin(0.5, 0.0, 100).startswith("never below the line")
    assert _margin(-1.0, 0.0, 100).startswith("below the line only at isolated instants")
