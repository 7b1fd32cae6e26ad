"""The restartable coordinator (issue 23 item 2): does training go on while `recycle coordinator` is away, and how
long does a restarted one take to take the run over?

Real processes: `recycle coordinator` and one training node (`recycle train --coordinator separate`, D=2 x S=2 tiny
GPT, costs emulated at --slot-ms per slot). The coordinator is SIGKILLed after step --kill-after and started again
with the same command --away seconds later. From the --metrics file (the restarted coordinator reports the steps run
while it was away, from the records the workers kept) it measures, side by side in one run:
- the steps completed while no coordinator ran, and their median step period against the steps before the kill;
- restart -> "took over the run" (the rebuild from the launchers' and workers' reports);
- the final parameters against the same run without a restart (bit for bit) and the single-process reference.
Last line: a JSON summary.

Run: .venv/bin/python benchmarks/bench_coordinator_restart.py [--away 8] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from recycle.config import load_config  # noqa: E402
from recycle.runtime.tools.reference import reference_train  # noqa: E402

CONFIG = """
[topology]
num_replicas = 2
num_stages = 2
[workload]
num_microbatches = 2
microbatch_size = 2
seq_len = 8
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[model]
preset = "tiny"
[training]
steps = {steps}
lr = 0.01
dtype = "float64"
"""

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(process: subprocess.Popen, text: str, timeout_s: float) -> float:
    """Read `process`'s stdout until a line holds `text`; the wall clock then."""
    deadline = time.time() + timeout_s
    assert process.stdout is not None
    while time.time() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if text in line:
            return time.time()
    raise SystemExit(f"no line with {text!r} within {timeout_s} s")


def run(config_file: Path, tmp: Path, args: argparse.Namespace, kill: bool) -> dict[str, object]:
    """One run of the job; with `kill`, the coordinator is SIGKILLed after step --kill-after and started again
    --away s later."""
    metrics, save = tmp / f"metrics-{kill}.jsonl", tmp / f"final-{kill}.pt"
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24), "PYTHONPATH": str(ROOT / "src")}
    flags = ["--config", str(config_file), "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--heartbeat-timeout", "2", "--save", str(save), "--metrics", str(metrics)]

    def start(*command: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "recycle", *command], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    first = start("coordinator", *flags)
    node = start("train", *flags, "--coordinator", "separate", "--node-rank", "0", "--emulate-costs",
                 "--slot-ms", str(args.slot_ms))
    second = None
    killed = restarted = took_over = float("inf")
    try:
        if kill:
            wait_for(first, f"step {args.kill_after}/", 300)
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed = time.time()
            time.sleep(args.away)
            restarted = time.time()
            second = start("coordinator", *flags)
            took_over = wait_for(second, "took over the run", 120)
            second.communicate(timeout=600)
        else:
            first.communicate(timeout=600)
        node.communicate(timeout=120)
    finally:
        for process in (first, node, second):
            if process is not None and process.poll() is None:
                process.kill()
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"event"' not in line]
    import torch

    ref, _ = reference_train(load_config(config_file))
    got = torch.load(save, weights_only=True)["model"]
    reported = sorted(s["step"] for s in steps)
    away = [s["period_s"] for s in steps if killed <= s["end_time"] < restarted]
    return {
        "steps_reported": len(reported), "steps_reported_twice": len(reported) - len(set(reported)),
        "period_ms": round(1e3 * statistics.median(s["period_s"] for s in steps if s["step"] > 1), 1),
        "steps_done_while_away": len(away),
        "period_while_away_ms": round(1e3 * statistics.median(away), 1) if away else None,
        "restart_to_takeover_s": round(took_over - restarted, 2) if kill else None,
        "max_rel_err": max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-after", type=int, default=5)
    parser.add_argument("--away", type=float, default=8.0)
    parser.add_argument("--slot-ms", type=float, default=40.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "job.toml"
        config_file.write_text(CONFIG.format(steps=args.steps))
        baseline = run(config_file, Path(tmp), args, kill=False)
        restart = run(config_file, Path(tmp), args, kill=True)
        import torch

        a, b = (torch.load(Path(tmp) / f"final-{kill}.pt", weights_only=True)["model"] for kill in (False, True))
        restart["bit_identical_to_baseline"] = all(torch.equal(a[k], b[k]) for k in a)
    print(f"no restart:  {baseline['steps_reported']} steps reported, period {baseline['period_ms']} ms, max rel "
          f"err vs reference {baseline['max_rel_err']:.1e}")
    print(f"restart:     coordinator away {args.away:g} s, {restart['steps_done_while_away']} steps trained "
          f"meanwhile (period {restart['period_while_away_ms']} ms); restart -> took over "
          f"{restart['restart_to_takeover_s']} s; {restart['steps_reported']} steps reported "
          f"({restart['steps_reported_twice']} twice), period {restart['period_ms']} ms, max rel err "
          f"{restart['max_rel_err']:.1e}; parameters bit-identical to the run without a restart: "
          f"{restart['bit_identical_to_baseline']}")
    print(json.dumps({"steps": args.steps, "away_s": args.away, "baseline": baseline, "restart": restart}))


if __name__ == "__main__":
    main()
