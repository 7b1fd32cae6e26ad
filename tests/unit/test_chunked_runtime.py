"""The runtime's side of chunked plans without processes: a worker's ChunkSet (whole-model names and weights), the
messages across chunk boundaries (the V's local turn, distinct tags), the emulated chunk costs, the plans a chunked
run starts on and switches to, and what `recycle train` refuses with chunks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.api import check_runtime_chunks, select_plan
from recycle.cli import main
from recycle.config import Config, parse_config
from recycle.errors import ConfigError
from recycle.ir.actions import Action, Kind
from recycle.ir.validate import validate_plan
from recycle.models.chunk_set import gpt_chunk_set
from recycle.models.gpt import full_model
from recycle.runtime.protocol.messages import Channel, incoming, message_tag, outgoing, send_order
from recycle.runtime.worker.chunked_stage import chunked_built_stage, data_stages
from recycle.runtime.worker.emulate import action_cost

ROOT = Path(__file__).resolve().parents[2]


def make_tiny_config(D: int = 2, S: int = 2) -> Config:
    """The tiny GPT, D x S, M = 2 micro-batches of 2 x 8 tokens, unit costs, float64."""
    return parse_config({"topology": {"num_replicas": D, "num_stages": S},
                         "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
                         "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                         "model": {"preset": "tiny"}, "training": {"dtype": "float64", "seed": 7}}, name="tiny")


def chunked(layout: str, D: int = 2, S: int = 2) -> Config:
    config = make_tiny_config(D=D, S=S)
    return replace(config, topology=replace(config.topology, chunks_per_worker=2, chunk_layout=layout))


# -- the worker's chunks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,held", [("interleaved", [(0, 2), (1, 3)]), ("v", [(0, 3), (1, 2)])])
def test_the_workers_chunk_sets_are_the_whole_model_under_its_own_names(layout: str, held) -> None:
    config = chunked(layout)
    whole = full_model(config.model, config.workload.seq_len, config.training.seed, "float64").state_dict()
    seen: dict[str, torch.Tensor] = {}
    for stage in range(2):
        chunks = gpt_chunk_set(config.model, 2, 2, layout, stage, config.training.seed, "float64", 8)
        assert chunks.chunk_ids == held[stage]
        names = [name for name, _ in chunks.named_parameters()]
        assert len(names) == len(set(names))  # every parameter once, not once per chunk module
        state = chunks.state_dict()
        assert not seen.keys() & state.keys()
        seen.update(state)
        chunk_params = {id(p) for v in chunks.chunk_ids for p in chunks.chunk(v).parameters()}
        assert chunk_params == {id(p) for p in chunks.parameters()}  # the chunks run on the set's parameters
    assert seen.keys() == whole.keys()
    assert all(torch.equal(seen[k], whole[k]) for k in whole)


def test_the_v_layouts_worker_0_loads_data_for_both_ends_of_the_model() -> None:
    assert data_stages(chunked("v", S=3)) == (0,)
    assert data_stages(chunked("interleaved", S=3)) == (0, 2)
    assert data_stages(make_tiny_config(S=3)) == (0, 2)
    built = chunked_built_stage(chunked("v"), 0)
    assert built.input_shape == built.output_shape == (2, 8, 32) and built.layout == (0, 4)


# -- messages across chunk boundaries ---------------------------------------------------------------------------

def test_the_v_turn_is_a_local_hand_off_and_other_boundaries_cross_workers() -> None:
    plan = select_plan(chunked("v", D=1))
    turn = outgoing(plan, 1, Action(Kind.F, 1, 0))  # chunk 1 -> chunk 2, both on worker 0:1
    assert (turn.src, turn.dst, turn.boundary) == (1, 1, 1)
    assert incoming(plan, 1, Action(Kind.F, 2, 0)) == turn
    back = outgoing(plan, 1, Action(Kind.B, 2, 0))  # chunk 2's input-gradient to chunk 1, same worker
    assert (back.channel, back.src, back.dst) == (Channel.GRADIENT, 1, 1)
    down = outgoing(plan, 1, Action(Kind.F, 2, 0))  # chunk 2 -> chunk 3 on worker 0:0
    assert (down.dst, down.boundary) == (0, 2)
    assert outgoing(plan, 0, Action(Kind.F, 3, 0)) is None  # the loss: nothing to send


def test_interleaved_boundaries_between_one_pair_have_distinct_messages_and_tags() -> None:
    plan = select_plan(chunked("interleaved", D=1))
    # Worker 0 sends the activations of chunk 0 -> 1 and chunk 2 -> 3 and the input-gradient of chunk 2 -> 1.
    sent = send_order(plan, 0, 1)
    assert len(sent) == len(set(sent)) == 3 * plan.num_microbatches
    assert {(m.channel, m.boundary) for m in sent} == {(Channel.ACTIVATION, 0), (Channel.ACTIVATION, 2),
                                                        (Channel.GRADIENT, 1)}
    assert len({message_tag(m.channel, m.mb, m.boundary) for m in sent}) == len(sent)
    assert message_tag(Channel.ACTIVATION, 5) == (1 << 24) | 5  # one chunk per worker: the tags of before
    assert max(message_tag(c, (1 << 24) - 1, b) for c in Channel for b in range(64)) < 2 ** 31  # a C int


def test_emulated_chunk_costs_are_a_cth_of_the_workers_stage_costs() -> None:
    config = chunked("v", D=1)
    config = replace(config, costs=replace(config.costs, forward=(4.0, 6.0)))
    plan = select_plan(config)
    assert action_cost(config, plan, Action(Kind.F, 2, 0)) == 3.0  # chunk 2 lives on worker 1
    assert action_cost(config, plan, Action(Kind.F, 3, 0)) == 2.0


# -- plans -------------------------------------------------------------------------------------------------------

def test_a_chunked_run_starts_on_the_chunked_planners_plan_and_recovers_onto_chunked_plans() -> None:
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary

    config = chunked("v")
    plan = select_plan(config)
    assert plan.chunks == 2 and plan.chunk_layout == "v" and not plan.failed
    with pytest.raises(ConfigError, match="drop --schedule"):
        select_plan(config, "zb-h1", down=["1:1"])
    library = PlanLibrary.build(config, PlannerOptions(), 2)
    for failed in ({(1, 1)}, {(0, 0), (1, 1)}, {(0, 1), (1, 0)}):  # nested and not
        choice = library.lookup(frozenset(failed))
        validate_plan(choice.plan)
        assert choice.plan.chunks == 2 and choice.plan.failed == failed


# -- what a chunked run refuses ------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,kwargs,named", [
    ({}, {"model_factory": "pkg.mod:stages"}, "--model-factory 'pkg.mod:stages'"),
    ({"model": {"hf_config": "hf.json"}}, {}, "[model] hf_config = 'hf.json'"),
    ({"topology": {"gpus_per_worker": 2}}, {}, "[topology] gpus_per_worker = 2"),
    ({}, {"repartition": True}, "--repartition"),
    ({}, {"chaos": True}, "--chaos"),
])
def test_what_chunks_cannot_run_yet_is_refused_naming_value_rule_and_fix(change, kwargs, named: str) -> None:
    config = chunked("v")
    for section, values in change.items():
        config = replace(config, **{section: replace(getattr(config, section), **values)})
    with pytest.raises(ConfigError) as info:
        check_runtime_chunks(config, **kwargs)
    message = str(info.value)
    assert message.startswith("[topology] chunks_per_worker = 2 (several model chunks per worker) cannot run with")
    assert named in message and "set chunks_per_worker = 1" in message
    check_runtime_chunks(make_tiny_config(), **kwargs)  # one chunk per worker: none of this is refused here


def test_a_model_with_fewer_layers_than_chunks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"n_layer = 4 layers but num_stages x chunks_per_worker = 3 x 2 = 6"):
        check_runtime_chunks(chunked("v", S=3))


def test_a_plan_for_other_chunks_than_the_config_is_refused_both_ways() -> None:
    with pytest.raises(ConfigError, match=r"the plan has 2 chunks per worker \(v layout\) but the config has "
                                          r"\[topology\] chunks_per_worker = 1; make the plan from this config"):
        check_runtime_chunks(make_tiny_config(), select_plan(chunked("v")))
    with pytest.raises(ConfigError, match=r"the plan has 1 chunk per worker but the config has \[topology\] "
                                          r"chunks_per_worker = 2, chunk_layout = 'interleaved'"):
        check_runtime_chunks(chunked("interleaved"), select_plan(make_tiny_config()))
    with pytest.raises(ConfigError, match=r"2 chunks per worker \(v layout\).*chunk_layout = 'interleaved'"):
        check_runtime_chunks(chunked("interleaved"), select_plan(chunked("v")))


def test_recycle_train_refuses_chunks_with_chaos_in_one_error_line(cli_error) -> None:
    line = cli_error(["train", "--config", str(ROOT / "configs" / "tiny-gpt.toml"), "--set",
                      "topology.chunks_per_worker=2", "--chaos", "7,0.1", "--steps", "3"])
    assert "--chaos: random hangs, kills and repairs are not tested with chunks" in line
