"""Activation checkpointing ([model] activation_checkpointing): the config key and flag, gradients through the
executor's split backward (F, then B, then W) equal to the unchecked stage's, the saved-tensor bytes a micro-batch
keeps measured lower, and the profiled memory giving the planner a larger cap and another plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.config import CHECKPOINTING_MODES as MODES
from recycle.config import parse_config
from recycle.errors import ConfigError
from recycle.ir import Action, Kind
from recycle.models.checkpointing import set_mode
from recycle.planner.api import plan_for_key
from recycle.planner.memory_cap import budget_memory_cap
from recycle.planner.options import PlannerOptions
from recycle.runtime.protocol.messages import Channel
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.tools.fakes import LoneComm
from recycle.runtime.tools.profiler import _profiling_plan, profile_stages, profiled_config_dict, DEFAULT_COMM, Profile
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.runtime.worker.stage import build_stage

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _raw(S: int = 2, model: dict | None = None, memory: dict | None = None, dtype: str = "float64") -> dict:
    raw = {"topology": {"num_replicas": 2, "num_stages": S},
           "workload": {"num_microbatches": 4, "microbatch_size": 2, "seq_len": 16},
           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
           "model": {"n_layer": 4, "n_embd": 32, "n_head": 2, **(model or {})},
           "training": {"dtype": dtype, "seed": 3}}
    if memory:
        raw["memory"] = memory
    return raw


def test_the_mode_defaults_to_none_and_a_bad_one_names_value_rule_and_fix() -> None:
    assert parse_config(_raw()).model.activation_checkpointing == "none"
    assert parse_config(_raw(model={"activation_checkpointing": "per_layer"})).model.activation_checkpointing == \
        "per_layer"
    with pytest.raises(ConfigError, match=r"\[model\] activation_checkpointing = 'layers' must be one of 'none', "
                                          r"'full', 'per_layer' \('full': keep each stage's input"):
        parse_config(_raw(model={"activation_checkpointing": "layers"}))


def test_the_rebuilt_region_must_fit_the_budget_beside_one_micro_batch() -> None:
    memory = {"activation_bytes": [100, 100], "recompute_bytes": [300, 50], "capacity_bytes": 350}
    with pytest.raises(ConfigError, match=r"recompute_bytes\]?.*stage 0 needs 100 bytes per micro-batch plus 300 "
                                          r"rebuilt in a backward, more than capacity_bytes = 350; raise"):
        parse_config(_raw(memory=memory))
    config = parse_config(_raw(memory={**memory, "capacity_bytes": 400}))
    assert budget_memory_cap(config) == (1, 3)  # (400 - 300) // 100, (400 - 50) // 100


def test_the_train_and_profile_flag_overrides_the_config() -> None:
    from recycle.cli import build_parser
    from recycle.commands import checkpointing_override

    parser = build_parser()
    args = parser.parse_args(["train", "--config", "x.toml", "--activation-checkpointing", "full"])
    assert checkpointing_override(args) == ['model.activation_checkpointing="full"']
    assert checkpointing_override(parser.parse_args(["profile", "--config", "x", "--out", "y"])) == []
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--config", "x.toml", "--activation-checkpointing", "layers"])


def test_a_factory_stage_cannot_be_checkpointed_by_recycle() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing = 'full': stage 1 \(Linear\) is not a built-in "
                                          r"GPT or Hugging Face stage.*set it to 'none'"):
        set_mode(torch.nn.Linear(2, 2), "full", "stage 1")
    set_mode(torch.nn.Linear(2, 2), "none")  # nothing to do


def _hf_raw(tmp_path: Path, family: str, mode: str) -> dict:
    spec = json.loads((EXAMPLES / f"hf-tiny-{family}.json").read_text())
    spec["tie_word_embeddings"] = True  # the tied weight's two copies are checkpointed on both end stages
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(spec))
    raw = _raw(model={"hf_config": str(path), "activation_checkpointing": mode})
    del raw["model"]["n_layer"], raw["model"]["n_embd"], raw["model"]["n_head"]
    return raw


def _split_backward_grads(raw: dict, stage: int) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """One micro-batch through the real executor as F, then B, then W (the RNG moved on between them): the
    input-gradient B sends and the weight-gradients W accumulates."""
    config = parse_config(raw)
    built = build_stage(config, stage)
    plan = _profiling_plan(config.num_stages)
    generator = torch.Generator().manual_seed(11)
    upstream = None if built.input_shape is None else torch.randn(built.input_shape, generator=generator,
                                                                  dtype=torch.float64)
    grad_seed = None if built.output_shape is None else torch.randn(built.output_shape, generator=generator,
                                                                    dtype=torch.float64)
    comm = LoneComm({Channel.ACTIVATION: upstream, Channel.GRADIENT: grad_seed})
    executor = StageExecutor(plan, stage, built.module, make_optimizer(built.module, config.training), comm,
                             data_source(config), built.input_shape, built.output_shape, torch.float64,
                             seed=config.training.seed, loss_fn=built.loss_fn)
    executor.run_action(Action(Kind.F, stage, 0))
    torch.manual_seed(1234)  # a checkpoint must replay F's dropout, not draw from wherever the RNG is now
    comm.last_sent = None
    executor.run_action(Action(Kind.B, stage, 0))
    grad_in = comm.last_sent
    executor.run_action(Action(Kind.W, stage, 0))
    return grad_in, [p.grad.clone() for p in executor.params]


@pytest.mark.parametrize("mode", ["full", "per_layer"])
@pytest.mark.parametrize("stage", [0, 1])
def test_gpt_gradients_through_the_split_backward_equal_the_unchecked_stage(mode: str, stage: int) -> None:
    raw = _raw(model={"dropout": 0.2})  # dropout: the recompute must draw the same masks
    ref_in, ref_grads = _split_backward_grads(raw, stage)
    raw["model"]["activation_checkpointing"] = mode
    grad_in, grads = _split_backward_grads(raw, stage)
    assert (grad_in is None) == (stage == 0)
    if grad_in is not None:
        assert torch.equal(grad_in, ref_in)
    assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert any(float(g.abs().max()) > 0 for g in grads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["full", "per_layer"])
def test_hf_tied_gradients_through_the_split_backward_equal_the_unchecked_stage(tmp_path, monkeypatch, family: str,
                                                                                mode: str) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for stage in (0, 1):  # both hold a copy of the tied embedding
        ref_in, ref_grads = _split_backward_grads(_hf_raw(tmp_path, family, "none"), stage)
        grad_in, grads = _split_backward_grads(_hf_raw(tmp_path, family, mode), stage)
        if stage == 1:
            assert grad_in is not None and ref_in is not None
            assert float((grad_in - ref_in).abs().max()) <= 1e-12
        assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) <= 1e-12


def _profiles(raw: dict) -> dict[str, tuple]:
    config = parse_config(raw)
    return {mode: profile_stages(replace(config, model=replace(config.model, activation_checkpointing=mode)),
                                 repeats=1, warmup=1) for mode in MODES}


def test_the_measured_saved_bytes_per_micro_batch_are_lower_with_checkpointing() -> None:
    profiles = _profiles(_raw(dtype="float32"))
    for s in range(2):
        none, full, per_layer = (profiles[m][s] for m in MODES)
        assert full.activation_bytes < per_layer.activation_bytes < none.activation_bytes, s
        assert none.recompute_bytes == 0 < per_layer.recompute_bytes < full.recompute_bytes, s
        assert full.activation_bytes * 4 < none.activation_bytes  # a live micro-batch keeps its boundary tensors


def test_under_a_budget_the_checkpointed_profile_admits_a_larger_cap_and_another_plan() -> None:
    raw = _raw(dtype="float32")
    profiles = _profiles(raw)
    config = parse_config(raw)
    budget = 2 * max(p.activation_bytes for p in profiles["none"])  # two unchecked micro-batches per worker
    configs = {}
    for mode in ("none", "full"):
        mode_config = replace(config, model=replace(config.model, activation_checkpointing=mode))
        profiled = profiled_config_dict(mode_config, Profile(profiles[mode], DEFAULT_COMM, 1, 0, 1))
        profiled["memory"]["capacity_bytes"] = budget
        configs[mode] = parse_config(profiled)
    caps = {mode: budget_memory_cap(c) for mode, c in configs.items()}
    assert caps["none"] is not None and caps["full"] is not None
    assert all(c <= 2 for c in caps["none"]) and all(f > n for f, n in zip(caps["full"], caps["none"]))
    key = (0, 1)  # one worker of stage 1 down: its micro-batches re-routed to the survivor
    plans = {mode: plan_for_key(c, key, PlannerOptions()) for mode, c in configs.items()}
    assert plans["full"].meta.memory_cap == caps["full"] and plans["none"].meta.memory_cap == caps["none"]
    assert plans["full"].meta.predicted_period != plans["none"].meta.predicted_period


def test_profile_with_the_flag_writes_the_checkpointed_memory(tmp_path, capsys) -> None:
    from recycle.cli import main

    config, out = tmp_path / "c.toml", tmp_path / "costs.toml"
    config.write_text('[topology]\nnum_replicas = 2\nnum_stages = 2\n[workload]\nnum_microbatches = 2\nseq_len = 16\n'
                      '[costs]\nforward = 1\nbackward_input = 1\nbackward_weight = 1\n'
                      '[model]\nn_layer = 2\nn_embd = 16\nn_head = 2\n')
    assert main(["profile", "--config", str(config), "--out", str(out), "--activation-checkpointing", "per_layer",
                 "--comm", "defaults", "--repeats", "1", "--warmup", "0"]) == 0
    assert "activation checkpointing 'per_layer'" in capsys.readouterr().out
    from recycle.config import load_config

    profiled = load_config(out)
    assert profiled.model.activation_checkpointing == "per_layer"
    assert all(b > 0 for b in profiled.memory.recompute_bytes)


def test_train_with_a_factory_and_checkpointing_is_one_error_line(capsys, monkeypatch) -> None:
    from recycle.cli import main

    monkeypatch.syspath_prepend(str(EXAMPLES))

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml"
    assert main(["train", "--config", str(config), "--model-factory", "pipelining_split:stages",
                 "--activation-checkpointing", "full", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "activation_checkpointing = 'full'" in err, err


def test_the_simulated_peak_bytes_count_the_rebuilt_region_once() -> None:
    from recycle.schedules.fault_free import build_schedule
    from recycle.sim.simulator import simulate

    memory = {"activation_bytes": [100, 100], "recompute_bytes": [1000, 10], "capacity_bytes": 0}
    config = parse_config(_raw(memory=memory))
    result = simulate(build_schedule(config, "1f1b"), config)
    assert result.peak_activation_bytes == tuple(peak * 100 + (1000 if s == 0 else 10)
                                                 for peak, s in zip(result.peak_activations, (0, 1, 0, 1)))


def test_a_stage_rebuilt_by_a_layer_move_keeps_its_mode() -> None:
    from recycle.runtime.state.migration import rebuild_stage
    from recycle.runtime.state.stage_state import IterationPosition, StageState

    config = parse_config(_raw(model={"activation_checkpointing": "per_layer"}))
    built = build_stage(config, 1)
    state = StageState(built.module, make_optimizer(built.module, config.training), 1, IterationPosition())
    rebuilt = rebuild_stage(state, (2, 4), {}, lambda m: make_optimizer(m, config.training))
    assert rebuilt.module is not built.module and rebuilt.module.activation_checkpointing == "per_layer"


def test_a_config_without_rebuilt_bytes_keeps_its_fingerprint() -> None:
    """Plan stores carry the config's fingerprint: the new key changes it only where it is set."""
    plain = parse_config(_raw(memory={"activation_bytes": [100, 100]}))
    assert "recompute_bytes" not in plain.planning_dict()["memory"]
    rebuilt = parse_config(_raw(memory={"activation_bytes": [100, 100], "recompute_bytes": [50, 0]}))
    assert rebuilt.planning_dict()["memory"]["recompute_bytes"] == (50, 0)
    assert rebuilt.fingerprint() != plain.fingerprint()
