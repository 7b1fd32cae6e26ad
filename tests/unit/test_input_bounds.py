"""Sizes taken from input are bounded, and the last tracebacks and silent acceptances are gone (issue 21, items 3
and 6): every case exits 2 with one `error:` line naming the value, the limit or rule and the fix, before anything
is allocated or looped over. In-process (the CLI's main), each case well under a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from recycle.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")
TINY = str(ROOT / "configs" / "tiny-gpt.toml")


def fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Exit 2, exactly one line on stderr, starting with `error:` and containing every needle; no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# -- item 3: sizes in the config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("override,needles", [
    ("model.n_layer=100000", ("[model] n_layer = 100000", "limit of 1,024")),
    ("workload.microbatch_size=1000000000", ("[workload] microbatch_size = 1000000000", "limit of 1,048,576")),
    ("workload.microbatch_size=1048576", ("microbatch_size x seq_len = 1048576 x 32", "limit of 16,777,216")),
    ("topology.num_replicas=100000", ("[topology] num_replicas = 100000", "limit of 65,536")),
    ("workload.num_microbatches=100000000", ("[workload] num_microbatches = 100000000", "limit of 65,536")),
    ("workload.num_microbatches=65536,topology.num_replicas=64", ("D x S x M = 64 x 2 x 65536", "limit of 1,048,576")),
    ("training.steps=10000000000", ("[training] steps = 10000000000", "limit of 1,000,000,000")),
    ("training.seed=99999999999999999999999", ("[training] seed", "does not fit in 64 bits")),
])
@pytest.mark.parametrize("command", [["schedule"], ["plan", "--fail", "0:0"]])
def test_config_sizes_are_bounded(capsys, override: str, needles: tuple[str, ...], command: list[str]) -> None:
    sets = [a for item in override.split(",") for a in ("--set", item)]
    fails_cleanly(capsys, [command[0], "--config", TINY, *sets, *command[1:]], *needles)


# -- item 6: config values every worker would fail on -------------------------------------------------------------
@pytest.mark.parametrize("override,needles", [
    ("model.n_head=0", ("[model] n_head = 0 must be >= 1",)),  # was a ZeroDivisionError
    ("model.n_head=-2", ("[model] n_head = -2 must be >= 1",)),
    ("model.n_embd=0", ("[model] n_embd = 0 must be >= 1",)),
    ("model.vocab_size=0", ("[model] vocab_size = 0 must be >= 1",)),
    ("model.dropout=1.5", ("[model] dropout = 1.5 must be in [0, 1]",)),
    ("model.dropout=-0.1", ("[model] dropout = -0.1 must be in [0, 1]",)),
    ("training.betas=[2, 3]", ("[training] betas = [2.0, 3.0] must both be in [0, 1)", "e.g. [0.9, 0.95]")),
    ("training.betas=[0.9, 1.0]", ("must both be in [0, 1)",)),
    ("training.eps=-1", ("[training] eps = -1.0 must be >= 0", "torch.optim refuses it")),
    ("training.weight_decay=-1", ("[training] weight_decay = -1.0 must be >= 0",)),
    ("training.momentum=-0.5", ("[training] momentum = -0.5 must be >= 0",)),
])
def test_config_values_torch_would_refuse_fail_up_front(capsys, override: str, needles: tuple[str, ...]) -> None:
    fails_cleanly(capsys, ["schedule", "--config", TINY, "--set", override], *needles)


# -- item 6: plan JSON ----------------------------------------------------------------------------------------------
def _plan_json() -> dict:
    from recycle.api import load_config, schedule

    return schedule(load_config(TINY), "1f1b").to_dict()


def _edit(field: str, raw: str) -> str:
    """The tiny 1F1B plan's JSON with `field` set to the JSON text `raw`."""
    import json

    plan = _plan_json()
    plan[field] = "@@"
    return json.dumps(plan).replace('"@@"', raw)


