"""Recovery when the failed peer does nothing, measured side by side in one run on real gloo processes: a SIGKILLed
worker (its sockets close), a frozen worker that cannot be killed (SIGSTOP, sockets open) with the survivors cutting
their own generation and, as before that existed, without the cut, a stuck main thread whose heartbeat goes on, and
a whole frozen node (two launchers on 127.0.0.1).

Run: .venv/bin/python benchmarks/bench_frozen_peers.py [--repeats 3] [--heartbeat-timeout 2]

Job: the tiny GPT, D=2 x S=2, M=2, float64, zb-h1 with the staggered optimizer, --timeout 30 s (the frozen node:
configs/tiny-gpt.toml, two launchers, paced at 20 ms per slot). Each case injects
one fault at step 3 and reports "resumed": the fault -> every worker started its first action of the new plan
(Recovery.resumed_s, the same number the recovery line prints), and for the hang its detection time.
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
import time
from pathlib import Path

from recycle.config import parse_config
from recycle.ir import Kind, Plan
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, FaultOptions, LaunchOptions, RecoveryOptions
from recycle.runtime.tools.faults import FaultInjection
from recycle.schedules.fault_free import build_schedule

ROOT = Path(__file__).resolve().parents[1]
OP_TIMEOUT_S = 30.0
FAULT_STEP = 2  # 0-based: the fault lands in step 3


def config(steps: int):
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": steps, "lr": 0.01, "dtype": "float64", "seed": 5},
    }, name="bench-frozen-peers")


def first(plan: Plan, worker: tuple[int, int], kind: Kind) -> int:
    return next(i for i, a in enumerate(plan.actions[plan.rank(*worker)]) if a.kind is kind)


def run_case(mode: str, kind: Kind, env: dict[str, str], heartbeat_timeout_s: float,
             hang_timeout_s: float | None = None) -> tuple[float, float | None, str]:
    cfg = config(6)
    plan = build_schedule(cfg, "zb-h1", staggered=True)
    library = PlanLibrary.build(cfg, PlannerOptions(), max_failures=2)
    worker = (1, 0)
    fault = FaultInjection(FAULT_STEP, first(plan, worker, kind), mode=mode)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = launch(cfg, plan, LaunchOptions(
            recovery=RecoveryOptions(timeout_s=OP_TIMEOUT_S, heartbeat_timeout_s=heartbeat_timeout_s, heartbeat_s=0.25,
                                     hang_timeout_s=hang_timeout_s),
            cluster=ClusterOptions(start_method="spawn"),  # workers see os.environ now
            faults=FaultOptions(injections=((plan.rank(*worker), fault),)), plan_provider=library.lookup,
            progress=None))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    (recovery,) = result.recoveries
    return recovery.resumed_s, recovery.detected_s, recovery.formation


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def frozen_node(heartbeat_timeout_s: float) -> float:
    """Two launchers (configs/tiny-gpt.toml: D=2 x S=2); node 1's launcher and workers are SIGSTOPped after step 4.
    Measured here: the SIGSTOP -> node 0 prints its recovery line (printed once every worker has started the new
    plan; the line itself times from the detection: the coordinator cannot know when a freeze began)."""
    common = [sys.executable, "-m", "recycle", "train", "--config", str(ROOT / "configs" / "tiny-gpt.toml"), "--steps",
              "16", "--nnodes", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(_free_port()), "--timeout", str(OP_TIMEOUT_S), "--heartbeat-timeout",
              str(heartbeat_timeout_s), "--emulate-costs", "--slot-ms", "20"]
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    node0 = subprocess.Popen([*common, "--node-rank", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    node1 = subprocess.Popen([*common, "--node-rank", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    frozen: list[int] = []
    frozen_at = 0.0
    resumed_at = None
    try:
        for line in node0.stdout:
            if not frozen and "step 4/16" in line:
                frozen = [node1.pid, *_children(node1.pid)]
                frozen_at = time.time()
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
            elif frozen and "training resumed" in line:
                resumed_at = time.time()
                break
        node0.wait(timeout=120)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proc in (node0, node1):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if resumed_at is None:
        raise SystemExit("the frozen-node run printed no recovery line")
    return resumed_at - frozen_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the frozen worker without the cut (30 s)")
    args = parser.parse_args()
    hb = args.heartbeat_timeout
    unfenceable = {"RECYCLE_TEST_UNFENCEABLE": "2"}  # rank of worker 1:0
    cases: list[tuple[str, str, Kind, dict[str, str], float | None]] = [
        ("SIGKILL before F", "kill", Kind.F, {}, None),
        ("SIGKILL before OPT", "kill", Kind.OPT, {}, None),
        ("frozen, unkillable, before F (cut)", "hang", Kind.F, unfenceable, None),
        ("frozen, unkillable, before OPT (cut)", "hang", Kind.OPT, unfenceable, None),
        ("stuck main thread, --hang-timeout 2", "stall", Kind.B, {}, 2.0),
    ]
    if not args.no_baseline:
        cases.append(("frozen, unkillable, before F, NO cut (old path)", "hang", Kind.F,
                      {**unfenceable, "RECYCLE_TEST_NO_CUT": "1"}, None))
    summary: dict[str, dict[str, float]] = {}
    print(f"{'case':<50} {'resumed s (median, max)':>24} {'detected s':>11} {'groups':>14}")
    for name, mode, kind, env, hang in cases:
        repeats = 1 if "NO cut" in name else args.repeats
        runs = [run_case(mode, kind, env, hb, hang) for _ in range(repeats)]
        resumed = [r[0] for r in runs]
        detected = [r[1] for r in runs if r[1] is not None]
        summary[name] = {"resumed_median_s": statistics.median(resumed), "resumed_max_s": max(resumed),
                         "detected_median_s": statistics.median(detected) if detected else float("nan")}
        print(f"{name:<50} {statistics.median(resumed):>12.2f} {max(resumed):>10.2f} "
              f"{summary[name]['detected_median_s']:>11.2f} {runs[-1][2]:>14}", flush=True)
    node = [frozen_node(hb) for _ in range(max(1, args.repeats - 1))]
    summary["frozen node (launcher + workers SIGSTOPped)"] = {"resumed_median_s": statistics.median(node),
                                                              "resumed_max_s": max(node)}
    print(f"{'frozen node (launcher + workers SIGSTOPped)':<50} {statistics.median(node):>12.2f} {max(node):>10.2f}")
    cut = summary["frozen, unkillable, before F (cut)"]["resumed_median_s"]
    if not args.no_baseline:
        old = summary["frozen, unkillable, before F, NO cut (old path)"]["resumed_median_s"]
        print(f"frozen worker: {old:.2f} s without the cut -> {cut:.2f} s with it ({old / cut:.1f}x faster); "
              f"goal <= heartbeat timeout + 1 s = {hb + 1:.1f} s: {'met' if cut <= hb + 1 else 'NOT met'}")
    print(json.dumps({"heartbeat_timeout_s": hb, "op_timeout_s": OP_TIMEOUT_S, "cases": summary}))


if __name__ == "__main__":
    main()
