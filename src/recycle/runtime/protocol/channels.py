"""The control plane between the coordinator and the workers: the job's store (bound to one address, every peer
authenticated by the job token, every process named so that it can be fenced) and the key names (the records written
under them are in runtime.protocol.records)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from recycle.errors import ConfigError
from recycle.runtime.protocol.records import (Announcement, Beat, ErrorRecord, EvalRecord, FaultRecord, JobSettings,
                                              Joined, JoinReady, MigrationRecord, NodeHello, NodeStarted, NodeSteps,
                                              NodeStops, StepRecord, StoppedReport, Timestamp, TransferRecord,
                                              WorkerResync, decode, encode)
from recycle.runtime.protocol.store import StoreClient, StoreServer
from recycle.runtime.protocol.store.capacity import connection_limit, ensure_descriptors
from recycle.runtime.protocol.store.server import StoreLimits
from recycle.runtime.protocol.token import TOKEN_ENV, new_token, read_token

__all__ = ["TOKEN_ENV", "new_token", "read_token", "host_store", "connect_store", "new_incarnation",
           "worker_identity", "worker_fence_prefix", "launcher_identity", "launcher_fence_prefix", "launcher_node",
           "Keys", "Channel", "Channels", "Flag", "Flags", "JobStore"]

def host_store(address: str, port: int, token: str, connections: int = 0) -> StoreServer:
    """The job's store, listening on `address` only (loopback for a single-node run) and serving only processes that
    prove they hold the job token, sized for `connections` at once (store.capacity; 0: a node's own store); started."""
    if connections:
        ensure_descriptors(connections, "the job's store")
    try:
        server = StoreServer(address, port, token, StoreLimits(max_connections=connection_limit(connections)))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {address}:{port} for the job's store ({exc.strerror}); pick another "
                          "--master-port, or an address of this machine for --master-addr") from None
    # What tells the job's processes that they reconnected to another store (a restarted coordinator's, which starts
    # empty) rather than to the same one after a network blip: they then write again what it lacks.
    server.data.set(Keys.STORE_INSTANCE.encode(), secrets.token_hex(8).encode())
    return server.start()


def connect_store(host: str, port: int, token: str, identity: str, timeout_s: float,
                  on_fenced: Callable[[], None] | None = None, connect_timeout_s: float = 60.0) -> StoreClient:
    """An authenticated connection to the job store as `identity` (see worker_identity, launcher_identity)."""
    return StoreClient(host, port, token, identity, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                       on_fenced=on_fenced)


def new_incarnation() -> str:
    """What tells two processes that ran as the same rank apart: a fenced one cannot come back as its successor."""
    return secrets.token_hex(6)


def worker_identity(rank: int, incarnation: str) -> str:
    return f"{worker_fence_prefix(rank)}{incarnation}"


def worker_fence_prefix(rank: int) -> str:
    """Fencing this prefix shuts out every process that has run as `rank` so far (not a replacement started later)."""
    return f"worker/{rank}/"


def launcher_identity(node: int, incarnation: str) -> str:
    return f"{launcher_fence_prefix(node)}{incarnation}"


def launcher_fence_prefix(node: int) -> str:
    return f"launcher/{node}/"


def launcher_node(identity: str) -> int | None:
    """The node of a launcher_identity; None for any other identity."""
    kind, _, rest = identity.partition("/")
    node = rest.partition("/")[0]
    return int(node) if kind == "launcher" and node.isdigit() else None