@pytest.mark.parametrize("text,needle", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was a RecursionError
    (_edit("num_replicas", "9" * 5000), "an integer of more than 4,300 digits"),  # was a ValueError traceback
    (_edit("num_replicas", "1e400"), "the number 1e400 is out of range for a float"),  # int(inf): OverflowError
    (_edit("num_replicas", "2.5"), '"num_replicas" = 2.5 must be a whole number'),  # was read as 2
    (_edit("num_replicas", "2.0"), '"num_replicas" = 2.0 must be a whole number'),
    (_edit("num_stages", '"2"'), "\"num_stages\" = '2' must be a whole number (a JSON integer, not a str)"),
    (_edit("num_microbatches", "true"), '"num_microbatches" = True must be a whole number (a JSON integer, not a '
                                        'boolean)'),
    (_edit("num_microbatches", "100000000"), '"num_microbatches" = 100000000 must be in [1, 65,536]'),
    (_edit("staggered", '"no"'), "\"staggered\" = 'no' must be true or false"),  # "no" was read as true
    (_edit("staggered", "1"), '"staggered" = 1 must be true or false'),
    (_edit("host", "[[0, 1.5]]"), '"host[0]" must be a list of whole numbers'),
    (_edit("failed", '[["0", 1]]'), "each entry must be [replica, stage]"),
    (_edit("actions", "[7]"), '"actions[0]" = 7 must be a string of actions'),
    (_edit("meta", '{"decoupled": "no"}'), '"meta.decoupled" = \'no\' must be of type bool'),
    (_edit("meta", '{"predicted_period": NaN}'), "it holds NaN, which is not a number JSON allows"),
    (_edit("meta", '{"predicted_period": -Infinity}'), "it holds -Infinity"),
])
def test_plan_json_is_read_strictly(tmp_path: Path, capsys, text: str, needle: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    fails_cleanly(capsys, ["train", "--config", TINY, "--plan", str(path)], f"--plan {str(path)!r}", needle)


def test_a_valid_plan_json_still_loads(tmp_path: Path) -> None:
    import json

    from recycle.ir import read_plan
    from recycle.ir.plan import Plan

    original = _plan_json()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(original))
    assert read_plan(path).to_dict() == original == Plan.from_json(json.dumps(original)).to_dict()


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b"\x00" * 10), "is not valid JSON"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "is not valid JSON"),
    (lambda p: p.write_text("[]"), "holds a JSON list, not a plan store index"),  # was an AttributeError
    (lambda p: p.write_text('{"format": 1, "plans": []}'), "plan store"),
    (lambda p: p.write_text("[" * 100_000), "nests too deeply"),
])
def test_a_damaged_plan_store_index_is_one_error(tmp_path: Path, capsys, make, needle: str) -> None:
    from recycle.api import load_config

    store = tmp_path / "store"
    store.mkdir()
    make(store / "index.json")
    if needle == "plan store":  # an index whose fingerprint matches, so that its "plans" list is read
        import json

        (store / "index.json").write_text(json.dumps({"format": 1, "config_fingerprint":
                                                      load_config(TINY).fingerprint(), "options": {
                                                          "decoupled": True, "staggered": True}, "plans": []}))
        needle = "is incomplete or damaged (AttributeError"
    fails_cleanly(capsys, ["train", "--config", TINY, "--plan-store", str(store)], needle)


# -- item 6: other input files --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,needle", [
    (lambda tmp: "/proc/self/mem", "config file '/proc/self/mem' cannot be read (Input/output error)"),  # traceback
    (lambda tmp: "/dev/zero", "is a character device, not a regular file"),
    (lambda tmp: _write(tmp / "c.toml", "name = 1" + "0" * 5000), "an integer of more than 4,300 digits"),
    (lambda tmp: _write(tmp / "c.toml", "a = " + "[" * 100_000), "nests arrays or tables too deeply"),
])
def test_unreadable_config_files_are_one_error(tmp_path: Path, capsys, make, needle: str) -> None:
    path = make(tmp_path)
    if not Path(path).exists():
        pytest.skip(f"{path} is not on this machine")
    fails_cleanly(capsys, ["schedule", "--config", path], needle)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_an_override_of_5000_digits_is_one_error(capsys) -> None:
    fails_cleanly(capsys, ["schedule", "--config", TOY, "--set", "training.seed=" + "9" * 5000],
                  "is an integer of more than 4,300 digits")


