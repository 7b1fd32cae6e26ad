"""A node launcher that follows a coordinator elsewhere beats once per heartbeat interval, not once per pass of its
loop (10 a second): the store's requests per node grow with the beat rate, and the coordinator needs only a few
beats per timeout to tell a silent node."""

from __future__ import annotations

from recycle.runtime.control.launcher import _Following, _follow_once
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.protocol.channels import Flags, JobStore, Keys
from recycle.runtime.protocol.store.client import LocalStore
from recycle.runtime.protocol.store.data import KeyValue


class _Workers:
    ranks = [2, 3]

    def exitcode(self, rank: int) -> int | None:
        return None

    def pid(self, rank: int) -> int:
        return 100 + rank


class _Quiet:
    """The node watch, the step forwarder and the stop forwarder, doing nothing."""

    error = None
    running: frozenset[int] = frozenset()

    def check(self, *args: object) -> None: ...

    def forward(self, *args: object) -> None: ...


def _beats(jobs: JobStore) -> int:
    return int(jobs.raw.try_get(Keys.node_heartbeat(0)) or 0)


def test_a_following_launcher_beats_once_per_heartbeat_interval_and_at_once_for_a_restarted_coordinator() -> None:
    jobs = JobStore(LocalStore(KeyValue()))
    options = with_keywords(LaunchOptions(), dict(heartbeat_s=0.5, heartbeat_timeout_s=4.0))
    following, quiet = _Following(), _Quiet()
    for rank in _Workers.ranks:  # told to fence nobody: every pass waits out its 0.1 s on the coordinator's word
        following.killed[rank] = None
    passes = [0.125 * i for i in range(17)]  # 2 s of a loop's passes (binary fractions: exact sums)
    for now in passes:
        assert not _follow_once(jobs, _Workers(), options, None,  # type: ignore[arg-type]
                                following, quiet, quiet, quiet, now)
    assert _beats(jobs) == 5  # at 0, 0.5, 1.0, 1.5 and 2.0 s: not 17
    following.forget()  # a restarted coordinator's store is empty: the next pass beats whatever the interval
    assert not _follow_once(jobs, _Workers(), options, None,  # type: ignore[arg-type]
                            following, quiet, quiet, quiet, 2.125)
    assert _beats(jobs) == 6
    # A short timeout beats at least 4 times in it, whatever the interval.
    jobs2 = JobStore(LocalStore(KeyValue()))
    short = with_keywords(LaunchOptions(), dict(heartbeat_s=0.5, heartbeat_timeout_s=1.0))
    following2 = _Following(killed={rank: None for rank in _Workers.ranks})
    for now in passes[:9]:
        _follow_once(jobs2, _Workers(), short, None, following2, quiet, quiet, quiet, now)  # type: ignore[arg-type]
    assert _beats(jobs2) == 5  # every 0.25 s over 1 s
    assert not jobs.is_set(Flags.EXITED, 2)
