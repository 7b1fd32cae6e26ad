"""Bad input from a careless user (issue 11, items 3, 4 and 6): every case exits 2 with one `error:` line naming the
value, no traceback, and nothing half-written; a reader that stops early (`| head`) is not an error."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from recycle import fileio
from recycle.cli import build_parser, main
from recycle.errors import OutputError
from recycle.outputs import OUTPUTS

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")
TINY = str(ROOT / "configs" / "tiny-gpt.toml")
EVENTS = "0,add,a\n0,add,b\n0,add,c\n0,add,d\n60000,remove,b\n120000,add,b\n"


def fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Exit 2, exactly one line on stderr, starting with `error:` and containing every needle; no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def unwritable_dir() -> Path:
    """A directory nobody (root included) can create files in, or skip."""
    for candidate in (Path("/sys"), Path("/proc")):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    pytest.skip("no unwritable directory on this machine")


# -- item 3: non-finite numbers in configs ------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "[1, nan, 1, 1]", "1e300"])
@pytest.mark.parametrize("command", [["schedule", "--json"], ["plan", "--fail", "1:2"]])
def test_non_finite_costs_are_rejected(tmp_path: Path, capsys, value: str, command: list[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(Path(TOY).read_text().replace("\nforward = 1\n", f"\nforward = {value}\n"))
    fails_cleanly(capsys, [command[0], "--config", str(path), *command[1:]], "[costs] forward", "finite")


def test_schedule_json_is_strict_json(capsys) -> None:
    assert main(["schedule", "--config", TOY, "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


# -- item 4: every output path checked before any work --------------------------------------------------------------
def test_every_output_flag_in_the_table_exists() -> None:
    parsers = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command, outputs in OUTPUTS.items():
        dests = {a.dest: a.option_strings for a in parsers[command]._actions}
        for dest, flag, _ in outputs:
            assert flag in dests.get(dest, ()), (command, flag)


@pytest.mark.parametrize("argv,needle", [
    (["schedule", "--config", TOY, "--gantt", "{file}/g.png"], "is a file, not a directory"),
    (["schedule", "--config", TOY, "--trace", "{dir}"], "is a directory"),
    (["schedule", "--config", TOY, "--csv", "{unwritable}/p.csv"], "cannot create files in"),
    (["plan", "--config", TOY, "--fail", "1:2", "--save", "{dir}"], "--save takes a file path"),
    (["plan", "--config", TOY, "--fail", "1:2", "--gantt", "{unwritable}/x/g.png"], "cannot create files in"),
    (["plan", "--config", TOY, "--max-failures", "1", "--out", "{file}"], "is not a directory"),
    (["simulate", "--config", TOY, "--generate", "paper-gcp", "--out", "{file}"], "is not a directory"),
    (["simulate", "--config", TOY, "--generate", "paper-gcp", "--out", "{unwritable}/r"], "cannot create files"),
    (["profile", "--config", TINY, "--out", "{dir}"], "is a directory"),
    (["demo", "--out", "{file}/demo"], "is a file, not a directory"),
    (["train", "--config", TINY, "--save", "{dir}"], "--save takes a file path"),
    (["train", "--config", TINY, "--metrics", "{unwritable}/m.jsonl"], "cannot create files in"),
    (["train", "--config", TINY, "--checkpoint-dir", "{file}", "--checkpoint-every", "1"], "is not a directory"),
])
def test_unusable_outputs_fail_before_any_work(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    paths = {"file": str(tmp_path / "file"), "dir": str(tmp_path / "dir"), "unwritable": "{unwritable}"}
    if any("{unwritable}" in a for a in argv):
        paths["unwritable"] = str(unwritable_dir())
    before = sorted(p.name for p in tmp_path.rglob("*"))
    fails_cleanly(capsys, [a.format(**paths) for a in argv], needle)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, not even a .part or temp file


def test_a_full_disk_for_checkpoints_is_caught_up_front(tmp_path: Path, capsys, monkeypatch) -> None:
    class Usage:
        free = 1000

    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: Usage)
    fails_cleanly(capsys, ["train", "--config", TINY, "--checkpoint-dir", str(tmp_path / "ck"),
                           "--checkpoint-every", "1"], "MB free", "free space there")
    assert not (tmp_path / "ck").exists()


def test_a_write_failing_mid_run_names_the_directory_and_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out" / "metrics.jsonl"
    fileio.atomic_write_text(target, "old\n")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", full)
    with pytest.raises(OutputError, match="No space left on device") as info:
        fileio.atomic_write_text(target, "new\n")
    assert f"in directory {str(target.parent)!r}" in str(info.value)
    assert target.read_text() == "old\n" and [p.name for p in target.parent.iterdir()] == ["metrics.jsonl"]


# -- item 6: argument ranges, plan files, event traces, broken pipes -------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--timeout", "-5"], "--timeout -5 must be a positive number"),
    (["--timeout", "0"], "--timeout 0 must be a positive number"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--timeout", "0.001"], "--timeout 0.001 s is below 1 s"),
    (["--hang-timeout", "0"], "--hang-timeout 0 s must be > 0"),
    (["--hang-timeout", "inf"], "--hang-timeout inf"),
    (["--checkpoint-dir", "{tmp}/ck", "--checkpoint-every", "0"], "would never write a checkpoint"),
    (["--heartbeat-timeout", "0.5"], "--heartbeat-timeout 0.5 s must be at least twice"),
    (["--coordinator-grace", "-1"], "--coordinator-grace -1 must be a number of seconds >= 0"),
    (["--coordinator-grace", "nan"], "--coordinator-grace nan must be a number of seconds >= 0"),
    (["--inject", "kill:9:0@2"], "outside the topology"),
    (["--chaos", "1,7"], "SEED,RATE"),
    (["--respawn-after", "-1"], "--respawn-after -1 must be >= 0"),
    (["--inject", "rejoin:5:1@2"], "'rejoin:5:1@2': worker 5:1 is outside the topology"),
    (["--inject", "rejoin:1:1@2.3"], "a re-join is rejoin:REPLICA:STAGE@STEP"),
    (["--max-failures", "-1"], "--max-failures -1 must be >= 0"),
    (["--plan-store", "{tmp}/no-store"], "index.json does not exist; build the store with `recycle plan"),
    (["--token-file", "{tmp}/no-token"], "does not exist; write the job secret there"),
    (["--master-port", "99999"], "--master-port 99999 is not a TCP port"),
    (["--master-port", "-1"], "is not a TCP port"),
])
def test_train_option_ranges(tmp_path: Path, capsys, args: list[str], needle: str) -> None:
    fails_cleanly(capsys, ["train", "--config", TINY, *[a.format(tmp=tmp_path) for a in args]], needle)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("content,needle", [
    (None, "is a directory; pass a plan JSON file"),
    ("[1, 2, 3]", "is a JSON list, not a plan object"),
    ("rank,actions\n0,0F0 0B0\n", "is not JSON (it looks like CSV"),
    ('{"num_replicas": 2}', "plan data is malformed"),
    (b"\xff\xfe\x00", "is not UTF-8 text"),
])
def test_plan_files_are_named_with_their_format(tmp_path: Path, capsys, content, needle: str) -> None:
    path = tmp_path / "plan.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    fails_cleanly(capsys, ["train", "--config", TINY, "--plan", str(path)], f"--plan {str(path)!r}", needle)


def test_placement_on_an_event_trace_is_refused(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "events.csv"
    trace.write_text(EVENTS)
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--trace", str(trace), "--placement", "spread", "--out",
                           str(tmp_path / "out")], "--placement spread applies to availability traces", "event trace")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value,needle", [
    ("--redo-fraction", "1.5", "must be in [0, 1]"),
    ("--detect-s", "nan", "must be a finite number >= 0 (--detect-s)"),
    ("--fallback-checkpoint-interval-s", "0", "checkpoint intervals must be > 0"),
])
def test_job_cost_flags_are_checked(tmp_path: Path, capsys, flag: str, value: str, needle: str) -> None:
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--generate", "paper-gcp", flag, value, "--out",
                           str(tmp_path / "out")], value, needle)
    assert not (tmp_path / "out").exists()


def test_output_piped_to_a_reader_that_quits_is_not_a_traceback(capsys, monkeypatch) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is printed (like `| head -0`)
    stream = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    assert main(["schedule", "--config", TOY]) == 141
    stream.close()  # stdout now points at /dev/null: closing (and the interpreter's last flush) cannot raise again
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_real_process_piped_to_a_reader_that_quits_exits_quietly() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "recycle", "schedule", "--config", TOY], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == b""  # no "Exception ignored ... BrokenPipeError" at interpreter exit


def test_top_level_log_level_before_the_command_is_accepted() -> None:
    """Issue 21 item 8: `recycle --log-level debug train ...` took 'debug' for the command."""
    from recycle.cli import _command_name, build_parser

    assert _command_name(["--log-level", "debug", "train", "--config", "x"]) == "train"
    assert _command_name(["-q", "--log-level=info", "plan"]) == "plan"
    args = build_parser(["--log-level", "debug", "schedule", "--config", "c.toml"]).parse_args(
        ["--log-level", "debug", "schedule", "--config", "c.toml"])
    assert args.command == "schedule" and args.log_level == "debug"


def test_the_coordinator_place_and_the_coordinator_command_refuse_bad_input(cli_error, monkeypatch) -> None:
    """Issue 23's new inputs: RECYCLE_COORDINATOR, `recycle coordinator` without a fixed port or a job secret, and
    the flags that act on a node's own workers given to the coordinator."""
    config = "configs/tiny-gpt.toml"
    monkeypatch.delenv("RECYCLE_JOB_TOKEN", raising=False)
    monkeypatch.setenv("RECYCLE_COORDINATOR", "elsewhere")
    line = cli_error(["train", "--config", config])
    assert "RECYCLE_COORDINATOR='elsewhere' is not a coordinator place" in line and "separate" in line
    monkeypatch.delenv("RECYCLE_COORDINATOR")
    line = cli_error(["coordinator", "--config", config])  # one node: no port is needed there, but here it is
    assert "`recycle coordinator` needs a fixed --master-port" in line and "RECYCLE_JOB_TOKEN" in line
    line = cli_error(["train", "--config", config, "--coordinator", "separate", "--master-port", "29500"])
    assert "--coordinator separate needs a fixed --master-port" in line and "job secret" in line
    for flag in (["--inject", "kill:1:1@3"], ["--chaos", "1,0.1"], ["--respawn-after", "1"], ["--emulate-costs"]):
        line = cli_error(["coordinator", "--config", config, *flag])
        assert f"{flag[0]} acts on a node's own workers, and `recycle coordinator` runs none" in line, line


def test_the_start_method_comes_from_the_flag_then_the_environment_and_a_bad_one_is_one_error_line(
        cli_error, monkeypatch) -> None:
    import argparse

    from recycle.commands.train import start_method

    assert start_method(argparse.Namespace(start_method=None), {}) == "spawn"
    assert start_method(argparse.Namespace(start_method=None), {"RECYCLE_START_METHOD": "forkserver"}) == "forkserver"
    assert start_method(argparse.Namespace(start_method="spawn"), {"RECYCLE_START_METHOD": "forkserver"}) == "spawn"
    monkeypatch.setenv("RECYCLE_START_METHOD", "fork")
    line = cli_error(["train", "--config", "configs/tiny-gpt.toml"])
    assert "RECYCLE_START_METHOD='fork' is not a start method" in line and "spawn, forkserver" in line, line