# -- item 3: traces -------------------------------------------------------------------------------------------------
def test_an_availability_trace_with_a_live_count_of_10_12_is_refused(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,1000000000000\n1,0\n")  # 20 bytes; took 24 GB before the OOM killer
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--trace", str(trace), "--out", str(tmp_path / "o")],
                  "live count 1000000000000 is above the limit of 65,536 nodes")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("spec,needle", [
    ("poisson:nodes=1e9,mtbf_h=10", "nodes = 1,000,000,000 is above the limit of 65,536"),
    ("poisson:hours=1e9,mtbf_h=10", "about 6,000,000,000 node events"),
    ("llama3:days=1e9", "above the limit of 2,000,000 for one trace"),
    ("llama3:nodes=1e11", "nodes = 100,000,000,000 is above the limit"),
    ("poisson:nodes=65536,mtbf_h=100,hours=100", "for one replay"),  # 131,072 events x 65,536 live nodes
    ("poisson:nodes=2.5,mtbf_h=3", "nodes = 2.5 must be a whole number"),
    ("llama3:gpus_per_node=0", "gpus_per_node = 0 must be >= 1"),  # was a ZeroDivisionError
])
def test_generated_traces_are_bounded_before_any_is_drawn(tmp_path: Path, capsys, spec: str, needle: str) -> None:
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--generate", spec, "--out", str(tmp_path / "o")], needle)


def _event_trace(path: Path, lines: int, nodes: int = 8) -> Path:
    rows = [f"0,add,node{i}" for i in range(nodes)]
    rows += [f"{1000 * (k + 1)},{'remove' if k % 2 == 0 else 'add'},node{k // 2 % nodes}" for k in range(lines)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_trace_lines_nodes_and_names_are_bounded(tmp_path: Path, monkeypatch) -> None:
    from recycle.errors import TraceError
    from recycle.traces import reader
    from recycle.traces.reader import read_trace

    path = _event_trace(tmp_path / "t.csv", 30)
    monkeypatch.setattr(reader, "MAX_TRACE_LINES", 20)
    with pytest.raises(TraceError, match="more than 20 data lines, the limit for one trace"):
        read_trace(path)
    monkeypatch.setattr(reader, "MAX_TRACE_LINES", 1000)
    monkeypatch.setattr(reader, "MAX_TRACE_NODES", 4)
    with pytest.raises(TraceError, match="is the trace's 5th distinct node, above the limit of 4"):
        read_trace(path)
    (tmp_path / "n.csv").write_text(f"0,add,node{'7' * 3000}\n1,remove,node1\n")  # node_order: int() of 3000 digits
    with pytest.raises(TraceError, match="has 3,004 characters, above the limit of 200"):
        read_trace(tmp_path / "n.csv")
    (tmp_path / "b.csv").write_bytes(b"0,1," + b"x" * 10_000)  # one line of the whole file
    with pytest.raises(TraceError, match="line of 10,004 characters, above the limit"):
        read_trace(tmp_path / "b.csv")
    with pytest.raises(TraceError, match="is a directory, not a regular file"):
        read_trace(tmp_path)


def test_a_replay_too_large_for_memory_is_refused_before_it_is_built(tmp_path: Path, capsys, monkeypatch) -> None:
    from recycle.traces import trace

    monkeypatch.setattr(trace, "MAX_REPLAY_SIZE", 100)  # 21 change points x 8 units = 168
    path = _event_trace(tmp_path / "t.csv", 20)
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--trace", str(path), "--out", str(tmp_path / "o")],
                  "21 change points x 8 live units = 168 is above the limit of 100 for one replay")


def test_an_availability_trace_placing_too_many_events_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    from recycle.traces import placement

    monkeypatch.setattr(placement, "MAX_TRACE_EVENTS", 10)
    path = tmp_path / "a.csv"
    path.write_text("0,8\n1000,2\n2000,8\n")  # 12 node events
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--trace", str(path), "--out", str(tmp_path / "o")],
                  "rise and fall by 12 nodes in all, above the limit of 10 node events")


