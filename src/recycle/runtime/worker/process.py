"""The worker process: joins the job's store, builds its stage, runs the plan step by step, and when a peer fails
leaves the broken generation, reports, and continues in the next one on the coordinator's new plan."""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Callable, cast

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.errors import ConfigError, RecycleError
from recycle.ir import Action, Plan
from recycle.ir.completion import Completion
from recycle.ir.worker import Worker
from recycle.ir.worker_view import read_worker_view
from recycle.models.gpt import GPTStage
from recycle.models.tensor_parallel import local_tensor, parallelize_stage, whole_state, whole_state_dict
from recycle.runtime.options import (Backend, CheckpointOptions, ClusterOptions, DebugOptions, OutputOptions,
                                     RecoveryOptions)
from recycle.runtime.protocol.channels import Channels, Flags, JobStore, Keys, connect_store, worker_identity
from recycle.runtime.protocol.records import (Announcement, Beat, ErrorRecord, EvalRecord, FaultRecord, Joined,
                                              JoinReady, MigrationRecord, StepRecord, StoppedReport, Timestamp,
                                              TransferRecord, WorkerResync, from_json)
from recycle.runtime.protocol.store import StoreClient, StoreFenced, StoreUnavailable
from recycle.runtime.protocol.store.data import drain_socket
from recycle.runtime.state import checkpoint
from recycle.runtime.state.checkpoint_writer import CheckpointWriter
from recycle.runtime.state.migration import (exchange_layers, layer_moves, layer_scaled_config, plan_bounds,
                                             rebuild_stage)
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.state.state_transfer import transfer_stage_state
from recycle.runtime.tools.faults import FaultInjection, fire
from recycle.runtime.worker.chunked_executor import ChunkedStageExecutor
from recycle.runtime.worker.chunked_stage import chunked_built_stage, data_stages
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.emulate import cost_pacer
from recycle.runtime.worker.evaluation import evaluate
from recycle.runtime.worker.executor import StageExecutor
from recycle.runtime.worker.nccl_env import prepare_nccl
from recycle.runtime.worker.outbox import Outbox, SilentOutbox
from recycle.runtime.worker.stage import BuiltStage, build_stage, tied_stages
from recycle.runtime.worker.tensor_parallel import (RankBeats, bind_mesh, check_worker_features, rank_beat_key,
                                                    ready_key, tp_degree, worker_mesh)
from recycle.runtime.worker.title import set_process_title
from recycle.runtime.worker.tp_agreement import StopPoint, post_stop_point, tp_split
from recycle.runtime.worker.transport import Activity, GenerationCut, Transport, is_comm_error

__all__ = ["WorkerSpec", "WorkerHooks", "FaultInjection", "GenerationAborted", "worker_main", "run_worker",
           "make_optimizer", "parameter_digest", "EXIT_FENCED"]

EXIT_FENCED = 4  # the coordinator left this worker out of the new generation (or fenced it while it was frozen)
EXIT_RANK_FROZEN = 5  # TP rank 0: another rank of its worker stopped beating (the worker is lost with it)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int  # topology rank = replica * S + stage
    config: Config
    plan_json: str
    cluster: ClusterOptions  # as resolved by the launcher: the store's real port, the job secret, the backend
    start_step: int
    end_step: int  # exclusive
    model_factory: str = ""  # "package.module:function" (runtime.stage); "" = the built-in GPT
    outputs: OutputOptions = OutputOptions()
    checkpoint: CheckpointOptions = CheckpointOptions()  # its resume_dir holds the run's start_step state
    recovery: RecoveryOptions = RecoveryOptions()
    debug: DebugOptions = DebugOptions()
    faults: tuple[FaultInjection, ...] = ()  # this worker's scripted faults
    device_index: int = 0
    joining: bool = False  # a replacement: waits to be admitted, then takes its stage's state from a peer
    incarnation: str = ""  # this process among every one that runs as `rank` (the store fences by it)
    # The node's own store (127.0.0.1, hosted by a node launcher that does not host the coordinator): this worker
    # beats there, and its launcher tells the coordinator only about silent or hung workers (0: beat to the job's).
    node_store_port: int = 0
    joiner_dies_at: str = ""  # tests only: RECYCLE_TEST_JOINER_DIES as the launcher saw it (see _joiner_dies_here)
    tp_rank: int = 0  # this process among its worker's [topology] gpus_per_worker tensor-parallel ranks
    grad_norm: bool = True  # compute the stage's squared gradient norm for the metric (the job's wants_grad_norm)

    @property
    def tp_degree(self) -> int:
        return tp_degree(self.config)

    @property
    def backend(self) -> Backend:
        assert self.cluster.backend is not None, "the launcher resolves the backend"
        return self.cluster.backend


