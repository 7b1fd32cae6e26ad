"""`recycle simulate`: report files, the --json summary, and exit 2 with a clear message on a bad trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recycle.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")


def test_simulate_writes_report_plot_and_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["simulate", "--config", TOY, "--generate", "poisson:nodes=14,hours=6,mtbf_h=4,repair_h=0.5,seed=2",
                 "--out", str(out), "--json", "--slot-seconds", "0.01", "--period-model", "estimate"])
    assert code == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert set(printed) == {"fault_free_throughput", "recycle", "fault-free", "fault-scaled", "checkpoint-restart",
                            "oobleck", "bamboo", "torchft-like"}
    assert abs(printed["fault-free"]["goodput"] - 1.0) < 1e-9
    assert 0 < printed["recycle"]["goodput"] <= 1.0
    assert "replaying" in captured.err  # progress goes to stderr
    for name in ("report.md", "throughput.png", "summary.json"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["series"]) == set(printed) - {"fault_free_throughput"} and summary["live_workers"][0][0] == 0
    assert summary["systems"]["recycle"]["mean_throughput"] == printed["recycle"]["mean_throughput"]
    report = (out / "report.md").read_text()
    assert "throughput.png" in report and "Time lost by cause" in report and "ReCycle" in report
    assert "torchft-like: its global batch changes" in report
    torchft = summary["torchft_like"]
    assert torchft["global_batch_changes"] and torchft["full_global_batch_samples"] == 18  # D=3 x M=6
    assert torchft["best_recycle"] == "recycle"
    assert torchft["best_recycle_goodput_ratio"] == pytest.approx(
        printed["recycle"]["goodput"] / printed["torchft-like"]["goodput"])


def test_simulate_selects_torchft_like_and_names_an_unknown_system(tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    code = main(["simulate", "--config", TOY, "--generate", "poisson:nodes=12,hours=2,mtbf_h=2,repair_h=0.5,seed=1",
                 "--out", str(out), "--systems", "recycle", "torchft-like", "--period-model", "estimate",
                 "--slot-seconds", "0.01", "--torchft-heal-bytes-per-s", "1e9"])
    assert code == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("recycle ") and lines[1].startswith("torchft-like ")
    assert lines[2].startswith("best ReCycle line (recycle) / torchft-like: ") and len(lines) == 3
    assert set(json.loads((out / "summary.json").read_text())["systems"]) == {"recycle", "torchft-like"}
    code = main(["simulate", "--config", TOY, "--generate", "poisson:nodes=12,hours=2,mtbf_h=2,repair_h=0.5",
                 "--out", str(out), "--systems", "recycle", "torchft"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown system(s) 'torchft'") and "torchft-like" in err and err.count("\n") == 1
    assert main(["simulate", "--config", TOY, "--generate", "poisson:nodes=12,hours=2,mtbf_h=2,repair_h=0.5",
                 "--out", str(out), "--torchft-heal-bytes-per-s", "0"]) == 2
    assert "torchft_heal_bytes_per_s = 0.0 must be > 0" in capsys.readouterr().err


def test_simulate_selected_systems_with_a_messy_trace_file(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,n1\n0,add,n2\n0,add,n3\n0,add,n4\n\n20000,remove,n2\n10000,remove,n1\n"
                     "10000,remove,n1\n40000,add,n1\n")
    code = main(["simulate", "--config", TOY, "--trace", str(trace), "--out", str(tmp_path / "o"), "--json",
                 "--systems", "recycle", "fault-scaled", "--replicas", "auto", "--period-model", "estimate"])
    assert code == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) == {"fault_free_throughput", "recycle", "fault-scaled"}
    assert "out of time order" in captured.err and "not present" in captured.err


def test_bad_trace_exits_2_with_line_number(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,n1\n0,add,n2\n5000,explode,n1\n")
    code = main(["simulate", "--config", TOY, "--trace", str(trace), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.csv:3" in err and "'explode'" in err and "Traceback" not in err
    code = main(["simulate", "--config", TOY, "--generate", "poisson:nodes=3", "--out", str(tmp_path / "o")])
    assert code == 2 and "mtbf_h" in capsys.readouterr().err


def test_simulate_places_availability_failures_on_the_jobs_grid(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "avail.csv"
    trace.write_text("time_ms,live\n0,12\n60000,9\n120000,12\n")
    for placement in ("spread", "worst"):
        out = tmp_path / placement
        code = main(["simulate", "--config", TOY, "--trace", str(trace), "--out", str(out), "--json",
                     "--systems", "recycle", "fault-scaled", "--period-model", "estimate", "--slot-seconds", "0.01",
                     "--placement", placement, "--seed", "1"])
        assert code == 0
        assert f"placement {placement} (seed 1; grid D=3 x S=4" in capsys.readouterr().err
        summary = json.loads((out / "summary.json").read_text())
        assert summary["placement"].startswith(placement)
    code = main(["simulate", "--config", TOY, "--generate", "paper-gcp:placement=spread", "--out",
                 str(tmp_path / "gcp"), "--systems", "fault-scaled", "--period-model", "estimate",
                 "--slot-seconds", "0.01"])
    assert code == 0 and "placement spread (seed 0; grid D=3 x S=4" in capsys.readouterr().err


def test_recycle_plus_decisions_go_to_the_report_and_stdout_keeps_the_summary(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plus"
    code = main(["simulate", "--config", str(ROOT / "configs" / "gpt3-6.7b-a100.toml"), "--generate",
                 "paper-gcp:placement=spread", "--out", str(out), "--systems", "recycle", "recycle-plus",
                 "--period-model", "estimate"])
    assert code == 0
    stdout = capsys.readouterr().out.splitlines()
    decisions = [e for e in json.loads((out / "summary.json").read_text())["recycle_plus_policy"]
                 if e["policy"] in ("repartition", "re-route", "layers back")]
    assert decisions and not any(line.startswith("ReCycle+ at") for line in stdout)
    assert stdout[-1] == f"ReCycle+ made {len(decisions)} layer decision(s): listed in {out}/report.md"
    assert len(stdout) == 3  # one line per system, then the pointer to the decisions
    report = (out / "report.md").read_text()
    assert f"### ReCycle+ layer decisions ({len(decisions)})" in report
    for entry in decisions:
        assert f"| {entry['time_s']:.0f} | {entry['policy']} | {entry['detail']} |" in report
