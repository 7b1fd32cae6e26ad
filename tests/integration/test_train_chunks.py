"""`recycle train` on chunked plans (several model chunks per worker, interleaved and V layouts) ends with the
single-process reference's parameters: fault-free, with a worker down from the start, with a worker SIGKILLed
mid-run, re-joined after a kill, with a whole worker position lost and restored from the checkpoint, and across
--resume between chunked and unchunked runs; held-out evaluations equal the reference's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.api import select_plan
from recycle.cli import main
from recycle.config import Config, load_config
from recycle.ir.plan import Plan
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import (ClusterOptions, DebugOptions, LaunchOptions, OutputOptions, RecoveryOptions,
                                     with_keywords)
from recycle.runtime.tools.reference import reference_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.timing]


def chunked(config: Config, layout: str) -> Config:
    return replace(config, topology=replace(config.topology, chunks_per_worker=2, chunk_layout=layout))


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)


def train_and_check(config: Config, down: tuple[str, ...], tmp_path: Path, decoupled: bool = True,
                    staggered: bool = True) -> None:
    plan = select_plan(config, down=down, decoupled=decoupled, staggered=staggered)
    assert plan.chunks == 2 and plan.failed == {tuple(int(x) for x in w.split(":")) for w in down}
    assert bool(plan.decoupled_pairs) == decoupled and plan.staggered == staggered
    runs_exactly(config, plan, tmp_path)


def runs_exactly(config: Config, plan: Plan, tmp_path: Path) -> None:
    """`plan` trained by the runtime ends at the single-process reference's parameters (1e-9) and losses, with the
    live replicas of each worker position bit-identical after every step."""
    save = tmp_path / "final.pt"
    result = launch(config, plan, LaunchOptions(outputs=OutputOptions(save_path=str(save)),
                                                debug=DebugOptions(verify_replicas=True),
                                                recovery=RecoveryOptions(timeout_s=30),
                                                cluster=ClusterOptions(start_method="forkserver"), progress=None))
    ref, ref_losses = reference_train(config)
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9
    assert [round(s.loss, 9) for s in result.steps] == [round(x, 9) for x in ref_losses]
    for metrics in result.steps:  # the live replicas of each worker position stay bit-identical
        for s in range(plan.num_stages):
            assert len({metrics.digests[f"{p}:{s}"] for p in plan.live_replicas(s)}) == 1, (metrics.step, s)


@pytest.mark.parametrize("layout", ["interleaved", "v"])
@pytest.mark.parametrize("D", [1, 2])
def test_fault_free_chunked_plans_match_the_reference(tiny_config, layout: str, D: int, tmp_path: Path) -> None:
    train_and_check(chunked(tiny_config(D=D, S=2, M=2, seed=11), layout), (), tmp_path)


@pytest.mark.parametrize("layout", ["interleaved", "v"])
def test_fused_backward_and_coupled_optimizer_match_the_reference(tiny_config, layout: str, tmp_path: Path) -> None:
    """--no-decouple (BW: interleaved 1F1B) and --no-stagger (every worker steps after the last backward)."""
    train_and_check(chunked(tiny_config(D=2, S=2, M=2, seed=11), layout), (), tmp_path, decoupled=False,
                    staggered=False)


@pytest.mark.parametrize("layout", ["interleaved", "v"])
def test_a_chunked_plan_with_a_worker_down_matches_the_reference(tiny_config, layout: str, tmp_path: Path) -> None:
    """Worker 1:1's two chunks' micro-batches run on worker 0:1, which holds the same two chunks."""
    train_and_check(chunked(tiny_config(D=2, S=2, M=2, seed=11), layout), ("1:1",), tmp_path)


def chunked_file(tiny_config_file, layout: str, steps: int) -> Path:
    path = tiny_config_file(steps=steps)
    text = path.read_text().replace("[topology]\n", f'[topology]\nchunks_per_worker = 2\nchunk_layout = "{layout}"\n')
    path.write_text(text)
    return path


@pytest.mark.parametrize("layout,victim", [("v", "1:1"), ("interleaved", "0:0")])
def test_a_worker_killed_mid_run_is_survived_exactly(tiny_config_file, layout: str, victim: str, tmp_path: Path,
                                                     capsys) -> None:
    """A real SIGKILL (--inject) in step 2: the run switches to the plan for the worker down and ends with the
    reference's parameters (the interrupted iteration is redone whole)."""
    config_file = chunked_file(tiny_config_file, layout, steps=4)
    save = tmp_path / "final.pt"
    assert main(["train", "--config", str(config_file), "--inject", f"kill:{victim}@2.5", "--save", str(save),
                 "--start-method", "forkserver"]) == 0
    out = capsys.readouterr().out
    assert f"worker {victim}" in out and "killed by SIGKILL" in out and "the whole iteration is redone" in out
    assert f"workers down at the end: {victim}" in out
    ref, _ = reference_train(load_config(config_file))
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9


