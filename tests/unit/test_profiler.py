"""The profiler: measured stage costs are plausible, sizes are exact, and the written "us" config loads and plans."""

from __future__ import annotations

import tomllib

import pytest

from recycle.config import load_config, parse_config
from recycle.errors import ConfigError
from recycle.models.gpt import build_stages
from recycle.runtime.tools.profiler import (_LARGE_BYTES, _SMALL_BYTES, DEFAULT_COMM, Profile, StageProfile, _fit,
                                            profile_stages, profiled_config_dict, to_toml, write_profile)
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate


def small_config(microbatch_size: int = 2, seq_len: int = 16, capacity_bytes: int = 0):
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 3, "microbatch_size": microbatch_size, "seq_len": seq_len},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "memory": {"capacity_bytes": capacity_bytes, "activation_bytes": 1},
        "model": {"preset": "tiny"},
        "training": {"dtype": "float32"},
    }, name="small", source="")


@pytest.fixture(scope="module")
def measured() -> tuple[StageProfile, ...]:
    return profile_stages(small_config(), repeats=3, warmup=1)  # a median robust to one preemption


def test_sizes_are_exact(measured) -> None:
    config = small_config()
    stages = build_stages(config.model, 2, 0, "float32", config.workload.seq_len)
    for profile, module in zip(measured, stages):
        params = sum(p.numel() * 4 for p in module.parameters())
        assert profile.parameter_bytes == params
        assert profile.optimizer_state_bytes == 2 * params  # AdamW: two moments per parameter
    boundary = 2 * 16 * 32 * 4  # micro-batch x seq x n_embd x float32
    assert measured[0].message_bytes == boundary
    assert measured[1].message_bytes == 0  # the last stage sends nothing downstream


def test_activation_bytes_count_saved_tensors_and_scale_with_the_microbatch(measured) -> None:
    boundary = 2 * 16 * 32 * 4
    for profile in measured:
        # Every layer saves several [batch, seq, n_embd] tensors (layer norms, attention, MLP): far more than the
        # stage input and output alone, and no parameter is counted.
        assert 4 * boundary < profile.activation_bytes < profile.parameter_bytes + 100 * boundary
    doubled = profile_stages(small_config(microbatch_size=4), repeats=1, warmup=0)
    for small, big in zip(measured, doubled):
        assert 1.8 < big.activation_bytes / small.activation_bytes < 2.2


def test_times_are_positive_and_stage0_b_is_only_a_delivery(measured) -> None:
    first, last = measured
    for p in measured:
        assert p.forward_us > 0 and p.backward_weight_us > 0 and p.backward_fused_us > 0 and p.optimizer_us > 0
    # Stage 0's B computes nothing (token ids have no gradient); its W is the whole backward.
    assert first.backward_input_us < 0.2 * first.backward_weight_us
    assert last.backward_input_us > 0


def test_written_config_loads_simulates_and_keeps_the_rest(measured, tmp_path) -> None:
    config = small_config()
    profile = Profile(measured, DEFAULT_COMM, repeats=2, warmup=1, threads=1)
    path, profiled = write_profile(config, profile, tmp_path / "costs.toml")
    loaded = load_config(path)
    assert loaded.time_unit == "us"
    assert loaded.planning_dict() == profiled.planning_dict()
    assert loaded.costs.forward == tuple(float(max(1, round(p.forward_us))) for p in measured)
    assert loaded.memory.activation_bytes == tuple(p.activation_bytes for p in measured)
    assert loaded.communication.gradient_bytes == tuple(p.parameter_bytes for p in measured)
    assert loaded.communication.p2p_bandwidth == DEFAULT_COMM.p2p_bandwidth
    assert (loaded.topology, loaded.workload, loaded.model, loaded.training) == \
        (config.topology, config.workload, config.model, config.training)
    assert not list(tmp_path.glob(".*tmp"))  # atomic write leaves no temp file
    result = simulate(build_schedule(loaded, "1f1b"), loaded)
    stage_work = [loaded.costs.forward[s] + loaded.costs.backward_fused[s] for s in range(2)]
    assert result.period >= 3 * max(stage_work)  # M micro-batches of F + BW on the busiest stage, at least


def test_a_budget_smaller_than_one_microbatch_is_refused_before_writing(measured, tmp_path) -> None:
    config = small_config(capacity_bytes=1000)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        write_profile(config, Profile(measured, DEFAULT_COMM, 2, 1, 1), tmp_path / "costs.toml")
    assert not (tmp_path / "costs.toml").exists()


def test_toml_writer_round_trips_strings_and_lists() -> None:
    raw = {"name": 'we"ird\\name', "time_unit": "us",
           "costs": {"forward": [1, 2], "backward_input": 1.5, "backward_weight": 0.25},
           "training": {"dataset": "a\nb"}}
    assert tomllib.loads(to_toml(raw, header="two\nlines")) == raw
    with pytest.raises(ValueError):
        to_toml({"costs": {"forward": float("inf")}})


def test_linear_fit_of_small_and_large_messages() -> None:
    latency, bandwidth = _fit(100.0, 100.0 + (_LARGE_BYTES - _SMALL_BYTES) / 1000.0)
    assert bandwidth == pytest.approx(1000.0)
    assert latency == pytest.approx(100.0 - _SMALL_BYTES / 1000.0)
    assert _fit(50.0, 40.0) == (50.0, 0.0)  # noise made the large one faster: free transfer, fixed cost only


def test_profiled_dict_resolves_a_relative_dataset(tmp_path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 50)
    cfg_path = tmp_path / "job.toml"
    cfg_path.write_text('[topology]\nnum_replicas = 1\nnum_stages = 2\n[workload]\nnum_microbatches = 2\n'
                        'seq_len = 8\n[costs]\nforward = 1\nbackward_input = 1\nbackward_weight = 1\n'
                        '[training]\ndataset = "corpus.txt"\n')
    config = load_config(cfg_path)
    stages = profile_stages(config, repeats=1, warmup=0)
    raw = profiled_config_dict(config, Profile(stages, DEFAULT_COMM, 1, 0, 1))
    assert raw["training"]["dataset"] == str(text.resolve())
