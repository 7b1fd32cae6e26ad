"""Receives posted ahead of their need: a transport that offers post_recv/take gets each peer's next message of the
iteration posted as soon as the one before it is taken (StageExecutor._post_next), with the same training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from recycle.ir import Plan
from recycle.models.gpt import build_stages
from recycle.runtime.protocol.messages import Message
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.tools.fakes import FaultyComm, MemoryFabric, run_ranks_in_threads
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.runtime.worker.transport import PeerLost
from recycle.schedules.fault_free import build_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class _Posted:
    message: Message
    shape: tuple[int, ...]
    dtype: torch.dtype


class PostingComm:
    """A MemoryComm that also offers post_recv/take, as the gloo Transport does, and logs every receive: ("post",
    m), ("take", m), ("recv", m) (at the point of need), with the number of actions the worker had started."""

    def __init__(self, inner: Any, log: list[tuple[str, Message, int]], refuse: bool = False) -> None:
        self.inner = inner
        self.log = log
        self.refuse = refuse  # post_recv answers None, as the Transport does on NCCL
        self.actions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def post_recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> _Posted | None:
        self.log.append(("refused" if self.refuse else "post", message, self.actions))
        return None if self.refuse else _Posted(message, shape, dtype)

    def take(self, posted: _Posted) -> torch.Tensor:
        self.log.append(("take", posted.message, self.actions))
        return self.inner.recv(posted.message, posted.shape, posted.dtype)

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.log.append(("recv", message, self.actions))
        return self.inner.recv(message, shape, dtype)


def _train(config: Any, plan: Plan, posting: bool, refuse: bool = False
           ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, list[tuple[str, Message, int]]]]:
    """Train `plan` on threads: each live rank's final state dict, and its comm's log (posting transports only)."""
    training, workload = config.training, config.workload
    load = data_source(config)
    fabric = MemoryFabric.for_plan(plan)
    states: dict[int, dict[str, torch.Tensor]] = {}
    logs: dict[int, list[tuple[str, Message, int]]] = {}

    def work(rank: int) -> None:
        _, stage = plan.worker(rank)
        module = build_stages(config.model, plan.num_stages, training.seed, weights_dtype(training.dtype),
                              workload.seq_len)[stage]
        shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
        comm: Any = fabric.endpoint(rank)
        if posting:
            comm = PostingComm(comm, logs.setdefault(rank, []), refuse)

        def count(action: Any) -> None:
            if posting:
                comm.actions += 1

        executor = StageExecutor(plan, rank, module, make_optimizer(module, training), comm, load, shape, shape,
                                 next(module.parameters()).dtype, precision=training.dtype, before_action=count)
        for step in range(training.steps):
            executor.run_iteration(step)
        states[rank] = {k: v.clone() for k, v in module.state_dict().items()}

    run_ranks_in_threads(plan.live_ranks(), work, fabric.cut, 60)
    return states, logs


@pytest.mark.parametrize("schedule,D,S", [("1f1b", 1, 3), ("zb-h1", 2, 2)])
def test_each_peers_next_message_is_posted_ahead_and_training_is_unchanged(tiny_config, schedule: str, D: int,
                                                                          S: int) -> None:
    config = tiny_config(D=D, S=S, M=3, steps=2)
    plan = build_schedule(config, schedule, staggered=True)
    plain, _ = _train(config, plan, posting=False)
    posted, logs = _train(config, plan, posting=True)
    for rank, state in plain.items():  # bit for bit: the same receives, only posted earlier
        assert all(torch.equal(state[k], posted[rank][k]) for k in state), rank
    for rank, log in logs.items():
        assert log, rank
        assert not [entry for entry in log if entry[0] == "recv"], "every receive of a plan's iteration is posted"
        waiting: dict[int, Message] = {}  # per peer, the receive posted and not yet taken: at most one
        for kind, message, actions in log:
            if kind == "post":
                assert message.src not in waiting, (rank, message)
                waiting[message.src] = message
            else:
                assert waiting.pop(message.src) is message, (rank, message)
        assert not waiting, "every receive posted is taken before the iteration ends"
        # The first message of each peer is posted when the iteration starts, before its first action.
        firsts = [(message, actions) for kind, message, actions in log if kind == "post"][:len(
            {m.src for _, m, _ in log})]
        assert all(actions == 0 for _, actions in firsts), firsts


def test_a_transport_that_cannot_post_receives_at_the_point_of_need(tiny_config) -> None:
    config = tiny_config(D=1, S=2, M=2, steps=2)
    plan = build_schedule(config, "1f1b", staggered=True)
    plain, _ = _train(config, plan, posting=False)
    refused, logs = _train(config, plan, posting=True, refuse=True)
    for rank, state in plain.items():
        assert all(torch.equal(state[k], refused[rank][k]) for k in state), rank
    for log in logs.values():
        kinds = [kind for kind, _, _ in log]
        assert kinds[0] == "refused" and kinds.count("refused") == 1 and set(kinds[1:]) == {"recv"}, kinds


def test_a_broken_iteration_drops_the_receives_it_posted(tiny_config) -> None:
    """A peer lost mid-iteration: the receives posted on the broken transport are never taken, and the iteration
    run again (on a new transport, from its first action) posts its own."""
    config = tiny_config(D=1, S=2, M=2, steps=1)
    plan = build_schedule(config, "1f1b", staggered=True)
    training, workload = config.training, config.workload
    module = build_stages(config.model, 2, training.seed, weights_dtype(training.dtype), workload.seq_len)[1]
    shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
    fabric = MemoryFabric.for_plan(plan, timeout_s=2.0)
    log: list[tuple[str, Message, int]] = []
    broken = PostingComm(FaultyComm(fabric.endpoint(1), (0, 0)), log)  # its first receive loses the peer
    executor = StageExecutor(plan, 1, module, make_optimizer(module, training), broken, data_source(config), shape,
                             shape, next(module.parameters()).dtype, precision=training.dtype)
    with pytest.raises(PeerLost):
        executor.run_iteration(0)
    assert [kind for kind, _, _ in log] == ["post", "take"]
    executor.abort_iteration()
    log.clear()
    fresh = PostingComm(LoneInput(shape), log)
    executor.set_plan(plan, fresh)
    executor.run_iteration(0)
    assert [kind for kind, _, _ in log][:1] == ["post"] and "recv" not in [kind for kind, _, _ in log]


class LoneInput:
    """Stage 1 of 2 alone: every received activation is a fresh tensor of ones; sends cost nothing."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        pass

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype)

    def flush(self) -> None:
        pass

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        pass