def test_a_grid_aware_placement_too_slow_to_score_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    from recycle.traces import placement

    monkeypatch.setattr(placement, "MAX_GRID_PLACEMENT_WORK", 20)
    path = tmp_path / "a.csv"
    path.write_text("0,12\n1000,9\n2000,12\n")  # 3 removals x 12 nodes
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--trace", str(path), "--placement", "spread", "--out",
                           str(tmp_path / "o")], "3 node removals x 12 nodes = 36 is above the limit of 20")


def test_traces_are_read_line_by_line(tmp_path: Path) -> None:
    """A 20,000-line trace is never held whole: the reader's peak is under 350 bytes per line (it was 550: the text,
    its list of lines and a list of kept lines next to the parsed events)."""
    import tracemalloc

    from recycle.traces.reader import read_trace

    path = _event_trace(tmp_path / "t.csv", 20_000, nodes=64)
    tracemalloc.start()
    try:
        trace = read_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(trace.events) == 20_000
    assert peak < 350 * 20_000, peak


@pytest.mark.parametrize("flag,value,needle", [
    ("--checkpoint-interval-s", "1e-6", "is 22,680,000,000 checkpoints, above the limit of 1,000,000"),
    ("--fallback-checkpoint-interval-s", "0.001", "--fallback-checkpoint-interval-s 0.001 over the trace's"),
    ("--gpus-per-node", "100000000", "--gpus-per-node 100000000 must be in [1, 1024]"),
    ("--slot-seconds", "nan", "--slot-seconds nan must be a number of seconds in (0, 86400]"),
    ("--slot-seconds", "inf", "--slot-seconds inf must be"),
    ("--slot-seconds", "1e300", "--slot-seconds 1e+300 must be"),
])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])  # with --json, nan was a traceback; without, a nan report
def test_simulate_options_are_bounded(tmp_path: Path, capsys, flag: str, value: str, needle: str,
                                      json_flag: list[str]) -> None:
    fails_cleanly(capsys, ["simulate", "--config", TOY, "--generate", "paper-gcp", flag, value, "--out",
                           str(tmp_path / "o"), *json_flag], needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(20)
def test_node_positions_take_the_lowest_free_position_without_counting_up() -> None:
    """NodePositions.join keeps a heap of freed positions (counting up from 0 was quadratic: 70 s for the 65,536
    nodes a trace may have); the position it gives is still the lowest free one not freed at the same instant."""
    import random

    from recycle.traces.mapping import NodePositions

    rng = random.Random(3)
    pos = NodePositions(1, 1)
    for step in range(2000):
        present = sorted(pos.position)
        if present and rng.random() < 0.45:
            excluded = {pos.leave(n) for n in rng.sample(present, rng.randint(1, min(3, len(present))))}
        else:
            excluded = set()
        for k in range(rng.randint(0, 3)):
            want = next(p for p in range(len(pos.occupied) + len(excluded) + 1)
                        if p not in pos.occupied and p not in excluded)
            pos.join(f"n{step}-{k}", excluded)
            assert pos.position[f"n{step}-{k}"] == want
    big = NodePositions(1, 1)
    for i in range(65_536):
        big.join(f"node{i}", set())
    assert big.position["node65535"] == 65_535


# -- items 3 and 6: `recycle train` options and inputs --------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--steps", "1000000000", "--checkpoint-dir", "{tmp}/ck", "--checkpoint-every", "1"],
     "--checkpoint-every 1 over steps 1..1000000000 is 1,000,000,000 checkpoints, above the limit of 10,000"),
    (["--steps", "10000000000"], "--steps 10000000000 is above the limit of 1,000,000,000"),
    (["--respawn-after", "nan"], "--respawn-after nan must be >= 0 seconds, a finite number"),  # was accepted
    (["--respawn-after", "inf"], "--respawn-after inf must be >= 0 seconds, a finite number"),
    (["--slot-ms", "40"], "--slot-ms 40 paces actions only with --emulate-costs"),  # was silently ignored
    (["--cost-scale", "2"], "--cost-scale 2 paces actions only with --emulate-costs"),
    (["--emulate-costs", "--slot-ms", "1e12"], "--slot-ms 1e+12 is above the limit of 60000 ms"),
    (["--emulate-costs", "--slot-ms", "20000"], "pads the longest action (2 slots) to 40 s, more than --timeout 30"),
    (["--emulate-costs", "--cost-scale", "1e9"], "--cost-scale 1e+09 is above the limit of 10000"),
    (["--master-addr", ""], "--master-addr '' is not a host name or IP address"),  # C++ socket dumps until timeout
    (["--master-addr", " "], "--master-addr ' ' is not a host name or IP address"),
    (["--master-addr", "a b"], "--master-addr 'a b' is not a host name"),
    (["--model-factory", "os:getcwd"], "model factory 'os:getcwd' takes (), not (config, num_stages)"),  # TypeError
    (["--model-factory", "os:system"], "model factory 'os:system' takes (command), not (config, num_stages)"),
    (["--nnodes", "1000000000", "--master-port", "29500", "--node-rank", "1"],  # the launcher loops over nodes
     "--nnodes 1000000000 is more than the job's D x S = 4 workers"),
])
def test_train_options_are_bounded(tmp_path: Path, capsys, args: list[str], needle: str) -> None:
    fails_cleanly(capsys, ["train", "--config", TINY, "--max-failures", "0",
                           *[a.format(tmp=tmp_path) for a in args]], needle)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("content,needle", [
    (b"\xff\xfe\x00\x01binary", "is not UTF-8 text (byte 0xff at offset 0)"),  # was a UnicodeDecodeError
    (b"0" * 100_000, "is 100,000 bytes, above the limit of 4,096 bytes"),
])
def test_a_binary_or_huge_token_file_is_one_error(tmp_path: Path, capsys, content: bytes, needle: str) -> None:
    token = tmp_path / "token"
    token.write_bytes(content)
    token.chmod(0o600)
    fails_cleanly(capsys, ["train", "--config", TINY, "--token-file", str(token)], f"--token-file {str(token)!r}",
                  needle)


