"""Fixtures of the thread-cluster tier (the harness: thread_cluster.py)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
from thread_cluster import Injector, Outcome, ThreadCluster, job

from recycle.config import Config

_warm: list[bool] = []


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker(one_torch_thread: None) -> None:
    """Every test here runs workers on threads (tests/conftest.py, one_torch_thread)."""


@pytest.fixture()
def run_cluster(tiny_config: Callable[..., Config],
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Outcome]]:
    """run_cluster(config, injector=None, **launch options) -> Outcome: the job run to its end on worker threads;
    every thread and the store are gone after the test."""
    clusters: list[ThreadCluster] = []

    def run(config: Config, injector: Injector | None = None, **options: Any) -> Outcome:
        monkeypatch.setenv("RECYCLE_TEST_UNFENCEABLE",
                           ",".join(str(r) for r in range(config.num_replicas * config.num_stages)))
        cluster = job(config, injector or Injector(), **options)
        clusters.append(cluster)
        return cluster.run()

    if not _warm:
        # What a process does once (measured: about 1 s, most of it in the first step's stage-0 work), in the first
        # scenario's setup, so that each scenario's time is its own.
        run(tiny_config(steps=1))
        _warm.append(True)
    yield run
    for cluster in clusters:
        cluster.close()
