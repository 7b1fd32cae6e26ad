"""The control plane (store bound to one address, peers authenticated by the job token), scripted-fault parsing, and
the pre-step snapshot that recovery rolls back to."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import torch

from recycle.config import Training
from recycle.errors import ConfigError
from recycle.runtime.protocol.channels import (connect_store, host_store, new_incarnation, new_token, read_token,
                                               worker_identity)
from recycle.runtime.protocol.store import StoreAuthError
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.rollback import StageSnapshot
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.tools.faults import FaultInjection, parse_fault


def _non_loopback_address() -> str | None:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    addresses = [a for a in out if "." in a and not a.startswith("127.")]
    return addresses[0] if addresses else None


def test_store_listens_on_loopback_only() -> None:
    server = host_store("127.0.0.1", 0, new_token())
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass
        other = _non_loopback_address()
        if other is None:
            pytest.skip("this machine has no non-loopback IPv4 address to try")
        with pytest.raises(OSError):
            socket.create_connection((other, server.port), timeout=2).close()
    finally:
        server.close()


def test_a_busy_port_is_a_clear_error() -> None:
    first = host_store("127.0.0.1", 0, new_token())
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port}.*--master-port"):
            host_store("127.0.0.1", first.port, new_token())
    finally:
        first.close()


def test_a_process_without_the_token_gets_nothing_and_is_told_why() -> None:
    token = new_token()
    server = host_store("127.0.0.1", 0, token)
    try:
        job = connect_store("127.0.0.1", server.port, token, worker_identity(0, new_incarnation()), timeout_s=5)
        job.set("metrics/0/0", "real")
        with pytest.raises(StoreAuthError, match="no job there runs with this token"):
            connect_store("127.0.0.1", server.port, new_token(), "worker/0/x", timeout_s=5, connect_timeout_s=5)
        assert job.get("metrics/0/0") == b"real"
    finally:
        server.close()


def test_token_file_must_be_private_and_well_formed(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RECYCLE_JOB_TOKEN", raising=False)
    assert read_token() == ""
    path = tmp_path / "token"
    path.write_text(new_token() + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(str(path))
    os.chmod(path, 0o600)
    assert len(read_token(str(path))) == 48
    path.write_text("short")
    with pytest.raises(ConfigError, match="at least 32 hex digits"):
        read_token(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        read_token(str(tmp_path / "missing"))
    monkeypatch.setenv("RECYCLE_JOB_TOKEN", "ab" * 20)
    assert read_token() == "ab" * 20


@pytest.mark.parametrize("spec,worker,fault", [
    ("kill:1:1@3.5", (1, 1), FaultInjection(2, 5, "kill", "action")),
    ("hang:0:2@1", (0, 2), FaultInjection(0, 0, "hang", "action")),
    ("stall:0:1@2.4", (0, 1), FaultInjection(1, 4, "stall", "action")),
    ("raise:2:0@4.ckpt", (2, 0), FaultInjection(3, 0, "raise", "ckpt")),
    ("kill:0:0@2.recovery", (0, 0), FaultInjection(1, 0, "kill", "recovery")),
    ("kill:1:2@4.eval", (1, 2), FaultInjection(3, 0, "kill", "eval")),
])
def test_fault_specs_parse(spec: str, worker: tuple[int, int], fault: FaultInjection) -> None:
    assert parse_fault(spec, num_replicas=3, num_stages=3) == (worker, fault)


@pytest.mark.parametrize("spec,message", [
    ("kill:1:1", "MODE:REPLICA:STAGE@STEP"),
    ("explode:1:1@2", "mode 'explode' is unknown"),
    ("kill:3:0@2", "outside the topology"),
    ("kill:0:0@0", "must be >= 1"),
    ("kill:0:0@2.later", "not an action index"),
])
def test_bad_fault_specs_name_the_rule(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fault(spec, num_replicas=3, num_stages=3)


def test_snapshot_restores_parameters_and_optimizer_state_exactly() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).double()
    optimizer = make_optimizer(module, Training(lr=0.1, weight_decay=0.01))

    def step() -> None:
        module(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    position = IterationPosition(applied=0)
    snapshot = StageSnapshot(StageState(module, optimizer, 0, position))
    snapshot.take(iteration=1)
    step()
    position.applied = 1
    before = {k: v.clone() for k, v in module.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state_dict()["optimizer"]["state"].values()]
    snapshot.take(iteration=2)  # into the first take's tensors
    step()
    position.applied = 2
    assert not torch.equal(module.weight, before["weight"])
    with pytest.raises(RuntimeError, match="held is of iteration 2"):
        snapshot.restore(3)
    snapshot.restore(2)
    assert position == IterationPosition(applied=1, snapshot=None) and optimizer.steps == 2
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    state = optimizer.state_dict()["optimizer"]["state"]
    assert all(torch.equal(s["exp_avg"], b) for s, b in zip(state.values(), moments))
    assert all(float(s["step"]) == 2 for s in state.values())
    with pytest.raises(RuntimeError, match="held is of iteration None"):  # one restore per take
        snapshot.restore(2)


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_every_take_holds_the_state_before_its_step_whatever_the_layout_did(optimizer: str) -> None:
    """The first take (no optimizer state yet), the next (the state appeared: another layout), the later ones (the
    same layout: copied into the held tensors in one call) and those after a restore (the optimizer holds the
    loaded copies) each restore exactly the state taken."""
    from recycle.runtime.state.stage_state import copy_state

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    training = Training(lr=0.1, weight_decay=0.01, optimizer=optimizer, momentum=0.9 if optimizer == "SGD" else None)
    optimizer_ = make_optimizer(module, training)
    position = IterationPosition()
    state = StageState(module, optimizer_, 0, position)
    snapshot = StageSnapshot(state)

    def step() -> None:
        module(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        optimizer_.step()
        optimizer_.zero_grad()

    for iteration in range(6):
        snapshot.take(iteration)
        expected = copy_state(state.state_dict())
        step()
        position.applied = iteration
        if iteration in (2, 4):  # roll back, then step the iteration again
            snapshot.restore(iteration)
            live = state.state_dict()
            assert [k for k in live if k != state.rng_key] == [k for k in expected if k != state.rng_key]
            assert all(torch.equal(live[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor)
                       and k != state.rng_key)
            snapshot.take(iteration)
            step()
            position.applied = iteration


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_state_transfer_copies_parameters_moments_and_step_count(optimizer: str) -> None:
    """The joiner's optimizer has no state yet (torch.optim creates it lazily): it arrives with its layout."""
    from recycle.runtime.state.state_transfer import transfer_stage_state

    training = Training(lr=0.1, optimizer=optimizer, momentum=0.9 if optimizer == "SGD" else None,
                        lr_schedule="cosine", warmup_steps=2, steps=10)

    def make(seed: int):
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
        return module, make_optimizer(module, training)

    source, source_opt = make(0)
    for _ in range(3):
        source(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        source_opt.step()
        source_opt.zero_grad()
    joiner, joiner_opt = make(1)
    sent: list[torch.Tensor] = []

    def send(t: torch.Tensor) -> None:
        sent.append(t.clone())

    stats = transfer_stage_state(StageState(source, source_opt, 0, IterationPosition(applied=2)), True, send,
                                 torch.device("cpu"))
    assert stats.bytes == sum(t.numel() * t.element_size() for t in sent)
    received = iter(sent)
    position = IterationPosition(snapshot=3)
    transfer_stage_state(StageState(joiner, joiner_opt, 0, position), False, lambda t: t.copy_(next(received)),
                         torch.device("cpu"))
    assert position == IterationPosition(applied=2, snapshot=None)  # three steps done, as the source
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), joiner.state_dict().values()))
    theirs, ours = source_opt.state_dict(), joiner_opt.state_dict()
    assert ours["steps"] == theirs["steps"] == 3 and joiner_opt.lr == source_opt.lr != 0.1
    for a, b in zip(theirs["optimizer"]["state"].values(), ours["optimizer"]["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chaos_never_takes_a_last_replica_except_as_a_restorable_stage_loss() -> None:
    from recycle.runtime.tools.chaos import ChaosMonkey, ChaosSpec, parse_chaos

    assert parse_chaos("7,0.5") == ChaosSpec(7, 0.5)
    for bad in ("7", "x,0.5", "7,0", "7,2", "7,0.5,1"):
        with pytest.raises(ConfigError, match="SEED,RATE"):
            parse_chaos(bad)
    monkey = ChaosMonkey(ChaosSpec(3, 1.0, stage_loss_share=0.3), num_stages=2)
    live = [0, 1, 2, 4, 5]  # stage 0: ranks 0, 2, 4; stage 1: ranks 1, 5
    kinds = set()
    for step in range(300):
        event = monkey.decide(step, live, can_lose_stage=step % 2 == 0)
        assert event is not None
        kinds.add(event.kind)
        if event.kind == "stage-loss":
            assert step % 2 == 0 and sorted(event.ranks) in ([0, 2, 4], [1, 5])
        else:
            assert len(event.ranks) == 1 and event.ranks[0] in live
        assert all(0.5 <= d <= 2.0 for d in event.repair_after_s)
    assert kinds == {"kill", "hang", "stage-loss"}
    assert ChaosMonkey(ChaosSpec(1, 1.0), 2).decide(0, [0, 1], can_lose_stage=False) is None  # no spare replica
    a, b = ChaosMonkey(ChaosSpec(9, 0.5), 2), ChaosMonkey(ChaosSpec(9, 0.5), 2)
    assert [a.decide(s, live, True) for s in range(50)] == [b.decide(s, live, True) for s in range(50)]


def test_records_travel_on_their_declared_channels_only() -> None:
    from recycle.runtime.protocol.channels import Channels, JobStore
    from recycle.runtime.protocol.records import RecordError, Timestamp
    from recycle.runtime.protocol.store import LocalStore, StoreServer

    server = StoreServer("127.0.0.1", 0, new_token())
    try:
        jobs = JobStore(LocalStore(server.data))
        assert jobs.read(Channels.RESUMED, 3, 1) is None
        jobs.put(Channels.RESUMED, Timestamp(12.5), 3, 1)
        assert jobs.read(Channels.RESUMED, 3, 1) == Timestamp(12.5) == jobs.get(Channels.RESUMED, 3, 1)
        assert jobs.raw.try_get("resumed/3/1") is not None  # the key names are the documented ones
        jobs.raw.set(Channels.JOINED.key(3, 1), jobs.raw.get("resumed/3/1"))  # a record on the wrong channel
        with pytest.raises(RecordError, match="holds a Timestamp"):
            jobs.read(Channels.JOINED, 3, 1)
        jobs.delete(Channels.RESUMED, 3, 1)
        assert jobs.read(Channels.RESUMED, 3, 1) is None
    finally:
        server.close()


def test_job_settings_name_each_flag_that_differs() -> None:
    from recycle.runtime.protocol.records import JobSettings, from_json, to_json

    mine = JobSettings("c1", "p1", "", 10, "out.pt", "", 0, "")
    assert mine.differences(from_json(JobSettings, to_json(mine))) == []
    theirs = JobSettings("c2", "p1", "", 12, "out.pt", "ck", 5, "", "hf-out")
    assert mine.differences(theirs) == [
        "--config (or --set/--hf/--data-source): a different one here, another at the coordinator",
        "--steps: 10 here, 12 at the coordinator",
        "--checkpoint-dir: '' here, 'ck' at the coordinator",
        "--checkpoint-every: 0 here, 5 at the coordinator",
        "--export-hf: '' here, 'hf-out' at the coordinator"]


def test_job_settings_grad_norm_is_adopted_from_the_coordinator_not_agreed() -> None:
    """The coordinator's launch holds the reports' sinks: a node without --metrics follows its choice of metric."""
    from recycle.runtime.protocol.records import JobSettings, from_json, to_json

    coordinator = JobSettings("c1", "p1", "", 10, "", "", 0, "", grad_norm=True)
    node = JobSettings("c1", "p1", "", 10, "", "", 0, "", grad_norm=False)
    assert node.differences(coordinator) == []
    assert from_json(JobSettings, to_json(coordinator)).grad_norm is True



def test_a_node_launcher_tells_its_workers_the_coordinators_grad_norm_choice() -> None:
    from dataclasses import replace

    from recycle.runtime.control.launcher import _agree_on_settings
    from recycle.runtime.options import ClusterOptions
    from recycle.runtime.protocol.channels import JobStore
    from recycle.runtime.protocol.records import JobSettings
    from recycle.runtime.protocol.store.client import LocalStore

    server = host_store("127.0.0.1", 0, new_token())
    try:
        jobs = JobStore(LocalStore(server.data))
        coordinator = JobSettings("c1", "p1", "", 10, "", "", 0, "", grad_norm=True)
        assert _agree_on_settings(jobs, coordinator, ClusterOptions()) == coordinator  # node 0 hosts it
        node = ClusterOptions(nnodes=2, node_rank=1, master_port=server.port, token="t")
        assert _agree_on_settings(jobs, replace(coordinator, grad_norm=False), node).grad_norm is True
    finally:
        server.close()