def test_a_latest_pointer_of_5000_digits_is_not_a_traceback(tmp_path: Path, capsys) -> None:
    (tmp_path / "latest").write_text("step" + "1" * 5000 + "\n")  # int() of it was a ValueError traceback
    fails_cleanly(capsys, ["train", "--config", TINY, "--max-failures", "0", "--resume", str(tmp_path)],
                  "no checkpoint there")


@pytest.mark.parametrize("overrides,needle", [
    (["model.n_embd=16384", "model.n_layer=1024"], "each of its 4 worker(s) builds its stage"),
    (["workload.microbatch_size=500000"], "micro-batches of 16,000,000 tokens"),
])
def test_a_built_in_gpt_too_large_for_the_machine_is_refused(capsys, monkeypatch, overrides: list[str],
                                                             needle: str) -> None:
    from recycle.runtime.control import preflight

    monkeypatch.setattr(preflight, "_mem_available", lambda: 8 * 10**9)
    sets = [a for o in overrides for a in ("--set", o)]
    fails_cleanly(capsys, ["train", "--config", TINY, "--max-failures", "0", *sets], needle, "8.0 GB are available")


def test_the_memory_check_passes_the_tiny_gpt() -> None:
    from recycle.api import load_config
    from recycle.runtime.control.preflight import check_model_memory
    from recycle.runtime.options import LaunchOptions

    check_model_memory(load_config(TINY), LaunchOptions(), available=10**8)  # 4 x 0.2M parameters: under 10 MB


