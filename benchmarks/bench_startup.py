"""Start-up of `recycle train`: `--help` and a short run, this tree against a base commit, side by side in one run."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")


def export_base(commit: str, into: Path) -> Path:
    """The base commit's src/ as files (git archive), so both versions run from the same interpreter and venv."""
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def clean_env(src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS and not k.startswith(("SLURM_", "PET_"))}
    env["PYTHONPATH"] = str(src)  # before the editable install of this tree on sys.path
    return env


def timed(argv: list[str], src: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and every process it reaped: the workers) of one run. CPU time
    moves much less than wall time when other jobs load the machine."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: nothing blocks while we wait for the process
        process = subprocess.Popen([sys.executable, "-m", "recycle", *argv], cwd=ROOT, env=clean_env(src),
                                   stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)  # rusage of the process and the children it reaped
        elapsed = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            err.seek(0)
            raise SystemExit(f"recycle {' '.join(argv)} failed ({src}):\n{err.read().decode()}")
    return elapsed, usage.ru_utime + usage.ru_stime


def which_src(src: Path) -> str:
    """Where `import recycle` resolves with this PYTHONPATH (guards against timing the wrong tree)."""
    return subprocess.run([sys.executable, "-c", "import recycle; print(recycle.__file__)"], env=clean_env(src),
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="", help="commit to compare with (default: the merge base with main)")
    parser.add_argument("--repeats", type=int, default=3, help="short runs per version (best is reported)")
    parser.add_argument("--help-repeats", type=int, default=15, help="`--help` runs per version (best is reported)")
    parser.add_argument("--steps", type=int, default=1, help="steps of the short run")
    parser.add_argument("--config", default="configs/tiny-gpt.toml")
    args = parser.parse_args()
    base = args.base or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"before": export_base(base, Path(tmp) / "base"), "after": ROOT / "src"}
        for name, src in srcs.items():
            assert which_src(src).startswith(str(src)), f"{name}: recycle imported from {which_src(src)}"
        board = Path(tmp) / "tb"
        cases = {
            "train --help": lambda: ["train", "--help"],
            f"train {args.steps} step(s)": lambda: ["train", "--config", args.config, "--steps", str(args.steps)],
        }
        best: dict[tuple[str, str], tuple[float, float]] = {}

        def keep(key: tuple[str, str], measured: tuple[float, float]) -> None:
            old = best.get(key, (float("inf"), float("inf")))
            best[key] = (min(old[0], measured[0]), min(old[1], measured[1]))

        run_case = f"train {args.steps} step(s)"
        for case, repeats in (("train --help", args.help_repeats), (run_case, args.repeats)):
            for repeat in range(repeats):
                # Interleaved, in alternating order, so load changes and warm caches hit both versions alike.
                order = list(srcs.items()) if repeat % 2 == 0 else list(reversed(srcs.items()))
                for name, src in order:
                    keep((case, name), timed(cases[case](), src))
                if case == run_case:
                    keep(("+ --tensorboard", "after"), timed([*cases[run_case](), "--tensorboard", str(board)],
                                                             srcs["after"]))
    print(f"recycle start-up, best of {args.help_repeats} (--help) and {args.repeats} (runs), a fresh interpreter each; "
          f"before = {base[:10]}; load average "
          f"{os.getloadavg()[0]:.1f}); wall seconds, and CPU seconds of the whole process tree in brackets:")
    print(f"{'case':<30}{'before':>16}{'after':>16}{'after/before':>16}")
    for case in cases:
        (bw, bc), (aw, ac) = best[case, "before"], best[case, "after"]
        print(f"{case:<30}{bw:>7.2f} [{bc:>6.2f}]{aw:>7.2f} [{ac:>6.2f}]{aw / bw:>7.2f} [{ac / bc:>6.2f}]")
    (tw, tc), (aw, ac) = best["+ --tensorboard", "after"], best[run_case, "after"]
    print(f"{run_case + ' --tensorboard':<30}{'':>16}{tw:>7.2f} [{tc:>6.2f}]{tw / aw:>7.2f} [{tc / ac:>6.2f}]  "
          "(vs after without it)")


if __name__ == "__main__":
    main()
