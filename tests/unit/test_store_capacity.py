"""The job store is sized for the job: three connections per worker process and one per node launcher, with the
open-file limit raised to fit, or a clear error naming the limit to set."""

from __future__ import annotations

import resource
import secrets

import pytest

from recycle.errors import ConfigError
from recycle.runtime.protocol.channels import connect_store, host_store
from recycle.runtime.protocol.store import capacity
from recycle.runtime.protocol.store.capacity import connection_limit, connections_needed, ensure_descriptors


def test_the_need_grows_with_the_processes_and_the_limit_never_falls_below_the_default() -> None:
    assert connections_needed(16384, 2048) == 3 * 16384 + 2 * 2048 + capacity.SPARE_CONNECTIONS
    assert connection_limit(connections_needed(8, 2)) == capacity.DEFAULT_MAX_CONNECTIONS
    assert connection_limit(connections_needed(16384, 2048)) == connections_needed(16384, 2048)


class _Limits:
    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard
        self.set_to: tuple[int, int] | None = None

    def get(self, which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        self.set_to = limits


@pytest.mark.parametrize("soft, hard, connections, raised_to", [
    (1024, 65536, 100, None),  # fits already
    (1024, 65536, 50000, 50000 + capacity.SPARE_CONNECTIONS),  # raised to what it needs, below the hard limit
    (resource.RLIM_INFINITY, resource.RLIM_INFINITY, 10 ** 6, None),
])
def test_the_soft_limit_is_raised_only_as_far_as_needed(monkeypatch, soft: int, hard: int, connections: int,
                                                          raised_to: int | None) -> None:
    limits = _Limits(soft, hard)
    monkeypatch.setattr(resource, "getrlimit", limits.get)
    monkeypatch.setattr(resource, "setrlimit", limits.set)
    ensure_descriptors(connections, "the job's store")
    assert limits.set_to == (None if raised_to is None else (raised_to, hard))


def test_a_hard_limit_too_low_is_refused_naming_the_limit_to_set(monkeypatch) -> None:
    limits = _Limits(1024, 4096)
    monkeypatch.setattr(resource, "getrlimit", limits.get)
    monkeypatch.setattr(resource, "setrlimit", limits.set)
    need = connections_needed(4096, 512)
    with pytest.raises(ConfigError, match=rf"the job's store must hold up to {need:,} connections .* only 4,096 .*"
                                          rf"ulimit -Hn {need + capacity.SPARE_CONNECTIONS}"):
        ensure_descriptors(need, "the job's store")
    assert limits.set_to is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_store_sized_for_1500_processes_holds_more_than_the_default_4096_connections() -> None:
    need = connections_needed(1500, 200)
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * need + 512:
        pytest.skip("this machine's hard open-file limit is too low for both ends of the connections")
    token = secrets.token_hex(24)
    server = host_store("127.0.0.1", 0, token, need)
    clients = []
    try:
        for i in range(capacity.DEFAULT_MAX_CONNECTIONS + 100):
            client = connect_store("127.0.0.1", server.port, token, f"test-{i}", 30.0, connect_timeout_s=10.0)
            client.set(f"k{i % 7}", b"x")  # authenticated and served
            clients.append(client)
        assert clients[-1].try_get("k0") == b"x"
    finally:
        for client in clients:
            client.close()
        server.close()