def test_the_memory_check_counts_the_sent_log_that_redo_lost_keeps() -> None:
    """--redo lost keeps each worker's sent activations/gradients of two iterations: a node that fits the stages but
    not that log is refused with both named, and --redo iteration (no log) passes on the same memory."""
    from dataclasses import replace

    from recycle.api import load_config
    from recycle.errors import ConfigError
    from recycle.runtime.control.preflight import check_model_memory
    from recycle.runtime.options import LaunchOptions, RecoveryOptions

    config = load_config(TINY)
    config = replace(config, workload=replace(config.workload, num_microbatches=512, seq_len=64))
    iteration = LaunchOptions(recovery=RecoveryOptions(redo="iteration"))
    lost = LaunchOptions(recovery=RecoveryOptions(redo="lost"))
    # Find the memory the stages need without the log, then give exactly that.
    low, high = 10**5, 10**11
    while high - low > 1:
        middle = (low + high) // 2
        try:
            check_model_memory(config, iteration, available=middle)
            high = middle
        except ConfigError:
            low = middle
    check_model_memory(config, iteration, available=high)
    with pytest.raises(ConfigError, match="with --redo lost .* keeps what it sent in its two newest iterations"):
        check_model_memory(config, lost, available=high)


@pytest.mark.parametrize("args,needle", [
    (["--set", "model.n_embd=16384", "--set", "model.n_layer=1024"], "each of its 1 worker(s) builds the whole model"),
    (["--repeats", "1000000000"], "--repeats 1000000000 is above the limit of 10,000"),
    (["--warmup", "1000000000"], "--warmup 1000000000 is above the limit of 10,000"),
])
def test_profile_is_bounded(tmp_path: Path, capsys, monkeypatch, args: list[str], needle: str) -> None:
    from recycle.runtime.control import preflight

    monkeypatch.setattr(preflight, "_mem_available", lambda: 8 * 10**9)
    fails_cleanly(capsys, ["profile", "--config", TINY, "--out", str(tmp_path / "p.toml"), *args], needle)


# -- item 3: failure states planned ahead ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,needle", [
    # enumerate_keys filtered all 2^200 (or 4^1000) tuples: it never ended
    (["train", "--config", TINY, "--set", "topology.num_stages=200", "--set", "model.n_layer=200"],
     "--max-failures 2 over D=2 x S=200 is more than 10,000 failure states to plan ahead"),
    (["plan", "--config", TOY, "--set", "topology.num_stages=1000", "--max-failures", "3", "--out", "{tmp}/store"],
     "--max-failures 3 over D=3 x S=1000 is more than 10,000 failure states"),
    (["train", "--config", TINY, "--set", "topology.num_stages=120", "--set", "model.n_layer=120", "--set",
      "topology.num_replicas=3"], "is more than 10,000 failure patterns across pipelines"),
])
def test_failure_states_planned_ahead_are_bounded(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    fails_cleanly(capsys, [a.format(tmp=tmp_path) for a in argv], needle)
    assert not (tmp_path / "store").exists()


def test_failure_keys_are_enumerated_within_the_budget() -> None:
    import itertools

    from recycle.planner.failures import enumerate_keys

    for D, S, F in itertools.product(range(1, 5), range(1, 6), range(-1, 8)):
        cap = min(D - 1, F)
        want = [k for k in itertools.product(range(cap + 1), repeat=S) if sum(k) <= F] if F >= 0 else []
        assert list(enumerate_keys(D, S, F)) == want, (D, S, F)
    assert sum(1 for _ in enumerate_keys(8, 64, 2)) == 1 + 64 * 2 + 64 * 63 // 2  # 3^64 tuples were filtered


@pytest.mark.parametrize("argv,needle", [
    (["schedule", "--config", TOY, "--iterations", "100000000"],
     "--iterations = 100000000 is above the limit of 1,000"),
    (["schedule", "--config", TOY, "--iterations", "1000", "--set", "topology.num_replicas=1000", "--set",
      "workload.num_microbatches=100"], "--iterations 1000 x 400,000 (stage, micro-batch) pairs"),
    (["plan", "--config", TOY, "--fail", "0:0", "--solver", "exact", "--time-limit", "nan"],
     "--time-limit nan must be a number of seconds in (0, 86400]"),
])
def test_schedule_and_plan_options_are_bounded(capsys, argv: list[str], needle: str) -> None:
    fails_cleanly(capsys, argv, needle)
