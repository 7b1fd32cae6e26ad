"""Config loading: the shipped configs load with the documented numbers; bad input raises ConfigError naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from recycle.config import load_config, parse_config, uniform_config
from recycle.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "configs" / "toy.toml"
GPT3 = ROOT / "configs" / "gpt3-6.7b-a100.toml"


def test_toy_is_the_papers_example() -> None:
    c = load_config(TOY)
    assert (c.num_replicas, c.num_stages, c.num_microbatches) == (3, 4, 6)
    assert c.time_unit == "slot"
    assert c.costs.forward == c.costs.backward_input == c.costs.backward_weight == (1.0,) * 4
    assert c.costs.backward_fused == (2.0,) * 4 and c.costs.optimizer == (3.0,) * 4
    assert c.communication.p2p_time(0) == 0.0 and c.communication.allreduce_time(0, 3) == 0.0
    assert c.memory.capacity_bytes == 0


def test_gpt3_config_numbers_follow_from_its_stated_derivation() -> None:
    c = load_config(GPT3)
    assert (c.num_replicas, c.num_stages, c.num_microbatches, c.time_unit) == (6, 4, 8, "us")
    L, h, s, V, b = 32, 4096, 2048, 50257, c.workload.microbatch_size
    assert (c.workload.seq_len, c.topology.gpus_per_worker) == (s, 1)
    layers, tokens, flops_per_us = L // 4, b * s, 150e12 / 1e6
    layer_params = 12 * h * h + 13 * h
    params = [layers * layer_params] * 4
    params[0] += V * h + s * h
    params[3] += 2 * h + V * h
    head = 2 * h * V * tokens
    forward = [layers * (24 * h * h + 4 * s * h) * tokens + (head if st == 3 else 0) for st in range(4)]
    b_input = [layers * (24 * h * h + 8 * s * h) * tokens + (head if st == 3 else 0) for st in range(4)]
    b_weight = [layers * 24 * h * h * tokens + (head if st == 3 else 0) for st in range(4)]
    for st in range(4):
        assert c.costs.forward[st] == pytest.approx(forward[st] / flops_per_us, abs=0.1)
        assert c.costs.backward_input[st] == pytest.approx(b_input[st] / flops_per_us, abs=0.1)
        assert c.costs.backward_weight[st] == pytest.approx(b_weight[st] / flops_per_us, abs=0.1)
        assert c.costs.optimizer[st] == pytest.approx(params[st] * 28 / 1.6e12 * 1e6, abs=0.1)
        assert c.memory.parameter_bytes[st] == c.communication.gradient_bytes[st] == 2 * params[st]
        assert c.memory.optimizer_state_bytes[st] == 12 * params[st]
    stash = layers * 34 * s * b * h
    assert c.memory.activation_bytes == (stash, stash, stash, stash + s * b * V * 6)
    assert c.memory.capacity_bytes == 80_000_000_000 - 16 * max(params) - 4_000_000_000
    assert c.communication.activation_message_bytes[:3] == (b * s * h * 2,) * 3
    assert c.communication.p2p_bandwidth == 80e9 / 8 / 1e6  # bytes per us
    assert sum(params) - V * h == pytest.approx(6.66e9, rel=1e-3)  # GPT-3 "6.7B", the tied embedding counted once


def _raw() -> dict:
    return {"topology": {"num_replicas": 2, "num_stages": 3}, "workload": {"num_microbatches": 4},
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r["costs"].update(fwd=1), "[costs] fwd: unknown key 'fwd'"),
    (lambda r: r.update(topologyy={}), "unknown section or key 'topologyy'"),
    (lambda r: r["topology"].update(num_stages="3"), "[topology] num_stages = '3' must be an integer"),
    (lambda r: r["workload"].update(num_microbatches=2.5), "[workload] num_microbatches = 2.5 must be an integer"),
    (lambda r: r["costs"].update(forward=[1, 2]), "[costs] forward has 2 entries but num_stages = 3"),
    (lambda r: r["costs"].update(backward_weight=-1), "[costs] backward_weight = -1.0 must be >= 0"),
    (lambda r: r["communication"].update(p2p_latency=-0.5) if "communication" in r
     else r.update(communication={"p2p_latency": -0.5}), "[communication] p2p_latency = -0.5 must be >= 0"),
    (lambda r: r["costs"].update(forward=[1, "x", 1]), "[costs] forward = [1, 'x', 1]: every entry must be"),
    (lambda r: r["topology"].pop("num_stages"), "[topology] num_stages is missing"),
    (lambda r: r.update(time_unit="ms"), "time_unit = 'ms' must be one of"),
])
def test_config_errors_name_the_key(edit, needle: str) -> None:
    raw = _raw()
    edit(raw)
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="job.toml")
    assert needle in str(info.value)
    assert str(info.value).startswith("job.toml")


def test_uniform_config_matches_the_toy_file() -> None:
    toy = load_config(TOY)
    built = uniform_config(3, 4, 6, optimizer=3, name="toy")
    assert built.planning_dict() == toy.planning_dict()
    assert built.fingerprint() == toy.fingerprint()


@pytest.mark.parametrize("body,needle", [
    ("[topology]\nnum_replicas = 2\nnum_stages = 2\nbogus = 1\n", "[topology] bogus: unknown key"),
    ("[topology]\nnum_replicas = 2\nnum_stages = [1, 2]\n", "num_stages = [1, 2] must be an integer"),
    ("[topology\n", "is not valid TOML"),
])
def test_config_errors_through_the_cli_exit_2_without_traceback(tmp_path, cli_error, body: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    assert needle in cli_error(["schedule", "--config", str(path)])


def test_workers_per_node_and_inter_node_costs_are_optional_and_checked() -> None:
    from recycle.config import parse_config
    from recycle.errors import ConfigError

    base = {"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 2},
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}
    plain = parse_config(base)
    assert plain.topology.node(3) == 0 and plain.communication.inter_node_time(0) == plain.communication.p2p_time(0)
    noded = parse_config({**base, "topology": {**base["topology"], "workers_per_node": 2},
                          "communication": {"inter_node_latency": 3.0}})
    assert [noded.topology.node(r) for r in range(4)] == [0, 0, 1, 1]
    assert noded.communication.inter_node_time(0) == 3.0
    assert noded.fingerprint() != plain.fingerprint()
    with pytest.raises(ConfigError, match="workers_per_node"):
        parse_config({**base, "topology": {**base["topology"], "workers_per_node": -1}})


def test_every_dataclass_field_is_a_toml_key_and_round_trips() -> None:
    """The TOML schema is derived from the dataclasses: a config with every key set parses back to itself."""
    from dataclasses import asdict

    raw = load_config(GPT3).to_dict()
    raw["topology"]["workers_per_node"] = 4
    raw["communication"].update(inter_node_latency=5.0, inter_node_bandwidth=7.0)
    raw["model"].update(layers_per_stage=[1, 2, 1, 2], n_layer=6, dropout=0.1, hf_config="hf.json")
    raw["training"].update(betas=[0.8, 0.9], eps=1e-6, momentum=0.5, dampening=0.1, nesterov=True, amsgrad=False,
                           lr_schedule="cosine", warmup_steps=2, min_lr=1e-5, lr_decay_steps=3)
    config = parse_config(raw, source="all.toml")
    assert all(v is not None for v in asdict(config.training).values())
    assert config.model.layers_per_stage == (1, 2, 1, 2) and config.training.betas == (0.8, 0.9)
    assert parse_config(config.to_dict(), source="all.toml") == config


def test_fingerprint_is_computed_once_and_never_carried_to_a_changed_copy() -> None:
    import copy
    import pickle
    from dataclasses import replace

    config = load_config(GPT3)
    first = config.fingerprint()
    assert config.fingerprint() == first == load_config(GPT3).fingerprint()
    assert pickle.loads(pickle.dumps(config)).fingerprint() == first == copy.deepcopy(config).fingerprint()
    slower = replace(config, costs=replace(config.costs, forward=tuple(f * 2 for f in config.costs.forward)))
    assert slower.fingerprint() != first
    assert config.with_topology(num_replicas=3).fingerprint() != first
    assert config == load_config(GPT3) and hash(config) == hash(load_config(GPT3))  # the cache is not a field
