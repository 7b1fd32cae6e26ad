"""Messages implied by a plan: the per-pair send order, tags, and a plan for another topology refused."""

from __future__ import annotations

import pytest

from recycle.errors import PlanError
from recycle.runtime.control.launcher import _check_options
from recycle.runtime.options import LaunchOptions
from recycle.runtime.protocol.messages import Channel, check_plan_matches, message_tag, send_order
from recycle.schedules.fault_free import build_schedule


def test_send_order_follows_the_senders_list(tiny_config) -> None:
    plan = build_schedule(tiny_config(M=3), "1f1b")
    # worker (0,0) sends its three activations to (0,1) in forward order; (0,1) sends gradients back likewise.
    assert [m.mb for m in send_order(plan, 0, 1)] == [0, 1, 2]
    assert {m.channel for m in send_order(plan, 0, 1)} == {Channel.ACTIVATION}
    assert [m.mb for m in send_order(plan, 1, 0)] == [0, 1, 2]
    assert send_order(plan, 0, 3) == []
    tags = {message_tag(c, mb) for c in Channel for mb in range(1000)}
    assert len(tags) == len(Channel) * 1000  # distinct across channels and micro-batches


def test_plan_for_another_topology_is_rejected(tiny_config) -> None:
    plan = build_schedule(tiny_config(M=2), "1f1b")
    with pytest.raises(PlanError, match="M=2 but the config has D=2, S=2, M=4"):
        check_plan_matches(plan, 2, 2, 4)
    with pytest.raises(PlanError, match="D=2, S=2, M=2"):
        _check_options(tiny_config(M=4), plan, LaunchOptions())
