"""Tensor parallel inside a worker, without processes: the sharding rule's errors, c_attn's rank order, --inject
aimed at a TP rank, --chaos aimed at a TP rank, a whole checkpoint state loaded as one rank's shards, and a worker's T
processes fenced as one (WorkerGroup)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.config import ModelSpec
from recycle.errors import ConfigError
from recycle.models.gpt import resolve_shape
from recycle.models.tensor_parallel import check_tensor_parallel, qkv_order
from recycle.runtime.control.processes import WorkerGroup, WorkerProcesses
from recycle.runtime.tools.faults import parse_fault
from recycle.runtime.worker.stage import check_model


def test_a_degree_that_does_not_divide_the_heads_names_value_rule_and_fix() -> None:
    shape = resolve_shape(ModelSpec(preset="tiny"), 8)  # n_head = 2
    check_tensor_parallel(shape, 2)
    with pytest.raises(ConfigError) as caught:
        check_tensor_parallel(shape, 4)
    text = str(caught.value)
    assert "gpus_per_worker = 4" in text and "n_head = 2" in text and "whole attention heads" in text
    assert "gpus_per_worker in [1, 2]" in text
    with pytest.raises(ConfigError, match=r"dropout = 0.1 .* set dropout = 0"):
        check_tensor_parallel(replace(shape, dropout=0.1), 2)


def test_check_model_refuses_t_beyond_the_heads_and_other_models(tiny_config) -> None:
    config = tiny_config()
    wide = replace(config, topology=replace(config.topology, gpus_per_worker=4))
    with pytest.raises(ConfigError, match=r"gpus_per_worker = 4 does not divide the model's n_head = 2"):
        check_model(wide)
    two = replace(config, topology=replace(config.topology, gpus_per_worker=2))
    check_model(two)
    with pytest.raises(ConfigError, match=r"shards the built-in GPT and Hugging Face rotary models only, not --model-factory"):
        check_model(two, "tests.nowhere:stages")


def test_the_cli_refuses_a_bad_degree_with_one_error_line(cli_error, tmp_path: Path) -> None:
    text = Path("configs/tiny-gpt.toml").read_text().replace("num_stages = 2\n", "num_stages = 2\ngpus_per_worker = 3\n")
    config = tmp_path / "tp3.toml"
    config.write_text(text)
    line = cli_error(["train", "--config", str(config)])
    assert "gpus_per_worker = 3 does not divide the model's n_head = 2" in line, line


def test_qkv_rows_are_put_in_rank_order_by_heads() -> None:
    order = qkv_order(4, 2).tolist()  # C = 4: q rows 0-3, k rows 4-7, v rows 8-11
    assert order == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert qkv_order(4, 1).tolist() == list(range(12))


def test_inject_names_a_tp_rank_and_checks_it() -> None:
    worker, fault = parse_fault("kill:1:0:1@2.3", 2, 2, tp_degree=2)
    assert worker == (1, 0) and (fault.step, fault.index, fault.tp_rank) == (1, 3, 1)
    assert "TP rank 1" in fault.describe()
    assert parse_fault("kill:1:0@2", 2, 2)[1].tp_rank == 0
    with pytest.raises(ConfigError, match=r"TP rank 2 is outside the worker's 2 process\(es\).*TP_RANK < 2"):
        parse_fault("kill:1:0:2@2", 2, 2, tp_degree=2)


def test_chaos_hits_one_process_of_a_tp_worker_and_draws_t1_events_as_before() -> None:
    """--chaos with T > 1: each event names the TP rank it hits (seeded, every rank in turn over many events); the
    events themselves (kind, workers, repair times) are those T = 1 draws with the same seed."""
    from recycle.runtime.tools.chaos import ChaosMonkey, ChaosSpec

    spec = ChaosSpec(5, 1.0, stage_loss_share=0.3)
    one, two = ChaosMonkey(spec, num_stages=2), ChaosMonkey(spec, num_stages=2, tp_degree=2)
    hit: set[int] = set()
    for step in range(40):
        one.rng.setstate(two.rng.getstate())  # from the same state (the T = 2 monkey draws its TP ranks on top)
        a = one.decide(step, [0, 1, 2, 3], can_lose_stage=True)
        b = two.decide(step, [0, 1, 2, 3], can_lose_stage=True)
        assert a is not None and b is not None and a.tp_ranks == ()
        assert (a.kind, a.ranks, a.repair_after_s) == (b.kind, b.ranks, b.repair_after_s)
        assert len(b.tp_ranks) == len(b.ranks) and all(0 <= t < 2 for t in b.tp_ranks)
        hit.update(b.tp_ranks)
    assert hit == {0, 1}


class _FakeProcess:
    def __init__(self, pid: int | None) -> None:
        self.pid, self.exitcode, self.sentinel, self.killed = pid, None, pid, False

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        self.killed = True
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        return


def test_one_failed_process_fences_the_whole_worker_with_its_exit_code() -> None:
    leader, follower = _FakeProcess(10), _FakeProcess(11)
    group = WorkerGroup([leader, follower])
    assert group.pid == 10 and group.exitcode is None
    follower.exitcode = -9  # SIGKILLed from outside
    assert group.exitcode == -9 and leader.killed  # its TP rank 0 is fenced at once
    assert group.running_sentinels() == []


def test_a_clean_end_waits_for_every_rank_and_kills_none() -> None:
    leader, follower = _FakeProcess(10), _FakeProcess(11)
    group = WorkerGroup([leader, follower])
    leader.exitcode = 0
    assert group.exitcode is None and not follower.killed and group.running_sentinels() == [11]
    follower.exitcode = 0
    assert group.exitcode == 0


def test_stop_also_ends_an_earlier_life_of_a_rank_that_was_not_reaped_yet() -> None:
    """A fenced TP member whose reaping timed out (a loaded machine) is no longer the rank's process once the rank is
    started again; stop() must still end it, or it outlives the launcher."""
    lost, kept, replacement = _FakeProcess(None), _FakeProcess(None), _FakeProcess(None)  # no pid: no real signal
    started = iter([WorkerGroup([kept, lost]), replacement])
    workers = WorkerProcesses(jobs=None, spawn=lambda rank, joining: next(started))  # type: ignore[arg-type]
    workers.start(3, joining=False)
    kept.exitcode = -9  # the group fenced the other member, which is not reaped yet
    lost.killed, lost.exitcode = False, None
    workers.start(3, joining=False)
    workers.stop()
    assert replacement.killed and lost.killed


def test_rank_beats_call_a_rank_frozen_once_its_count_stops_moving() -> None:
    from recycle.runtime.worker.tensor_parallel import RankBeats

    beats = RankBeats(timeout_s=2.0)
    beats.saw(1, None, 0.0)  # not started yet: not watched
    assert beats.frozen(100.0) == []
    beats.saw(1, b"1", 10.0)
    beats.saw(1, b"2", 11.0)
    beats.saw(1, b"2", 12.5)  # the same count again does not refresh it
    assert beats.frozen(12.9) == []
    assert beats.frozen(13.1) == [1]


def test_stages_are_sharded_by_heads_without_any_communication() -> None:
    """parallelize_stage slices the built-in GPT's and a llama stage's linears on the placeholder mesh (no process
    group exists yet; each rank takes its own slice of the weights it built): the local shapes are 1/T."""
    from torch.distributed.tensor import DTensor

    from recycle.models.gpt import build_stage
    from recycle.models.tensor_parallel import parallelize_stage
    from recycle.runtime.worker.tensor_parallel import worker_mesh

    gpt = build_stage(ModelSpec(preset="tiny"), 1, 0, seed=1, dtype="float64", seq_len=8)
    whole_qkv = gpt.blocks["0"].attn.c_attn.weight.detach().clone()
    parallelize_stage(gpt, worker_mesh(2, 1))
    qkv = gpt.blocks["0"].attn.c_attn.weight
    assert isinstance(qkv, DTensor) and qkv.to_local().shape == (48, 32)  # 3 x 32 rows, half of them
    # Rank 1's shard: the q, k and v rows of head 1 (rows 16-31 of each of q, k, v).
    assert torch.equal(qkv.to_local(), torch.cat([whole_qkv[16:32], whole_qkv[48:64], whole_qkv[80:96]]))
    assert gpt.blocks["0"].mlp[2].weight.to_local().shape == (32, 64)  # row-parallel: input columns split
    assert not isinstance(gpt.ln_f.weight, DTensor) and not isinstance(gpt.wte.weight, DTensor)

    pytest.importorskip("transformers")
    from recycle.models.hf import hf_stage

    llama = hf_stage(Path("examples/hf-tiny-llama.json"), 2, 0, 16, 4, torch.float64)
    parallelize_stage(llama, worker_mesh(2, 0))
    attention = llama.model.model.layers["0"].self_attn
    assert attention.q_proj.weight.to_local().shape == (16, 32)  # 4 heads of 8 -> 2 per rank
    assert attention.k_proj.weight.to_local().shape == (8, 32)  # 2 key/value heads -> 1 per rank
    assert attention.o_proj.weight.to_local().shape == (32, 16)


def test_a_hugging_face_model_t_must_divide_its_kv_heads() -> None:
    from types import SimpleNamespace

    from recycle.models.tensor_parallel import check_hf_tensor_parallel

    llama = SimpleNamespace(model_type="llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            attention_dropout=0.0)
    check_hf_tensor_parallel(llama, 2)
    with pytest.raises(ConfigError, match=r"does not divide the Hugging Face config's num_key_value_heads = 2"):
        check_hf_tensor_parallel(llama, 4)
    with pytest.raises(ConfigError, match=r"not 'gpt2'"):
        check_hf_tensor_parallel(SimpleNamespace(model_type="gpt2"), 2)


def _sharded_stage_state(rank: int):
    from recycle.config import Training
    from recycle.models.gpt import build_stage
    from recycle.models.tensor_parallel import parallelize_stage
    from recycle.runtime.state.optim import make_optimizer
    from recycle.runtime.state.stage_state import IterationPosition, StageState
    from recycle.runtime.worker.tensor_parallel import worker_mesh

    module = build_stage(ModelSpec(preset="tiny"), 2, 0, seed=1, dtype="float64", seq_len=8)
    parallelize_stage(module, worker_mesh(2, rank))
    return StageState(module, make_optimizer(module, Training(lr=0.01)), 0, IterationPosition(-1))


def _step(state, value: float) -> None:
    for p in state.module.parameters():  # element-wise DTensor ops on one placement: no communication
        p.grad = torch.full_like(p, value)
    state.optimizer.step()
    state.position.applied = state.position.applied + 1


def test_a_sharded_stage_state_moves_shard_by_shard_and_rolls_back() -> None:
    """A re-joiner's TP rank takes the same rank's plain shards (state_transfer sends local_state) into its DTensor
    parameters and optimizer; a snapshot of a sharded stage restores it exactly."""
    from torch.distributed.tensor import DTensor

    from recycle.models.tensor_parallel import local_state
    from recycle.runtime.state.rollback import StageSnapshot
    from recycle.runtime.state.stage_state import copy_state

    source, joiner = _sharded_stage_state(1), _sharded_stage_state(1)
    _step(source, 0.5)
    _step(source, -0.25)
    sent = copy_state(local_state(source.state_dict()))
    assert not any(isinstance(v, DTensor) for v in sent.values())
    joiner.load_state_dict(sent)
    got, want = local_state(joiner.state_dict()), local_state(source.state_dict())
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key.startswith("train.rng"):
            continue
        assert torch.equal(got[key], value), key
    exp_avg = joiner.optimizer.optimizer.state[next(p for p in joiner.module.parameters()
                                                    if isinstance(p, DTensor))]["exp_avg"]
    assert isinstance(exp_avg, DTensor)  # the joiner steps on like the source
    _step(joiner, 1.0)

    snapshot = StageSnapshot(source)
    before = copy_state(local_state(source.state_dict()))
    snapshot.take(2)
    _step(source, 3.0)
    snapshot.restore(2)
    after = local_state(source.state_dict())
    for key, value in before.items():
        if not key.startswith("train."):
            assert torch.equal(after[key], value), key


def _megatron_shard(name: str, whole: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s part of `whole` (parameter `name`) in Megatron's layout over 2 ranks, written out by hand:
    c_attn (rows in rank order first) and mlp.0 split by rows, c_proj's and mlp.2's weights by columns."""
    if "c_attn" in name:
        whole = whole[qkv_order(whole.shape[0] // 3, 2)]
    if "c_attn" in name or "mlp.0" in name:
        return whole.chunk(2, 0)[tp_rank]
    if name.endswith(("c_proj.weight", "mlp.2.weight")):
        return whole.chunk(2, 1)[tp_rank]
    return whole


def test_a_whole_checkpoint_state_loads_as_this_ranks_shards(tiny_config) -> None:
    """What --resume into T = 2 does on one rank, with no process group: a stage state in the unsharded layout (a
    checkpoint's whole tensors, Adam's moments included) loads into a sharded stage as this rank's Megatron shards
    (c_attn's rows in rank order, for the moments too), the optimizer's entries as DTensors like their parameters.

    TP rank 1 (rank 0's shards are the first chunks, which a slicing that ignored the rank would get right too). One
    rank per process, as in a worker: DTensor's dispatch reuses results across meshes that compare equal, and a mesh
    seen from rank 0 equals one seen from rank 1, so a second rank's stage in this process could take rank 0's
    mesh."""
    tp_rank = 1
    from torch.distributed.tensor import DTensor

    from recycle.models.gpt import full_model
    from recycle.models.tensor_parallel import local_tensor, parallelize_gpt_stage
    from recycle.runtime.state.optim import make_optimizer
    from recycle.runtime.state.stage_state import OPTIMIZER_PREFIX, STEP_KEY, IterationPosition, StageState
    from recycle.runtime.worker.tensor_parallel import worker_mesh

    config = tiny_config(dtype="float64")
    spec, seq_len = config.model, config.workload.seq_len
    whole = full_model(spec, seq_len, 3, torch.float64)
    state: dict[str, object] = dict(whole.state_dict())
    for name, p in whole.named_parameters():  # moments: the weights x 2 and x 3, whole, under the parameter's name
        state[f"{OPTIMIZER_PREFIX}{name}.exp_avg"] = p.detach() * 2
        state[f"{OPTIMIZER_PREFIX}{name}.exp_avg_sq"] = p.detach() * 3
        state[f"{OPTIMIZER_PREFIX}{name}.step"] = torch.tensor(4.0, dtype=torch.float64)
    state[STEP_KEY] = torch.tensor(4)
    target = full_model(spec, seq_len, 9, torch.float64)  # other weights: every shard must be overwritten
    parallelize_gpt_stage(target, worker_mesh(2, tp_rank))
    loaded = StageState(target, make_optimizer(target, config.training), 0, IterationPosition())
    loaded.load_state_dict(state)
    assert loaded.position.done == 4
    moments = loaded.optimizer.state_dict()["optimizer"]["state"]
    split = [n for n, p in target.named_parameters() if isinstance(p, DTensor) and p._local_tensor.shape != p.shape]
    assert any("c_attn" in n for n in split) and any("mlp.2" in n for n in split)
    for index, (name, param) in enumerate(target.named_parameters()):
        want = _megatron_shard(name, whole.state_dict()[name], tp_rank)
        assert torch.equal(local_tensor(param), want), name
        for key, scale in (("exp_avg", 2.0), ("exp_avg_sq", 3.0)):
            entry = moments[index][key]
            assert isinstance(entry, DTensor) == isinstance(param, DTensor), (name, key)
            assert torch.equal(local_tensor(entry), want * scale), (name, key)


def test_tp_rank_0_finds_whether_its_ranks_stopped_at_one_point() -> None:
    """--redo lost with T > 1 (worker.tp_agreement): the work of a worker is kept only when every TP rank posted the
    stop point of rank 0; a rank one action ahead, or silent, makes rank 0's report say how they differ."""
    import torch.distributed as dist

    from recycle.runtime.worker.tp_agreement import StopPoint, post_stop_point, stop_key, tp_split

    store = dist.HashStore()
    here = StopPoint(applied=0, iteration=1, finished=2, weighed=False, reducing=False, completing=False)
    post_stop_point(store, 3, 5, 1, here)
    post_stop_point(store, 3, 5, 2, here)
    assert tp_split(store, 3, 5, 3, here, timeout_s=1.0) == ""
    assert not store.check([stop_key(3, 5, 1)])  # read and removed
    ahead = StopPoint(applied=0, iteration=1, finished=3, weighed=False, reducing=False, completing=False)
    post_stop_point(store, 4, 5, 1, ahead)
    split = tp_split(store, 4, 5, 2, here, timeout_s=1.0)
    assert split == ("TP rank 1 stopped in iteration 1 after 3 action(s) (applied 0), TP rank 0 in iteration 1 "
                     "after 2 action(s) (applied 0)"), split
    assert tp_split(store, 5, 5, 2, here, timeout_s=0.2) == "TP rank 1 posted no stop point within 0.2 s"