class GenerationAborted(Exception):
    """The coordinator ended the current generation (a peer failed); stop at this action and report."""


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests mean bit-identical replicas (with tensor parallelism, of this
    rank's shards: replicas compare rank by rank)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(local_tensor(tensor).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _watch_launcher(launcher_alive: Connection) -> None:
    """Exit as soon as the launcher disappears, so no worker outlives its job. The thread sleeps in a blocking read
    of a pipe whose only writer is the launcher: no polling, and EOF arrives the moment the launcher dies."""
    try:
        launcher_alive.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(3)


def _store_peers(host: str, port: int) -> set[tuple[str, int]]:
    """The addresses the job store answers on: a generation's abort never cuts these connections."""
    try:
        return {(str(info[4][0]), port) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return {(host, port)}


def _connect(spec: WorkerSpec) -> StoreClient:
    """One connection of this worker to the job store; once the coordinator has fenced this process, its first
    request ends it with one line (it must not write anything the job reads, nor carry on with stale state)."""
    replica_stage = "%d:%d" % divmod(spec.rank, spec.config.num_stages)

    def fenced() -> None:
        sys.stderr.write(f"recycle: worker {replica_stage} (rank {spec.rank}, pid {os.getpid()}) was fenced: the "
                         "coordinator declared it dead while it did not respond and went on without it; it exits "
                         "without touching the job\n")
        sys.stderr.flush()
        os._exit(EXIT_FENCED)

    cluster = spec.cluster
    return connect_store(cluster.master_addr, cluster.master_port, cluster.token,
                         worker_identity(spec.rank, spec.incarnation), max(spec.recovery.timeout_s, 30.0),
                         on_fenced=fenced)


def _connect_node_store(spec: WorkerSpec) -> StoreClient:
    """One connection of this worker to its node launcher's own store (beats, step records)."""
    return connect_store("127.0.0.1", spec.node_store_port, spec.cluster.token,
                         worker_identity(spec.rank, spec.incarnation), 30.0)


@dataclass(frozen=True)
class WorkerHooks:
    """What a worker reaches outside its own code through: each store connection (a fenced one ends the process),
    each generation's transport (runtime.transport.Transport's signature), a scripted fault carried out. A worker
    process takes these; the thread-cluster tests (tests/threads) run the same worker code as threads with their
    own (in-memory transport, a thread's death for a process's)."""

    connect: Callable[[WorkerSpec], Any] = _connect
    transport: Callable[..., Any] = Transport
    fire: Callable[[FaultInjection, str], None] = fire


class _Watcher(threading.Thread):
    """The worker's second thread, on a store connection of its own: beats every `interval_s` with how far the main
    thread has got (records.Beat), and waits in the store for the abort or drain of the current generation. On an
    abort it cuts the generation's communicators itself (`on_abort`), so a main thread blocked on a frozen or
    silent peer raises at once; nothing here waits on any peer. A frozen process stops beating: that is how the
    coordinator tells a frozen worker from a slow one; a stuck main thread stops advancing `actions`. It also writes
    what the worker's outbox holds once the store is back after an outage (a restarted coordinator)."""

    def __init__(self, spec: WorkerSpec, activity: Activity, on_abort: Any,
                 connect: Callable[[WorkerSpec], Any], outbox: Outbox) -> None:
        super().__init__(daemon=True, name="recycle-watcher")
        self.store = connect(spec)
        self.outbox = outbox
        # Beats go to the node launcher's own store when it has one (it watches its workers and tells the coordinator
        # only about the silent or hung ones), else to the job's store.
        # They are sent by a thread of their own then: a coordinator that is away (the watcher waits for it to come
        # back) must not silence a live worker in its launcher's eyes.
        self.beats_apart = bool(spec.node_store_port)
        # A worker beats through its TP rank 0 (one heartbeat per worker); its other ranks count their beats in the
        # store for rank 0 alone, which ends the worker when one of them freezes (RankBeats). A rank's death is its
        # launcher's to see (control.processes.WorkerGroup).
        self.beating = spec.tp_rank == 0
        self.tp_rank, self.tp_degree = spec.tp_rank, spec.tp_degree
        self.rank_beats = RankBeats(spec.recovery.heartbeat_timeout_s)
        self.worker = Worker(*divmod(spec.rank, spec.config.num_stages))
        self.beats_to = JobStore(_connect_node_store(spec) if spec.node_store_port else self.store)
        self.jobs = JobStore(self.store)
        self.rank = spec.rank
        self.incarnation = spec.incarnation
        self.interval_s = spec.recovery.heartbeat_s
        self.idle_wait_s = max(self.interval_s, spec.recovery.heartbeat_timeout_s)
        self.activity = activity
        self.on_abort = on_abort
        self.generation = 0
        # Readable once the main thread has moved to another generation (move_to): the store wait on the keys of
        # the one it watched ends at once, to watch the new one's.
        self._moved, self._mover = socket.socketpair()
        self._moved.setblocking(False)
        self._mover.setblocking(False)
        self.aborted = -1  # the newest generation seen aborted
        self.drain: tuple[int, int] | None = None  # (generation, step): stop before that step (a joiner waits)
        self.beats = 0

    def move_to(self, generation: int) -> None:
        """The main thread's generation from now on (any thread)."""
        self.generation = generation
        try:
            self._mover.send(b"g")
        except OSError:
            pass  # already readable

    def _watched(self) -> list[tuple[str, str, int]]:
        """(key, what, generation) for the current generation and the next (the main thread may move on while this
        thread waits), minus what was already seen."""
        watched = []
        for generation in (self.generation, self.generation + 1):
            if self.aborted < generation:
                watched.append((Keys.abort(generation), "abort", generation))
            if self.drain is None or self.drain[0] < generation:
                watched.append((Keys.drain(generation), "drain", generation))
        return watched

    def _beat(self) -> None:
        if not self.beating:
            self.beats += 1
            self.beats_to.raw.set(rank_beat_key(self.rank, self.tp_rank), str(self.beats))
            return
        self._watch_ranks()
        self.beats += 1
        self.beats_to.put(Channels.HEARTBEAT, Beat(self.beats, self.activity.actions, self.activity.phase,
                                                   self.incarnation), self.rank)

    def _watch_ranks(self) -> None:
        """TP rank 0: end the worker (its launcher then kills every rank) once another of its ranks has frozen."""
        if self.tp_degree == 1:
            return
        now = time.monotonic()
        for t in range(1, self.tp_degree):
            self.rank_beats.saw(t, self.beats_to.raw.try_get(rank_beat_key(self.rank, t)), now)
        frozen = self.rank_beats.frozen(now)
        if frozen:
            sys.stderr.write(f"recycle: TP rank(s) {frozen} of worker {self.worker} sent no beat for "
                             f"{self.rank_beats.timeout_s:g} s (frozen): the worker leaves, and its launcher stops "
                             "every rank of it\n")
            sys.stderr.flush()
            os._exit(EXIT_RANK_FROZEN)

    def _beat_forever(self) -> None:
        """Beats to the node's store, whatever the job's store is doing."""
        while True:
            try:
                self._beat()
            except StoreFenced:
                return
            except Exception:
                pass  # the node's store is in the launcher: if that is gone, this worker exits (_watch_launcher)
            time.sleep(self.interval_s)

    def run(self) -> None:
        if self.beats_apart:  # (a TP rank > 0 counts its beats there for its rank 0, which reads the same store)
            threading.Thread(target=self._beat_forever, daemon=True, name="recycle-beat").start()
        next_beat = 0.0
        while True:
            try:
                if self.outbox.needs_sync():
                    self.outbox.sync(self.store)
                now = time.monotonic()
                if now >= next_beat:
                    if not self.beats_apart:
                        self._beat()
                    next_beat = now + self.interval_s
                drain_socket(self._moved)
                watched = self._watched()
                keys = [key for key, _, _ in watched]
                if self.beats_apart:
                    # Beats go from their own thread: one wait per heartbeat timeout while nothing happens (it was
                    # one per beat: two a second per worker at 0.5 s), ended by an abort or drain key, or when the
                    # main thread moves to another generation.
                    hit = self.store.wait_any(keys, self.idle_wait_s, wake=[self._moved])
                else:
                    hit = self.store.wait_any(keys, max(0.0, next_beat - time.monotonic()))
                if hit is None:
                    continue
                key, what, generation = watched[hit]
                if what == "abort":
                    self.aborted = max(self.aborted, generation)
                    self.on_abort(generation)
                else:
                    self.drain = (generation, int(self.store.get(key)))
            except StoreFenced:
                return  # the callback has ended the process
            except StoreUnavailable:
                # The coordinator (and its store) is gone: training goes on, writes wait in the outbox, and this
                # thread reconnects (to a restarted coordinator, it tells where the worker stands).
                self.outbox.down = True
                time.sleep(self.interval_s)
            except Exception:
                time.sleep(self.interval_s)  # keep trying


def _thread_lock_for_progress_bars() -> None:
    """torch.fx's Interpreter (which runs a torch.export/pipelining stage) opens a tqdm bar, whose class lock is a
    multiprocessing RLock, i.e. a named semaphore. A worker leaves by os._exit, so the resource tracker would find it
    and warn at shutdown ("leaked semaphore objects"). One process needs only a thread lock."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def worker_main(spec: WorkerSpec, launcher_alive: Connection | None = None) -> None:
    """Process entry point; exits non-zero after writing an error record to the store if anything fails."""
    torch.set_num_threads(1)
    # Before gloo's threads exist, which inherit it: ps, top and /proc name every thread of worker 1:1 'recycle 1:1'.
    worker = Worker(*divmod(spec.rank, spec.config.num_stages))
    set_process_title(f"recycle {worker}" + (f" tp{spec.tp_rank}" if spec.tp_degree > 1 else ""))
    _thread_lock_for_progress_bars()
    if spec.backend == "gloo" and spec.cluster.master_addr in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single machine: keep gloo on loopback
    if launcher_alive is not None:
        threading.Thread(target=_watch_launcher, args=(launcher_alive,), daemon=True).start()
    # Skip interpreter teardown: of gloo's threads (seconds) after a clean end, everything flushed and closed; of a
    # broken process group after a failure, which can hang in its destructor.
    os._exit(run_worker(spec, _connect(spec)))


def run_worker(spec: WorkerSpec, store: StoreClient, hooks: WorkerHooks = WorkerHooks()) -> int:
    """The worker's life on `store`; returns its exit code (0, EXIT_FENCED, or 1 after writing an error record to
    the store)."""
    try:
        if spec.backend == "nccl":
            # Before any communicator: errors reported, never an abort().
            prepare_nccl(os.environ, spec.recovery.timeout_s)
        _Worker(spec, store, hooks).run()
        sys.stdout.flush()
        sys.stderr.flush()
        return 0
    except (_Fenced, StoreFenced):
        # The store refuses a fenced process (its on_fenced callback normally ends it first): nothing to report.
        return EXIT_FENCED
    except BaseException as exc:  # report every failure, including a KeyboardInterrupt/SystemExit, then exit 1
        record = ErrorRecord(type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", is_comm_error(exc),
                             time.time(), traceback.format_exc())
        try:
            JobStore(store).put(Channels.ERROR, record, spec.rank)
        except Exception:
            pass
        if not record.comm and not isinstance(exc, RecycleError):  # a RecycleError's one line says it all
            traceback.print_exc()
        sys.stderr.flush()
        return 1


def _joiner_dies_here(hook: str, point: str) -> None:
    """Tests only (the launcher's RECYCLE_TEST_JOINER_DIES=POINT:MARKER_FILE, passed in the spec so that a forkserver
    started earlier does not hide it): a replacement SIGKILLs itself at this point of its admission, once per marker
    file (the next replacement gets in)."""
    where, _, marker = hook.partition(":")
    if where == point and marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


class AdmissionCut(GenerationCut):
    """A replacement's generation broke before its stage's state arrived: it exits (a communication failure, so
    the coordinator counts it as a dead replacement and it can be started again)."""


class _Fenced(Exception):
    """This worker is not in the new generation."""


def _recoverable(exc: BaseException) -> bool:
    return isinstance(exc, GenerationAborted) or is_comm_error(exc)


class _Worker:
    """One worker's life: generations of (join, run steps) separated by recoveries."""

    def __init__(self, spec: WorkerSpec, store: dist.Store, hooks: WorkerHooks) -> None:
        self.spec = spec
        self.hooks = hooks
        self.store = store
        self.jobs = JobStore(store)
        self.config = config = spec.config
        self.plan = Plan.from_json(spec.plan_json)
        self.replica, self.stage = self.plan.worker(spec.rank)
        self.generation = 0
        training, workload = config.training, config.workload
        self.device = torch.device(f"cuda:{spec.device_index}") if spec.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Every stage's [first, last) layers under the current plan (None: a factory or HF model, split fixed).
        fixed_split = bool(spec.model_factory or config.model.hf_config)  # a factory's or HF model's split is fixed
        # A chunked run (several chunks per worker) keeps its chunks' layers: no layer migration.
        self.chunked = config.topology.chunks_per_worker > 1
        self.bounds = None if fixed_split or self.chunked else plan_bounds(config, self.plan.partition)
        if fixed_split and self.plan.partition:
            raise ConfigError(f"the plan re-partitions layers ({list(self.plan.partition)} per stage), which only the "
                              "built-in GPT supports; run a plan without a partition with --model-factory / --hf")
        check_worker_features(config, spec.model_factory, bool(self.plan.partition))
        built = self._build()
        # Tensor parallelism: the stage is sharded before its optimizer exists (which holds its parameters), over a
        # mesh that each generation binds to its group of this worker's ranks (worker.tensor_parallel).
        self.mesh = worker_mesh(spec.tp_degree, spec.tp_rank, self.device.type) if spec.tp_degree > 1 else None
        if self.mesh is not None:
            parallelize_stage(built.module.to(self.device), self.mesh)  # on its device first: sliced there
        self.built = built
        self.tied_stages = tied_stages(config, spec.model_factory)  # every worker forms their group
        self.layers = built.layout
        # A factory's or Hugging Face model's stages are checkpointed under per-stage key prefixes (their names need
        # not be the whole model's); the built-in GPT's under the whole model's names (checkpoint.key_prefix).
        self._key_prefix = checkpoint.key_prefix(self.stage, spec.model_factory or config.model.hf_config)
        # Where the stage's state stands (the executors step it; recoveries roll it back, restore or receive it).
        self.position = IterationPosition(spec.start_step - 1)
        self.state = self._stage_state(built.module.to(self.device))
        if spec.checkpoint.resume_dir and not spec.joining:  # a replacement takes its state from the job instead
            checkpoint.load_stage(spec.checkpoint.resume_dir, spec.start_step, self.state)
        # Only the first stage (inputs) and the last (targets) load micro-batches, the holders of the first and the
        # last chunk in a chunked run; the others never open the data.
        self.data = data_source(config) if self.stage in data_stages(config) else None
        self.eval_data = data_source(config, "eval") \
            if training.eval_every and self.stage in data_stages(config) else None
        self.activity = Activity()
        self.phase = "admitting" if spec.joining else "training"  # where it stands, for a restarted coordinator
        self.outbox = Outbox(spec.rank, self._resync_status) if spec.tp_rank == 0 else SilentOutbox(spec.rank)
        self.heartbeat = _Watcher(spec, self.activity, self._abort_generation, hooks.connect, self.outbox)
        # Step records are written from a thread of their own: on stage 0 the write lay between the step's OPT and
        # the next iteration's first forward, the pipeline's critical path (docs/runtime-performance.md). A node
        # launcher with a store of its own takes them and hands the coordinator one record per node and step.
        if spec.tp_rank == 0:  # (the other TP ranks write nothing)
            self.outbox.start_writer(hooks.connect(spec), _connect_node_store(spec) if spec.node_store_port else None)
        self._transport_lock = threading.Lock()
        self._store_peers = _store_peers(spec.cluster.master_addr, spec.cluster.master_port)
        self.transport: Transport | None = None
        self.executor: StageExecutor | None = None
        self.announcement: Announcement | None = None  # of the current generation (None: generation 0)
        self.completion: Completion | None = None  # how to finish the interrupted iteration (a kept recovery)
        # A tensor-parallel worker's checkpoint is written by its rank 0 (gathered whole: _save_checkpoint).
        self.writer = CheckpointWriter(spec.checkpoint.dir, hooks.connect(spec), self._shard_written) \
            if spec.checkpoint.enabled and spec.tp_rank == 0 else None
        self._fired: set[FaultInjection] = set()
        self._resumed_pending = False
        # A replacement holds its stage's state only once it has arrived (from a replica, or the checkpoint); until
        # then it must never report itself as a survivor of a generation, or its unset weights would be trained on.
        self._holds_state = not spec.joining

    def _resync_status(self) -> WorkerResync:
        oldest = self.outbox.oldest_record()
        return WorkerResync(self.generation, self.phase,
                            self.position.applied + 1 if oldest is None else oldest, os.getpid(), self.spec.incarnation)

    def _shard_written(self, store: Any, done_steps: int, stage: int) -> None:
        """The checkpoint writer's word that a shard is complete (kept for a restarted coordinator)."""
        self.outbox.write(store, Keys.checkpointed(done_steps, stage), "1", kind="checkpointed", order=done_steps)

    def _take_announcement(self, generation: int) -> Announcement:
        """The coordinator's announcement of `generation` (waited for, as c10d's get does: one request), kept: a
        restarted coordinator's store learns it back."""
        raw = self.store.get(Keys.announce(generation))
        announcement = from_json(Announcement, raw)
        self.outbox.remember(Keys.announce(generation), raw, "announce")
        return announcement

    def _read_plan_view(self, generation: int) -> Plan:
        """This worker's view of `generation`'s plan: the start every view shares, stored once, then its own part
        (both in one request: a round trip per worker less on the way back to training)."""
        rank = self.spec.rank
        shared, own = self.store.multi_get([Keys.plan_shared(generation), Keys.plan_view(generation, rank)])
        return read_worker_view(shared + own, rank)

    # -- the life of a worker ------------------------------------------------------------------------------------
    def run(self) -> None:
        spec = self.spec
        self.heartbeat.start()
        step = self._admit() if spec.joining else spec.start_step
        while True:
            try:
                if step >= spec.end_step and self.generation > 0:
                    # A failure in the final barrier: every step is applied everywhere; nothing left to run together
                    # but a tensor-parallel stage's gather, which needs this generation's groups.
                    if self.mesh is not None:
                        self._join()
                        self._finish()
                    else:
                        self._save_final()
                    self._leave()
                    return
                self._join()
                self.phase = "training"
                while True:
                    # An evaluation after `step` steps; after a recovery that resumes here, it runs (again) in the
                    # new generation: every worker decides alike, from the step the coordinator announced. Not
                    # before a completion: the survivors had started that step, so its evaluation was done and
                    # reported, and a stage that kept its step holds weights past it.
                    completing = self.completion is not None and self.completion.iteration == step
                    if self._eval_due(step) and not completing:
                        self._stop_for_drain(step)
                        self._evaluate(step)
                    if step >= spec.end_step:
                        break
                    self._run_step(step)
                    step += 1
                self._finish()
                self._leave()
                return
            except Exception as exc:
                if not _recoverable(exc):
                    raise
                error = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            # Outside the except block: the traceback (which holds the failed op and so the broken group's
            # sockets) is gone before the groups are torn down, so peers still blocked on us see the close at once.
            if not self._holds_state:
                raise AdmissionCut(f"this replacement's admission was cut short ({error}) before its stage's state "
                                   "arrived; it leaves, to be started again")
            step = self._recover(step, error)

    def _join(self) -> None:
        """Form this generation's process groups and take its plan."""
        generation = self.generation
        self.heartbeat.move_to(generation)
        if self.jobs.is_set(Flags.ABORT, generation):
            raise GenerationAborted(f"generation {generation} was aborted before it formed")
        stage_ranks = {s: [self.plan.rank(p, s) for p in self.plan.live_replicas(s)]
                       for s in range(self.plan.num_stages)}
        tensor_parallel = {"tp_rank": self.spec.tp_rank, "tp_degree": self.spec.tp_degree} if self.mesh else {}
        transport = self.hooks.transport(self.store, generation, self.spec.rank, self.plan.live_ranks(), stage_ranks,
                                         self.spec.recovery.timeout_s, self.spec.backend, self.device, self.activity,
                                         self._store_peers, tied_stages=self.tied_stages, **tensor_parallel)
        with self._transport_lock:
            self.transport = transport
        if self.heartbeat.aborted >= generation:
            transport.abort()  # the watcher saw the abort before this transport existed
        transport.form()
        if self.mesh is not None:
            bind_mesh(self.mesh, transport.groups.tp_group)
        if self.spec.joining and self.announcement is not None and self.spec.rank in self.announcement.joining:
            _joiner_dies_here(self.spec.joiner_dies_at, "formed")
        # With a node store, through it: its launcher writes the coordinator one digest of its workers' Joined and
        # Resumed records (control.node_digests), not a request per worker and record.
        self.outbox.put(self.store, Channels.JOINED, Joined(time.time(), transport.formation_s, "init"), generation,
                        self.spec.rank, background=bool(self.spec.node_store_port))
        if self.executor is None:
            self.executor = self._make_executor()
            if self.announcement is not None:  # a replacement: its weights are the state after redo_step - 1
                self.position.restart(self.announcement.redo_step)
        else:
            self.executor.set_plan(self.plan, transport)
        self._migrate_layers()
        self._transfer_state()
        self._resumed_pending = generation > 0

    def _admit(self) -> int:
        """A replacement worker: say it is ready, wait to be admitted into a generation, take that generation's plan
        (and its checkpoint, when the run restores one); the stage's live state arrives after the groups form."""
        spec = self.spec
        if spec.tp_rank > 0:  # up: its rank 0 says the worker is ready once every rank is
            self.store.set(ready_key(spec.rank, spec.incarnation, spec.tp_rank), "up")
        else:
            peers = [ready_key(spec.rank, spec.incarnation, t) for t in range(1, spec.tp_degree)]
            if peers:
                self._wait_for_keys(peers)
                for peer in peers:
                    self.store.delete_key(peer)
            self.outbox.put(self.store, Channels.JOIN_READY, JoinReady(time.time(), os.getpid()), spec.rank,
                            kind="join")
        _joiner_dies_here(self.spec.joiner_dies_at, "ready")
        key = Keys.join_generation(spec.rank)
        self._wait_for_keys([key])
        self.outbox.forget(Keys.join_ready(spec.rank))
        self.generation = int(self.store.get(key))
        _joiner_dies_here(self.spec.joiner_dies_at, "admitted")
        self.announcement = self._take_announcement(self.generation)
        self.plan = self._read_plan_view(self.generation)
        self._take_layout()  # this generation's layer partition; the state arrives from a replica or the checkpoint
        if self.announcement.restore_step >= 0:
            self._load_checkpoint(self.announcement.restore_step)
            self._holds_state = True
        return self.announcement.redo_step

    def _wait_for_keys(self, keys: list[str]) -> None:
        """A replacement waits for `keys` in the store, as long as the run goes on (if it ends first, it leaves)."""
        while True:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=5))
                return
            except dist.DistStoreError:
                try:
                    finished = self.jobs.is_set(Flags.FINISHED)
                except StoreUnavailable:
                    continue  # the coordinator is away: wait for it (its launcher gives up on it, not this worker)
                if finished:
                    raise _Fenced() from None  # the run ended before this worker was needed

    def _abort_generation(self, generation: int) -> None:
        """The watcher saw `generation` aborted: cut its communicators now (the main thread may be blocked on a
        peer that will never answer)."""
        with self._transport_lock:
            transport = self.transport
        if transport is not None and transport.generation == generation:
            transport.abort()

    # -- layer partition -------------------------------------------------------------------------------------------
    def _stage_state(self, module: torch.nn.Module) -> StageState:
        """`module` with a new optimizer, at this worker's iteration position."""
        return StageState(module, make_optimizer(module, self.config.training), self.stage, self.position,
                          self._key_prefix)

    def _install(self, state: StageState, layers: tuple[int, int]) -> None:
        """Run from now on with this stage state (new layer range): the executor is rebuilt around it."""
        self.state, self.layers = state, layers
        self.built = replace(self.built, module=state.module, layout=layers)
        if self.executor is not None:
            self.executor = self._make_executor()

    def _take_layout(self) -> None:
        """Build this stage for the plan's partition with no state of its own (a replacement, or a restore that
        loads the checkpoint next)."""
        if self.bounds is None:
            return
        bounds = plan_bounds(self.config, self.plan.partition)
        self.bounds = bounds  # before _install: the cost pacing follows the partition
        if bounds[self.stage] != self.layers:
            current = cast(GPTStage, self.state.module)  # layouts change only for the built-in GPT
            reference = next(current.parameters())
            module = GPTStage(current.shape, *bounds[self.stage]).to(device=reference.device, dtype=reference.dtype)
            self._install(self._stage_state(module), bounds[self.stage])

    def _migrate_layers(self) -> None:
        """The new generation's plan holds the layers in another partition: stages that lose layers send them
        (parameters and optimizer state, from one surviving replica) to every surviving replica of the stage that
        gains them, over this generation's world group; then each changed stage rebuilds its module."""
        if self.bounds is None:
            return
        plan, announcement = self.plan, self.announcement
        new = plan_bounds(self.config, plan.partition)
        if new == self.bounds:
            return
        joining = announcement.joining if announcement is not None and \
            announcement.generation == self.generation else frozenset()
        if self.spec.rank in joining:  # took the layout when admitted; its state comes from a replica afterwards
            self.bounds = new
            return
        survivors = {s: [plan.rank(p, s) for p in plan.live_replicas(s) if plan.rank(p, s) not in joining]
                     for s in range(plan.num_stages)}
        senders = {s: ranks[0] for s, ranks in survivors.items() if ranks}
        transport = self._transport()
        received, stats = exchange_layers(self.state, layer_moves(self.bounds, new), senders, survivors,
                                          self.spec.rank, transport.send_to, transport.recv_from, self.device)
        self.bounds = new
        if new[self.stage] != self.layers:
            self._install(rebuild_stage(self.state, new[self.stage], received,
                                        lambda m: make_optimizer(m, self.config.training)), new[self.stage])
        elif self.spec.debug.emulation is not None:  # same layers here, other stages changed: pace to the new costs
            self._install(self.state, self.layers)
        self.outbox.put(self.store, Channels.MIGRATION, MigrationRecord(
            (self.layers[0], self.layers[1]), stats.layers_in, stats.layers_out, stats.bytes, stats.seconds),
            self.generation, self.spec.rank)

    def _load_checkpoint(self, step: int) -> None:
        """Take the stage's state after `step` steps: the run's checkpoint of that step, or, for the run's start
        (restored when a stage was lost before any checkpoint completed), the checkpoint it resumed from or the
        seed's initial state."""
        spec = self.spec
        if step == spec.start_step and not checkpoint.step_dir(spec.checkpoint.dir, step).is_dir():
            if spec.checkpoint.resume_dir:
                checkpoint.load_stage(spec.checkpoint.resume_dir, step, self.state)
                return
            if step == 0:
                built = self._build()
                if self.mesh is not None:  # each rank slices its shards of the seed's weights, as at the start
                    parallelize_stage(built.module.to(self.device), self.mesh)
                self._install(self._stage_state(built.module.to(self.device)), built.layout)
                self.position.restart(0)
                return
        checkpoint.load_stage(spec.checkpoint.dir, step, self.state)

    def _transfer_state(self) -> None:
        """If replacements joined this stage in this generation (and no checkpoint is being restored), the first
        surviving replica broadcasts the stage's state to them over the stage group."""
        announcement = self.announcement
        if announcement is None or announcement.generation != self.generation or announcement.restore_step >= 0:
            return
        replicas = self.plan.live_replicas(self.stage)
        joiners = [p for p in replicas if self.plan.rank(p, self.stage) in announcement.joining]
        if not joiners:
            return
        source = self.plan.rank(next(p for p in replicas if p not in joiners), self.stage)
        if self.spec.rank in announcement.joining:
            _joiner_dies_here(self.spec.joiner_dies_at, "transfer")
        transport = self._transport()

        def broadcast(tensor: torch.Tensor) -> None:
            transport.stage_broadcast(self.stage, tensor, source)

        stats = transfer_stage_state(self.state, self.spec.rank == source, broadcast, self.device)
        if self.spec.rank in announcement.joining:  # its position is now the source's
            self._holds_state = True
            self.outbox.put(self.store, Channels.TRANSFER, TransferRecord(stats.bytes, stats.seconds,
                                                                          "%d:%d" % self.plan.worker(source)),
                            self.generation, self.spec.rank)

    def _build(self) -> BuiltStage:
        """This worker's stage module as the run's start builds it (its chunks in a chunked run)."""
        if self.chunked:
            return chunked_built_stage(self.config, self.stage)
        return build_stage(self.config, self.stage, self.spec.model_factory, self.bounds)

    def _make_executor(self) -> StageExecutor:
        config, built = self.config, self.built

        def load(iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            assert self.data is not None, "only the first and the last stage load micro-batches"
            return self.data(iteration, mb)

        # A rebuild (new layer range) paces with a fresh pacer: the costs follow the stages' new layers.
        emulation = self.spec.debug.emulation
        pacing = cost_pacer(layer_scaled_config(config, self.bounds), self.plan, self.spec.rank, emulation) \
            if emulation is not None else None
        executor: type[StageExecutor] = ChunkedStageExecutor if self.chunked else StageExecutor
        return executor(self.plan, self.spec.rank, self.state.module, self.state.optimizer, self.transport, load,
                        built.input_shape, built.output_shape, weights_dtype(config.training.dtype),
                        grad_clip=config.training.grad_clip, seed=config.training.seed, device=self.device,
                        record_timings=self.spec.debug.record_timings, before_action=self._before_action,
                        precision=config.training.dtype, loss_fn=built.loss_fn, pacing=pacing,
                        position=self.position, tp_rank=self.spec.tp_rank,
                        tp_allreduce=(lambda t: self._transport().tp_allreduce_sum(t)) if self.mesh else None,
                        grad_norm_metric=self.spec.grad_norm)

    def _starting_work(self) -> None:
        """Before each action and each evaluation forward: count it for the heartbeat, stop if the generation was
        aborted, and note when the generation's first work began."""
        self.activity.action()
        if self.heartbeat.aborted >= self.generation:
            raise GenerationAborted(f"generation {self.generation} was aborted by the coordinator")
        if self._resumed_pending:
            self._resumed_pending = False
            self.outbox.put(self.store, Channels.RESUMED, Timestamp(time.time()), self.generation, self.spec.rank,
                            background=bool(self.spec.node_store_port))

    def _before_action(self, action: Action) -> None:
        self._starting_work()
        progress = self._executor().progress
        for fault in self.spec.faults:
            if fault.point == "action" and fault.step == progress.iteration and fault.index == progress.index:
                self._fire(fault, str(action))

    def _fire(self, fault: FaultInjection, where: str) -> None:
        if fault in self._fired:
            return
        self._fired.add(fault)
        self.outbox.put(self.store, Channels.FAULT, FaultRecord(time.time(), where, fault.mode), self.spec.rank)
        # The record may have queued behind a step record the writer thread is still sending: it must be in the
        # store before the fault (a SIGKILL of this process) or the recovery cannot say where the fault hit. That
        # wait is on the store, not this action's compute: under load it took seconds, and a worker frozen right
        # after it was told hung ("its heartbeat goes on") instead of silent.
        phase, self.activity.phase = self.activity.phase, "comm"
        try:
            self.outbox.flush()
        finally:
            self.activity.phase = phase
        self.hooks.fire(fault, where)

    def _stop_for_drain(self, step: int) -> None:
        """The coordinator drains this generation before `step` (0-based) to admit a replacement: stop here."""
        drain = self.heartbeat.drain
        if drain is not None and drain[0] == self.generation and step >= drain[1]:
            raise GenerationAborted(f"generation {self.generation} drains before step {drain[1] + 1} to admit a "
                                    "replacement worker")

    def _eval_due(self, done: int) -> bool:
        """[training] eval_every: an evaluation after `done` steps (none at the run's start)."""
        every = self.config.training.eval_every
        return every > 0 and done > self.spec.start_step and done % every == 0

    def _evaluate(self, done: int) -> None:
        """The held-out loss after `done` steps, forward-only through the pipeline (worker.evaluation); the last
        stage's first live replica writes it to the store."""
        config, built = self.config, self.built
        start = time.time()
        faults = [f for f in self.spec.faults if f.point == "eval" and f.step == done - 1]

        def before_forward() -> None:
            self._starting_work()
            for fault in faults:
                self._fire(fault, f"the evaluation after step {done}")

        try:
            loss = evaluate(self.plan, self.spec.rank, self.state.module, self._transport(), self.eval_data,
                            config.training.eval_batches, built.input_shape, weights_dtype(config.training.dtype),
                            self.device, config.training.dtype, built.loss_fn, before_forward,
                            counts=self.spec.tp_rank == 0)
        finally:
            self.activity.phase = "idle"
        if self.stage == config.num_stages - 1 and self._is_writer():
            self.outbox.put(self.store, Channels.EVAL, EvalRecord(
                loss, config.training.eval_batches * self.plan.total_microbatches, start, time.time(), self.generation),
                done, kind="eval", order=done)

    def _run_step(self, step: int) -> None:
        spec = self.spec
        self._stop_for_drain(step)
        cpu0 = time.process_time()
        completion = self.completion if self.completion is not None and self.completion.iteration == step else None
        try:
            if completion is not None:
                self.completion = None
                result = self._executor().run_completion(completion)
            else:
                result = self._executor().run_iteration(step)
        finally:
            self.activity.phase = "idle"
        cpu_s = time.process_time() - cpu0  # all threads of this process, gloo's included
        done = step + 1
        if completion is not None and self.stage in completion.applied_stages:
            self._repair_checkpoint(done)  # its stage had stepped: the checkpoint was written then, unless lost
        elif spec.checkpoint.due(done):
            self._save_checkpoint()
        self.outbox.put(self.store, Channels.METRICS, StepRecord(
            self.replica, self.stage, self.generation, result.start, result.end, cpu_s, result.loss_sum,
            result.stage_loss, result.grad_norm, result.grad_sq,
            digest=parameter_digest(self.state.module) if spec.debug.verify_replicas else "",
            timings=tuple((t.action, t.start, t.end) for t in result.timings), lr=result.lr), step, spec.rank,
            kind="metrics", order=step, background=True)

    def _is_writer(self) -> bool:
        """One live replica per stage writes the stage's files."""
        return self.replica == self.plan.live_replicas(self.stage)[0]

    def _save_checkpoint(self) -> None:
        """Hand a copy of the stage's state (after the steps it holds) to the background writer: the step goes on
        while it is written."""
        if not self._is_writer():
            return
        done = self.position.done
        faults = [f for f in self.spec.faults if f.point == "ckpt" and f.step == done - 1]
        before_write = (lambda: self._fire(faults[0], f"the checkpoint of step {done}")) if faults else None
        entries = None
        if self.mesh is not None:
            # Gathered whole (a collective of the worker's ranks), under the whole model's names: the same shard a
            # T = 1 worker writes, so any T, D or S can resume from it. Rank 0 writes it.
            entries = {k: v.detach().to("cpu", copy=True) for k, v in whole_state(self.state.state_dict()).items()
                       if isinstance(v, torch.Tensor)}
            if self.spec.tp_rank > 0:
                return
        assert self.writer is not None, "checkpoints are due only when a checkpoint folder is set"
        self.writer.submit(self.state, self.layers, before_write, entries)

    def _save_final(self) -> None:
        """The --save / --export-hf part of this stage, and every checkpoint on disk (and reported) before the worker
        leaves."""
        if self._is_writer() and self.spec.outputs.parts_path:
            # A tensor-parallel stage is gathered whole (a collective of the worker's ranks); its rank 0 writes it.
            state = self.state.module.state_dict() if self.mesh is None else whole_state_dict(self.state.module)
            if self.spec.tp_rank == 0:
                checkpoint.atomic_torch_save({k: v.detach().cpu() for k, v in state.items()},
                                             checkpoint.part_file(self.spec.outputs.parts_path, self.stage))
        if self.writer is not None:
            self.writer.wait()

    def _leave(self) -> None:
        """Before the process exits: every record it wrote is in the store (if the coordinator is away, it waits for
        it to come back; its launcher gives up on it after --coordinator-grace and stops this worker)."""
        self.phase = "finished"
        self.outbox.wait_sent()

    def _finish(self) -> None:
        self._save_final()
        transport = self._transport()
        transport.flush()
        transport.barrier()  # nobody tears its connections down while a peer may still be talking to it
        transport.close()

    def _transport(self) -> Transport:
        if self.transport is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage} has no transport: it is between generations")
        return self.transport

    def _executor(self) -> StageExecutor:
        if self.executor is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage} has no executor: it has not joined a generation")
        return self.executor

    # -- recovery ------------------------------------------------------------------------------------------------
    def _recover(self, step: int, error: str) -> int:
        """Leave the broken generation, report, wait for the next one, roll back, and return the step to redo."""
        spec = self.spec
        for fault in spec.faults:
            if fault.point == "recovery" and step >= fault.step:
                self._fire(fault, f"the recovery from generation {self.generation}")
        executor = self.executor
        self.activity.phase = "idle"
        with self._transport_lock:
            transport, self.transport = self.transport, None
        try:
            if transport is not None:
                transport.close(abort=True)  # cut first, then destroy: never a blocking destroy of a broken group
            elif dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass  # the group is broken either way; what matters is that its connections are cut
        applied = self.position.applied
        if executor is not None:
            executor.drop_comm()
            progress, completed = executor.progress, executor.completed
            # A TP rank stopped in the send of an action whose results it holds counts the action done, as a peer
            # rank whose own send went through does (worker.tp_agreement).
            sent = self.mesh is not None and progress.sending and not progress.finished
            current = (progress.index + int(sent), progress.busy_s) if not progress.finished else (0, 0.0)
            report = StoppedReport(spec.rank, self.generation, applied, progress.iteration, current[0], current[1],
                                   completed.index if applied >= spec.start_step else 0,
                                   completed.busy_s if applied >= spec.start_step else 0.0,
                                   error, time.time(),
                                   weighed_current=progress.weighed and not progress.finished and not sent,
                                   completing=progress.completing and not progress.finished,
                                   reducing=progress.reducing and not progress.finished)
        else:  # failed while forming its first generation: nothing done yet
            # Its state is the run's start, or (a replacement that loaded the restored checkpoint) that step.
            report = StoppedReport(spec.rank, self.generation, applied, applied + 1, 0, 0.0, 0, 0.0, error,
                                   time.time())
        if self.mesh is not None:  # the worker's ranks may have stopped at different points (worker.tp_agreement)
            point = StopPoint.of(report)
            if spec.tp_rank > 0:
                post_stop_point(self.store, self.generation, spec.rank, spec.tp_rank, point)
            else:
                report = report._replace(tp_split=tp_split(self.store, self.generation, spec.rank, spec.tp_degree,
                                                           point, spec.recovery.timeout_s))
        self.phase = "stopped"
        # With a node store, through it: the node's launcher writes the coordinator one digest of its workers' reports
        # (control.node_digests), and writes them again to a restarted coordinator.
        self.outbox.put(self.store, Channels.STOPPED, report, self.generation, spec.rank, kind="stopped",
                        background=bool(spec.node_store_port))
        # One key for the coordinator to poll.
        announcement = self._await_announcement(self.generation + 1)
        if spec.rank not in announcement.live:
            raise _Fenced()
        self.generation = announcement.generation
        self.announcement = announcement
        self.plan = self._read_plan_view(announcement.generation)
        redo = announcement.redo_step
        self.completion = None
        if announcement.completion:  # keep the interrupted iteration's work; run only what the failure lost
            self.completion = Completion.from_json(
                self.store.get(Keys.completion_view(announcement.generation, spec.rank)), self.plan, spec.rank)
            if executor is not None:
                executor.keep_for_completion(redo)
        elif announcement.restore_step >= 0:  # a stage lost every replica: everyone restores the checkpoint
            if self.writer is not None:
                self.writer.wait()
            self._take_layout()  # the checkpoint's keys are the whole model's: it loads into any partition
            self._load_checkpoint(announcement.restore_step)  # the position then holds redo - 1
            if self.executor is not None:
                self.executor.abort_iteration()
        elif executor is not None:
            executor.roll_back(redo)
        self._repair_checkpoint(redo)
        return redo

    def _await_announcement(self, generation: int) -> Announcement:
        self.heartbeat.move_to(generation)
        while True:
            try:
                # One request per worker and recovery (it was a wait and two reads: 49,152 requests a recovery at
                # 16,384 workers instead of 16,384).
                return self._take_announcement(generation)
            except dist.DistStoreError:
                continue  # the coordinator is still collecting reports; it fences us if it ever gives up on us

    def _repair_checkpoint(self, redo: int) -> None:
        """A checkpoint due at the step we roll back to may have lost its writer mid-save: write it again from the
        rolled-back state (which is exactly that step's state)."""
        if self.mesh is not None:
            # Rewriting needs every rank of the worker to gather, and they read the store's flag at different
            # moments: a tensor-parallel run leaves such a step out (the next checkpoint is written as usual).
            return
        spec = self.spec
        if not (spec.checkpoint.due(redo) and redo > spec.start_step and self._is_writer()):
            return
        if self.position.done != redo:
            return  # a stage that kept its step of the interrupted iteration (a completion) is past that state
        if self.writer is not None:
            # This worker's own write of that step may still be in flight: let it finish (and report) first, or the
            # step would be written twice and the second copy could land after the coordinator recorded the first's
            # hashes (a "damaged" file in a complete checkpoint).
            self.writer.wait()
        if not self.jobs.is_set(Flags.CHECKPOINTED, redo, self.stage):
            self._save_checkpoint()  # the state holds `redo` steps
