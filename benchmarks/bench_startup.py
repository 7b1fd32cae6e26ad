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


def timed(argv: list[str], src: Path) -> float:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "recycle", *argv], cwd=ROOT, env=clean_env(src),
                         capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"recycle {' '.join(argv)} failed ({src}):\n{run.stderr}")
    return elapsed


def which_src(src: Path) -> str:
    """Where `import recycle` resolves with this PYTHONPATH (guards against timing the wrong tree)."""
    return subprocess.run([sys.executable, "-c", "import recycle; print(recycle.__file__)"], env=clean_env(src),
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="", help="commit to compare with (default: the merge base with main)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (best is reported)")
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
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.repeats):
            # Interleaved, so a change of machine load hits both versions alike.
            for case, argv in cases.items():
                for name, src in srcs.items():
                    seconds = timed(argv(), src)
                    best[case, name] = min(best.get((case, name), float("inf")), seconds)
            seconds = timed([*cases[f"train {args.steps} step(s)"](), "--tensorboard", str(board)], srcs["after"])
            best["+ --tensorboard", "after"] = min(best.get(("+ --tensorboard", "after"), float("inf")), seconds)
    print(f"recycle start-up, best of {args.repeats} (fresh interpreter each; before = {base[:10]}):")
    print(f"{'case':<24}{'before (s)':>12}{'after (s)':>12}{'after/before':>14}")
    for case in cases:
        before, after = best[case, "before"], best[case, "after"]
        print(f"{case:<24}{before:>12.2f}{after:>12.2f}{after / before:>14.2f}")
    run_case = f"train {args.steps} step(s)"
    print(f"{run_case + ' --tensorboard':<24}{'':>12}{best['+ --tensorboard', 'after']:>12.2f}"
          f"{best['+ --tensorboard', 'after'] / best[run_case, 'after']:>14.2f}  (vs after without it)")


if __name__ == "__main__":
    main()