class Keys:
    """Key names in the job store."""

    NODE_HEARTBEATS = "node_hb/"  # the prefix of every node launcher's beat count

    @staticmethod
    def heartbeat(rank: int) -> str:
        """A worker's Beat record (runtime.records): its beat count and how far its main thread has got."""
        return f"hb/{rank}"

    @staticmethod
    def node_heartbeat(node: int) -> str:
        """A node launcher's beat count: a node whose launcher stops beating is frozen or cut off."""
        return f"{Keys.NODE_HEARTBEATS}{node}"

    @staticmethod
    def announce(generation: int) -> str:
        return f"gen{generation}/announce"

    @staticmethod
    def plan_view(generation: int, rank: int) -> str:
        """Worker `rank`'s part of its view of the generation's plan (ir.worker_view.PlanViews.encoded_tails): what
        it runs, a few KB at any scale; its view is plan_shared's value followed by this one."""
        return f"gen{generation}/plan/{rank}"

    @staticmethod
    def plan_shared(generation: int) -> str:
        """What every worker's view of the generation's plan starts with (PlanViews.shared), stored once: it grows
        with the micro-batches the failures moved."""
        return f"gen{generation}/plan_shared"

    @staticmethod
    def completion_view(generation: int, rank: int) -> str:
        """How worker `rank` finishes the interrupted iteration in `generation` (its view of ir.completion's
        Completion: its steps and its senders'), when the survivors keep their work."""
        return f"gen{generation}/completion/{rank}"

    @staticmethod
    def abort(generation: int) -> str:
        return f"gen{generation}/abort"

    @staticmethod
    def stopped(generation: int, rank: int) -> str:
        # Not under gen{G}/: the coordinator learns of these from its store's feed, by prefix.
        return f"stopped/{generation}/{rank}"

    @staticmethod
    def respawn(rank: int) -> str:
        return f"respawn/{rank}"

    @staticmethod
    def drain(generation: int) -> str:
        return f"gen{generation}/drain"

    @staticmethod
    def join_ready(rank: int) -> str:
        return f"join/{rank}/ready"

    @staticmethod
    def join_generation(rank: int) -> str:
        return f"join/{rank}/generation"

    @staticmethod
    def transfer(generation: int, rank: int) -> str:
        return f"gen{generation}/transfer/{rank}"

    @staticmethod
    def migration(generation: int, rank: int) -> str:
        """What a worker's layer re-partition moved in this generation (layers in and out, bytes, seconds)."""
        return f"gen{generation}/migration/{rank}"

    @staticmethod
    def joined(generation: int, rank: int) -> str:
        # Not under gen{G}/: a node launcher learns of these from its node store's feed, by prefix (NodeStarted).
        return f"joined/{generation}/{rank}"

    @staticmethod
    def resumed(generation: int, rank: int) -> str:
        return f"resumed/{generation}/{rank}"

    @staticmethod
    def process_groups(generation: int) -> str:
        return f"gen{generation}/pg"

    @staticmethod
    def metrics(step: int, rank: int) -> str:
        return f"metrics/{step}/{rank}"

    @staticmethod
    def node_metrics(step: int, node: int, seq: int) -> str:
        """A node launcher's step records of `step`, its write number `seq` (records.NodeSteps)."""
        return f"node_metrics/{step}/{node}/{seq}"

    @staticmethod
    def node_stopped(generation: int, node: int, seq: int) -> str:
        """A node launcher's digest of its workers' stop reports of `generation`, its write number `seq`
        (records.NodeStops). Not under gen{G}/: the coordinator learns of these from its store's feed, by prefix."""
        return f"node_stopped/{generation}/{node}/{seq}"

    @staticmethod
    def node_started(generation: int, node: int, seq: int) -> str:
        """A node launcher's digest of its workers' Joined and Resumed records of `generation`, its write number
        `seq` (records.NodeStarted); learned of from the store's feed, by prefix."""
        return f"node_started/{generation}/{node}/{seq}"

    @staticmethod
    def evaluation(done_steps: int) -> str:
        return f"eval/{done_steps}"

    @staticmethod
    def checkpointed(done_steps: int, stage: int) -> str:
        return f"ckpt/{done_steps}/{stage}"

    @staticmethod
    def error(rank: int) -> str:
        return f"error/{rank}"

    @staticmethod
    def fault(rank: int) -> str:
        return f"fault/{rank}"

    @staticmethod
    def exited(rank: int) -> str:
        return f"exit/{rank}"

    @staticmethod
    def silent(rank: int) -> str:
        return f"silent/{rank}"

    @staticmethod
    def fence(rank: int) -> str:
        return f"fence/{rank}"

    @staticmethod
    def node_done(node: int) -> str:
        return f"node_done/{node}"

    @staticmethod
    def job() -> str:
        return "job"

    @staticmethod
    def node_hello(node: int) -> str:
        return f"node/{node}/hello"

    @staticmethod
    def resync(rank: int) -> str:
        return f"resync/{rank}"

    STORE_INSTANCE = "store/instance"  # set once by the process that serves the store: a restarted one has another

    ABORT_RUN = "abort"
    HANG_LIMIT = "hang_limit"  # seconds one action may compute, as the coordinator last set it (launchers read it)
    FINISHED = "finished"
    RUNNING = "running"  # the first step is done: a node launcher that starts now is a repaired node


R = TypeVar("R")


@dataclass(frozen=True)
class Channel(Generic[R]):
    """A key of the job store and the one record type written under it: declared once (Channels), read and written
    only through JobStore, so a reader can never take one record for another."""

    key: Callable[..., str]  # the key's name from its fields (a Keys method)
    record: type[R]