@pytest.mark.parametrize("first,second", [("v", ""), ("", "interleaved")])
def test_resume_moves_between_chunked_and_unchunked_runs(tiny_config_file, first: str, second: str,
                                                         tmp_path: Path) -> None:
    """Checkpoints keep the whole model's names: 2 steps under one chunking, 2 more under another, equal to 4
    steps of the reference."""
    config_file = tiny_config_file(steps=4)
    ck, save = tmp_path / "ck", tmp_path / "final.pt"

    def chunking(layout: str) -> list[str]:
        return ["--set", "topology.chunks_per_worker=2", "--set", f'topology.chunk_layout="{layout}"'] if layout \
            else []

    assert main(["train", "--config", str(config_file), *chunking(first), "--steps", "2", "--checkpoint-dir",
                 str(ck), "--checkpoint-every", "2", "--start-method", "forkserver"]) == 0
    assert main(["train", "--config", str(config_file), *chunking(second), "--resume", str(ck), "--save", str(save),
                 "--start-method", "forkserver"]) == 0
    ref, _ = reference_train(load_config(config_file))
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9


def test_a_stage_that_loses_every_replica_is_restored_from_the_checkpoint(tiny_config_file, tmp_path: Path,
                                                                          capsys) -> None:
    """Both workers of position 1 die (V layout): the run restores the newest checkpoint into a worker moved there
    (reshape), which builds that position's two chunks, and ends with the reference's parameters."""
    config_file = chunked_file(tiny_config_file, "v", steps=5)
    save = tmp_path / "final.pt"
    assert main(["train", "--config", str(config_file), "--inject", "kill:0:1@2.3", "--inject", "kill:1:1@4.3",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1", "--save", str(save),
                 "--start-method", "forkserver"]) == 0
    out = capsys.readouterr().out
    assert "restored checkpoint step" in out and "survived 2 failure(s)" in out
    ref, _ = reference_train(load_config(config_file))
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9


def test_a_killed_worker_re_joins_with_its_chunks_state_from_a_peer(tiny_config, tmp_path: Path) -> None:
    """Worker 1:1 (V layout: chunks 1 and 2) is killed in step 2 and brought back after step 3: the replacement
    builds its chunks and takes their state from 0:1 over the stage group; the run ends exact, nobody down."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary
    from recycle.runtime.worker.emulate import Emulation
    from recycle.runtime.worker.process import FaultInjection

    config = chunked(tiny_config(D=2, S=2, M=2, steps=10, seed=3), "v")
    plan = select_plan(config)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=2)
    options = with_keywords(LaunchOptions(), dict(
        save_path=str(tmp_path / "final.pt"), verify_replicas=True, timeout_s=30, progress=None,
        plan_provider=library.lookup, emulation=Emulation(20.0, 1.0), start_method="forkserver",
        faults=((plan.rank(1, 1), FaultInjection(1, 3)),), rejoins=((plan.rank(1, 1), 3),)))
    result = launch(config, plan, options)
    kill, join = result.recoveries
    assert kill.workers == ("1:1",) and join.joined == ("1:1",) and join.transfer_bytes > 0
    assert result.failed == ()
    ref, _ = reference_train(config)
    assert max_relative_error(torch.load(tmp_path / "final.pt", weights_only=True)["model"], ref) < 1e-9
    last = result.steps[-1]
    assert last.digests["0:1"] == last.digests["1:1"]  # the replacement's chunks are bit-identical to its peer's


@pytest.mark.parametrize("layout", ["interleaved", "v"])
def test_evaluations_of_a_chunked_run_equal_the_references(tiny_config, layout: str, tmp_path: Path) -> None:
    """[training] eval_every: the held-out loss forwarded chunk by chunk (the V's turn handed over locally), with
    worker 1:1 down so that its chunks' micro-batches are evaluated on 0:1."""
    import json

    config = chunked(tiny_config(D=2, S=2, M=2, steps=4, seed=3, eval_every=2, eval_batches=2, eval_fraction=0.2),
                     layout)
    plan = select_plan(config, down=("1:1",))
    metrics = tmp_path / "m.jsonl"
    launch(config, plan, LaunchOptions(outputs=OutputOptions(save_path=str(tmp_path / "final.pt"),
                                                             metrics_path=str(metrics)),
                                       recovery=RecoveryOptions(timeout_s=30),
                                       cluster=ClusterOptions(start_method="forkserver"), progress=None))
    evaluations: dict[int, float] = {}
    ref, _ = reference_train(config, evaluations=evaluations)
    assert max_relative_error(torch.load(tmp_path / "final.pt", weights_only=True)["model"], ref) < 1e-9
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [2, 4] == sorted(evaluations)
    for e in evals:
        assert abs(e["loss"] - evaluations[e["step"]]) <= 1e-9 * abs(evaluations[e["step"]]), e
