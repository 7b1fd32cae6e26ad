"""A tied Hugging Face model on threads over the in-memory transport: the first and last stage sum the shared weight's
gradient over the tied group (their live workers), so fault-free and adaptive plans (a dead worker's micro-batches
re-routed), with and without clipping, end at the tied model trained whole; without that sum they would not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recycle.config import parse_config
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.tools.fakes import MemoryFabric, run_ranks_in_threads
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.runtime.worker.stage import build_stage, tied_stages
from recycle.runtime.worker.transport import tied_ranks
from recycle.schedules.fault_free import build_schedule

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HEAD, EMBEDDING = "model.lm_head.weight", "model.model.embed_tokens.weight"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tied_config(tmp_path: Path, D: int, S: int, family: str = "llama", **training: object):
    raw = json.loads((EXAMPLES / f"hf-tiny-{family}.json").read_text())
    raw["tie_word_embeddings"] = True
    hf = tmp_path / f"tied-{family}.json"
    hf.write_text(json.dumps(raw))
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"hf_config": str(hf)},
        "training": {"steps": 2, "lr": 0.01, "weight_decay": 0.1, "dtype": "float64", "seed": 3, **training},
    }, name="tied")


def run_in_threads(config, plan, tied: tuple[int, ...]) -> dict[int, torch.nn.Module]:
    fabric = MemoryFabric.for_plan(plan, tied_stages=tied)
    load = data_source(config)
    # Built one after another: initialisation seeds the global generator per module (a worker is a process).
    built_stages = {rank: build_stage(config, plan.worker(rank)[1]) for rank in plan.live_ranks()}
    modules = {}

    def work(rank: int) -> None:
        built = built_stages[rank]
        module = modules[rank] = built.module
        executor = StageExecutor(plan, rank, module, make_optimizer(module, config.training),
                                 fabric.endpoint(rank), load, built.input_shape, built.output_shape,
                                 torch.float64, grad_clip=config.training.grad_clip, loss_fn=built.loss_fn)
        for step in range(config.training.steps):
            executor.run_iteration(step)

    run_ranks_in_threads(plan.live_ranks(), work, fabric.cut, 120)
    return modules


def max_error(modules, plan, reference) -> float:
    worst = 0.0
    for rank in plan.live_ranks():
        for key, value in modules[rank].state_dict().items():
            worst = max(worst, float((value - reference[key]).abs().max()))
    return worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("down,clip", [(frozenset(), 0.0), (frozenset({(1, 2)}), 0.0), (frozenset({(0, 0)}), 0.05)])
def test_tied_stages_on_threads_match_the_tied_model_trained_whole(tmp_path, down, clip: float) -> None:
    from recycle.planner.api import make_plan  # tests may use the planner; the runtime may not

    config = tied_config(tmp_path, D=2, S=3, grad_clip=clip)
    plan = make_plan(config, down, solver="heuristic") if down else build_schedule(config, "zb-h1", staggered=True)
    assert tied_stages(config) == (0, 2)
    modules = run_in_threads(config, plan, (0, 2))
    reference, _ = reference_train(config)
    assert max_error(modules, plan, reference) <= 1e-9
    for rank in plan.live_ranks():  # every copy of the tied weight, on both ends, is the one trained weight
        state = modules[rank].state_dict()
        for key in (HEAD, EMBEDDING):
            if key in state:
                assert float((state[key] - reference[key]).abs().max()) <= 1e-9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2"])
def test_every_family_trains_tied_on_threads_like_the_whole_model(tmp_path, family: str) -> None:
    config = tied_config(tmp_path, D=2, S=2, family=family)
    plan = build_schedule(config, "zb-h1", staggered=True)
    modules = run_in_threads(config, plan, tied_stages(config))
    assert max_error(modules, plan, reference_train(config)[0]) <= 1e-9


@pytest.mark.timeout(120)
def test_without_the_tied_sum_each_end_trains_its_own_weight(tmp_path, monkeypatch) -> None:
    """The check above can fail: summing the copies' gradients per stage only leaves the two ends apart."""
    config = tied_config(tmp_path, D=2, S=2)
    plan = build_schedule(config, "zb-h1", staggered=True)
    monkeypatch.setattr(StageExecutor, "optimizer_step", _per_stage_only)
    modules = run_in_threads(config, plan, (0, 1))
    first, last = modules[plan.rank(0, 0)].state_dict()[EMBEDDING], modules[plan.rank(0, 1)].state_dict()[HEAD]
    assert float((first - last).abs().max()) > 1e-6


def _per_stage_only(self: StageExecutor, action) -> None:
    from recycle.runtime.state.optim import allreduce_grads

    allreduce_grads(self.params, lambda flat: self.comm.stage_allreduce_sum(self.stage, flat))
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)


def test_the_tied_group_is_the_live_workers_of_both_ends() -> None:
    stage_ranks = {0: [0, 6], 1: [1, 4, 7], 2: [5, 8]}  # D = 3, S = 3, workers 1:0 and 0:2 dead
    assert tied_ranks(stage_ranks, (0, 2)) == [0, 5, 6, 8]
    assert tied_ranks(stage_ranks, ()) == []
    fabric = MemoryFabric([0, 1], {0: [0], 1: [1]})  # formed without tied stages: a tied sum is a bug, not a no-op
    with pytest.raises(RuntimeError, match="without tied stages"):
        fabric.endpoint(0).tied_allreduce_sum(torch.zeros(1))


def test_a_factory_whose_stages_declare_tied_weights_is_refused(tmp_path, monkeypatch) -> None:
    """The tied group is formed for a Hugging Face model only: a factory's tied_weights would never be summed."""
    from recycle.errors import ConfigError
    from recycle.runtime.worker.stage import factory_model

    (tmp_path / "tied_factory.py").write_text(
        "import torch\n"
        "def stages(config, num_stages):\n"
        "    mods = [torch.nn.Linear(2, 2) for _ in range(num_stages)]\n"
        "    mods[0].tied_weights = ('weight',)\n"
        "    return mods\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tied_config(tmp_path, D=1, S=2)
    with pytest.raises(ConfigError, match=r"stage\(s\) \[0\] declare tied_weights, .* Hugging Face models only"):
        factory_model(config, "tied_factory:stages")