class Channels:
    """Every typed record the job's processes exchange, by key."""

    JOB = Channel(Keys.job, JobSettings)  # (): what every process of the run must agree on
    HEARTBEAT = Channel(Keys.heartbeat, Beat)  # (rank)
    ANNOUNCE = Channel(Keys.announce, Announcement)  # (generation)
    STOPPED = Channel(Keys.stopped, StoppedReport)  # (generation, rank)
    JOIN_READY = Channel(Keys.join_ready, JoinReady)  # (rank)
    JOINED = Channel(Keys.joined, Joined)  # (generation, rank)
    RESUMED = Channel(Keys.resumed, Timestamp)  # (generation, rank)
    TRANSFER = Channel(Keys.transfer, TransferRecord)  # (generation, rank)
    MIGRATION = Channel(Keys.migration, MigrationRecord)  # (generation, rank)
    METRICS = Channel(Keys.metrics, StepRecord)  # (step, rank): on the job's store, or on the node's (NodeSteps)
    NODE_METRICS = Channel(Keys.node_metrics, NodeSteps)  # (step, node, seq)
    NODE_STOPPED = Channel(Keys.node_stopped, NodeStops)  # (generation, node, seq)
    NODE_STARTED = Channel(Keys.node_started, NodeStarted)  # (generation, node, seq)
    EVAL = Channel(Keys.evaluation, EvalRecord)  # (done steps)
    ERROR = Channel(Keys.error, ErrorRecord)  # (rank)
    FAULT = Channel(Keys.fault, FaultRecord)  # (rank)
    HELLO = Channel(Keys.node_hello, NodeHello)  # (node): a node launcher's first word to a store
    RESYNC = Channel(Keys.resync, WorkerResync)  # (rank): a worker's state, told to a restarted coordinator


@dataclass(frozen=True)
class Flag:
    """A key of the job store that only matters by being there; what it holds, if anything, is a short text (a
    reason for people, an exit code). Declared once (Flags), tested and raised only through JobStore."""

    key: str | Callable[..., str]  # a fixed name, or the name from its fields (a Keys method)

    def name(self, *key: int) -> str:
        return self.key if isinstance(self.key, str) else self.key(*key)


class Flags:
    """Every flag the launchers and the coordinator raise, by key."""

    FINISHED = Flag(Keys.FINISHED)  # the run is over (multi-node: the other launchers stop)
    ABORT_RUN = Flag(Keys.ABORT_RUN)  # the run failed: holds the message
    RUNNING = Flag(Keys.RUNNING)
    ABORT = Flag(Keys.abort)  # (generation): its workers stop at their next action; holds the reason
    EXITED = Flag(Keys.exited)  # (rank): a remote worker's process ended; holds its exit code
    # (rank): a remote worker stopped beating (frozen) or is hung, as its node's launcher sees it; holds the cause
    SILENT = Flag(Keys.silent)
    FENCE = Flag(Keys.fence)  # (rank): kill the remote worker; holds the reason
    RESPAWN = Flag(Keys.respawn)  # (rank): start the remote worker again; holds the reason
    NODE_DONE = Flag(Keys.node_done)  # (node)
    CHECKPOINTED = Flag(Keys.checkpointed)  # (done steps, stage): the stage's shard of that step is written


class JobStore:
    """Typed access to the job store: `put` a record on a channel, `read` it (None when absent) or `get` it (waits
    for it); raise, test and lower flags. `raw` is the store itself, for the plain keys (abort, drain, counters, the
    plan)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def put(self, channel: Channel[R], record: R, *key: int) -> None:
        self.raw.set(channel.key(*key), encode(record))

    def read(self, channel: Channel[R], *key: int) -> R | None:
        value = self.raw.try_get(channel.key(*key))
        return None if value is None else decode(channel.record, value)

    def get(self, channel: Channel[R], *key: int) -> R:
        return decode(channel.record, self.raw.get(channel.key(*key)))

    def delete(self, channel: Channel[Any], *key: int) -> None:
        self.raw.delete_key(channel.key(*key))

    def is_set(self, flag: Flag, *key: int) -> bool:
        return bool(self.raw.check([flag.name(*key)]))

    def raise_flag(self, flag: Flag, *key: int, text: str = "1") -> None:
        self.raw.set(flag.name(*key), text)

    def lower_flag(self, flag: Flag, *key: int) -> None:
        self.raw.delete_key(flag.name(*key))

    def flag_text(self, flag: Flag, *key: int) -> str | None:
        """What a raised flag holds; None while it is not raised."""
        value = self.raw.try_get(flag.name(*key))
        return None if value is None else value.decode()
