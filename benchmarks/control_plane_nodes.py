"""Stand-in training nodes for bench_control_plane.py: one object simulates many node launchers and their workers,
writing and reading exactly the job-store keys and records that control/launcher.py's _follow_loop and
worker/process.py write and read today, at their rates, over a few authenticated connections to the real store. No
torch compute and no process groups: only the control plane's traffic.

What each simulated process does (and where in the runtime it comes from):
- worker watcher (worker/process.py _Watcher): a Beat every heartbeat_s to its node launcher's own store (not the
  job's: no request here); it waits on the current and next generation's abort and drain keys of the job's store
  (one wait per stand-in object here, not one per worker);
- worker main thread: a StepRecord per step, to its node launcher's own store (no request here: the launcher hands
  the coordinator one NodeSteps record per step, on Channels.NODE_METRICS); on an abort (or a drain at its step) a
  StoppedReport, to its node launcher's own store too (no request here: the launcher's thread hands the coordinator
  one NodeStops digest of its workers' reports, on Channels.NODE_STOPPED); on the announcement of the next generation
  it reads it and its view of the plan (the start every view shares, once per stand-in, and its own part), writes
  Joined and, at its first action, Resumed, to its node launcher's own store (no request here: the launcher's thread
  hands the coordinator one NodeStarted digest of them, on Channels.NODE_STARTED); a worker left out of the generation
  exits (code 4);
- replacement worker (_admit): JoinReady, then admitted by the announcement that names it;
- node launcher (_follow_once, once per beat interval, min(heartbeat_s, heartbeat timeout / 4)): its workers' step
  records of the pass as one NodeSteps record per step, the EXITED flag of a worker that ended (once), then its node
  heartbeat and one wait on the keys of the coordinator's word (ABORT_RUN, FINISHED, FENCE per running worker, RESPAWN
  per ended one) until its next beat, as one request (Op.WAIT_ANY_BEAT); a worker's end cuts that wait short
  (Op.CANCEL) and is reported at once; every
  heartbeat_s its NodeWatch raises a SILENT flag for a worker silent past the heartbeat timeout (once), and it reads
  the hang limit once per heartbeat timeout (and before it condemns a worker as hung, which no stand-in does).
  The heartbeats and waits go from a thread and connection of their own (a launcher beats from its own machine,
  whatever its workers do); the rest of its traffic from the stand-in's loop.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from recycle.runtime.protocol.channels import Flags, Keys
from recycle.runtime.protocol.records import Announcement, JoinReady, NodeStarted, from_json, to_json
from recycle.runtime.protocol.store import StoreClient
from recycle.runtime.protocol.store.wire import Op, Status, pack_fields, unpack_fields

__all__ = ["NodesSpec", "PipelinedClient", "StandInNodes", "standin_main", "beat_json", "step_json", "node_steps_json",
           "NodeStepsWriter", "stopped_json", "node_stops_json",
           "NODE_POLL_S", "EXIT_KILLED", "EXIT_LEFT_OUT"]

NODE_POLL_S = 0.1  # the stand-ins' own pass: the finest grain of the rates they keep
EXIT_KILLED = -9  # what a SIGKILLed worker's exit code reads as
EXIT_LEFT_OUT = 4  # worker/process.py EXIT_FENCED: not in the new generation
BATCH = 256  # requests sent before the first reply is read
BUDGET = 2048  # step records sent per pass at most (the node launchers' beats and waits are not limited)
HANG_LIMIT_GET = pack_fields(Op.GET, (Keys.HANG_LIMIT.encode(), b"0"))  # a NodeWatch's read of the hang limit
CANCEL = pack_fields(Op.CANCEL, ())  # a launcher's wait cut short by its worker's end


class PipelinedClient(StoreClient):
    """A StoreClient that sends a batch of (non-waiting) requests before reading their replies, so one connection
    carries the traffic of many simulated processes. The server sees every request as it would from them: each is
    framed, MAC-checked, served and answered on its own."""

    def pipeline(self, payloads: list[bytes]) -> list[tuple[Status, list[bytes]]]:
        """Send the requests (each packed: pack_fields(op, fields), or the same bytes kept from an earlier pass) and
        read their replies, in order."""
        if not payloads:
            return []
        with self._lock:
            if self._sock is None:
                self._connect()
            assert self._sock is not None and self._session is not None
            session, sock = self._session, self._sock
            sock.settimeout(120.0)
            sock.sendall(session.seal_frames(payloads))
            replies: list[tuple[Status, list[bytes]]] = []
            frames: collections.deque[bytes] = collections.deque()
            while len(replies) < len(payloads):
                if not frames:
                    data = sock.recv(1 << 20)
                    if not data:
                        raise EOFError("the store closed the connection")
                    frames.extend(self._reader.feed(data))
                    continue
                status, values = unpack_fields(session.open(frames.popleft()))
                replies.append((status, values))  # (the status as its int: Status(...) per reply is a cost here)
            return replies


@dataclass(frozen=True)
class NodesSpec:
    """What one stand-in simulates: its nodes and their ranks, the run's intervals, and where the store is."""

    host: str
    port: int
    token: str
    ranks_of: tuple[tuple[int, tuple[int, ...]], ...]  # (node, its ranks), as control/processes.node_ranks deals them
    num_stages: int
    heartbeat_s: float
    step_s: float
    niceness: int = 0  # a separate process lowers its priority: the coordinator's process is served first
    heartbeat_timeout_s: float = 5.0
    profile_path: str = ""  # cProfile the stand-in process (CPU time) and write its stats here when it stops


@dataclass
class _Counters:
    """Requests this stand-in sent, and those the protocol asked of it (its schedule), by kind."""

    sent: collections.Counter[str] = field(default_factory=collections.Counter)
    due: collections.Counter[str] = field(default_factory=collections.Counter)


OnReply = Callable[[Status, list[bytes]], None]
Request = tuple[bytes, OnReply | None]  # (the request packed: pack_fields(op, fields), what to do with its reply)


def _b(text: str) -> bytes:
    return text.encode()


def beat_json(beats: int, phase: str, incarnation: str) -> bytes:
    """to_json(Beat(beats, beats, phase, incarnation)), byte for byte, without dataclasses.asdict's cost (the
    stand-ins write thousands a second; the test checks the two agree)."""
    return (f'{{"kind": "beat", "beats": {beats}, "actions": {beats}, "phase": "{phase}", '
            f'"incarnation": "{incarnation}"}}').encode()


def step_json(replica: int, stage: int, generation: int, start: float, end: float, last: bool) -> bytes:
    """to_json of a stand-in's StepRecord (the last stage reports a loss), byte for byte."""
    loss = "1.0" if last else "null"
    return (f'{{"kind": "step", "replica": {replica}, "stage": {stage}, "generation": {generation}, '
            f'"start": {start!r}, "end": {end!r}, "cpu_s": 0.0, "loss_sum": {loss}, "stage_loss": {loss}, '
            f'"grad_norm": null, "grad_sq": 1.0, "digest": "", "timings": [], "lr": null}}').encode()


def stopped_json(rank: int, generation: int, applied: int, iteration: int, error: str, when: float) -> bytes:
    """to_json of a stand-in worker's StoppedReport (no work of the iteration done), byte for byte."""
    return (f'{{"kind": "stopped", "rank": {rank}, "generation": {generation}, "applied": {applied}, '
            f'"iteration": {iteration}, "current_actions": 0, "current_s": 0.0, "previous_actions": 0, '
            f'"previous_s": 0.0, "error": {json.dumps(error)}, "time": {when!r}, "weighed_current": false, '
            f'"completing": false, "reducing": false, "tp_split": ""}}').encode()


def node_stops_json(node: int, generation: int, ranks: list[int], applied: int, iteration: int, error: str,
                    when: float) -> bytes:
    """to_json of a stand-in launcher's NodeStops: its workers `ranks` each reported as stopped_json says (the
    reports travel as columns), byte for byte, formatted at once: a stand-in writes a digest for each of its
    hundreds of nodes per recovery, on cores it shares with the coordinator, where a real launcher writes one."""
    def column(value: str) -> str:
        return "[" + ", ".join([value] * len(ranks)) + "]"

    return (f'{{"kind": "node_stops", "node": {node}, "generation": {generation}, "reports": {{"kind": "stop_rows", '
            f'"rank": [{", ".join(map(str, ranks))}], "generation": {column(str(generation))}, '
            f'"applied": {column(str(applied))}, "iteration": {column(str(iteration))}, '
            f'"current_actions": {column("0")}, "current_s": {column("0.0")}, "previous_actions": {column("0")}, '
            f'"previous_s": {column("0.0")}, "error": {column(json.dumps(error))}, "time": {column(repr(when))}, '
            f'"weighed_current": {column("false")}, "completing": {column("false")}, "reducing": {column("false")}, '
            f'"tp_split": {column(chr(34) * 2)}}}}}').encode()


class NodeStepsWriter:
    """A stand-in launcher's NodeSteps (its workers' StepRecords as step_json makes them) as the store holds them
    (NodeSteps.encode), byte for byte, for one node, its workers and generation: what does not change from step to
    step is packed once, and each step adds its number and its start and end times."""

    def __init__(self, node: int, workers: list[tuple[int, int]], generation: int, last_stage: int) -> None:
        # records.PackedRows: the ints (replica, stage, generation per row), then the floats (per row start and end,
        # which change every step, then cpu_s, loss_sum, stage_loss, grad_norm, grad_sq, lr), then the presence
        # bytes of the optional floats; no tail (no digest, no timings).
        losses = [(1.0, 1.0) if stage == last_stage else (0.0, 0.0) for _, stage in workers]
        self.rows_after_times = [struct.pack("<6d", 0.0, *loss, 0.0, 1.0, 0.0) for loss in losses]
        self.ints = struct.pack(f"<{3 * len(workers)}q", *(v for replica, stage in workers
                                                            for v in (replica, stage, generation)))
        self.present = bytes(bit for loss in losses for bit in (int(loss[0]), int(loss[1]), 0, 1, 0))
        self.node, self.count = node, len(workers)

    def __call__(self, step: int, start: float, end: float) -> bytes:
        times = struct.pack("<2d", start, end)
        return b"".join([struct.pack("<8sqqqI", b"RCYSTEP1", self.node, step, self.count, 0), self.ints,
                         *[times + row for row in self.rows_after_times], self.present])


def node_steps_json(node: int, step: int, workers: list[tuple[int, int]], generation: int, start: float, end: float,
                    last_stage: int) -> bytes:
    """A stand-in launcher's NodeSteps of one step as the store holds it, byte for byte (NodeStepsWriter's)."""
    return NodeStepsWriter(node, workers, generation, last_stage)(step, start, end)


class StandInNodes:
    """Many node launchers and their workers, driven by commands (fail, freeze, node down/up, stats, stop) from
    the benchmark; run() is the loop."""

    def __init__(self, spec: NodesSpec) -> None:
        self.spec = spec
        self.nodes = {node: ranks for node, ranks in spec.ranks_of}
        self.node_of = {rank: node for node, ranks in spec.ranks_of for rank in ranks}
        self.ranks = sorted(self.node_of)
        identity = f"standin/{spec.ranks_of[0][0]}/{os.getpid()}"
        self.client = PipelinedClient(spec.host, spec.port, spec.token, identity, timeout_s=120.0)
        # The watcher's connection: the workers react to an abort or an announcement at once, as real ones do,
        # not after this object's next pass over its periodic traffic.
        self.watch_client = PipelinedClient(spec.host, spec.port, spec.token, identity + "w", timeout_s=120.0)
        # The node launchers' heartbeats (with their waits): their own thread and connection, as each launcher beats
        # from its own machine whatever its workers do. On the loop they waited behind a recovery's bulk (thousands
        # of view reads and records): at 16,384 ranks a stand-in went 5.5 s without beating and the coordinator
        # declared 171 healthy nodes lost.
        self.beat_client = PipelinedClient(spec.host, spec.port, spec.token, identity + "b", timeout_s=120.0)
        # The heartbeat thread's pass, against a node's loss (node_down); taken before `lock` when both are.
        self.beat_lock = threading.Lock()
        self.counters = _Counters()
        self.lock = threading.Lock()  # between the loop and the watcher thread
        # Processes: a rank is running (beats, steps, reports), frozen (nothing), or ended with an exit code.
        self.exit_code: dict[int, int] = {}
        self.frozen: set[int] = set()
        self.exit_reported: set[int] = set()  # the node raised its EXITED flag (once per process)
        self.incarnation = {rank: 0 for rank in self.ranks}
        self.beats = {rank: 0 for rank in self.ranks}
        self.last_beat: dict[int, float] = {}
        self.down_nodes: set[int] = set()
        # The generation as the workers see it.
        self.generation = 0
        self.members = set(self.ranks)  # ranks of ours in the current generation
        self.joiners: set[int] = set()  # replacements that said they are ready, not admitted yet
        self.stopped = False  # the members reported and wait for the next generation
        self.next_step = 0  # 0-based step whose records are written next
        self.step_origin = time.time()  # step k of this generation ends at origin + (k - first + 1) * step_s
        self.first_step = 0
        self.aborted = -1  # the newest generation seen aborted (watcher)
        self.drain: tuple[int, int] | None = None  # (generation, stop before step) seen by the watcher
        self.announced: int | None = None  # a generation whose announcement the watcher saw
        self.events: list[dict[str, Any]] = []  # timestamps the benchmark reads back
        self.beat_cursor = 0
        self.next_watch = 0.0  # when the node launchers' NodeWatch next looks at their workers' beats
        self.next_limit_read = 0.0  # when they next read the hang limit
        self.silence_told: set[int] = set()  # frozen ranks whose SILENT flag was raised
        self.node_cursor = 0
        self.node_credit = 0.0
        self.metrics: collections.deque[Request] = collections.deque()  # step records not sent yet
        self.node_seq: dict[int, int] = {}  # node -> its launcher's last NodeSteps write number
        self.stops_seq: dict[int, int] = {}  # node -> its launcher's last NodeStops write number
        self.starts_seq: dict[int, int] = {}  # node -> its launcher's last NodeStarted write number
        # node -> (its ended ranks, its wait on the coordinator's word packed, and with its heartbeat, the reply's
        # handler)
        self.order_keys: dict[int, tuple[tuple[int, ...], bytes, bytes, OnReply]] = {}
        self.steps_writer: dict[tuple[int, tuple[tuple[int, int], ...], int], NodeStepsWriter] = {}
        self.last_tick = time.time()
        self.stop = threading.Event()

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self, commands: Any) -> None:
        """Serve until told to stop: `commands` is a multiprocessing Connection (poll/recv/send)."""
        watcher = threading.Thread(target=self._watch, daemon=True, name="standin-watcher")
        watcher.start()
        beater = threading.Thread(target=self._beat_loop, daemon=True, name="standin-beats")
        beater.start()
        commands.send(("ready", len(self.ranks)))
        try:
            while not self.stop.is_set():
                while commands.poll(0):
                    self._command(commands, *commands.recv())
                if self.stop.is_set():
                    break
                if not self._tick():
                    time.sleep(0.002)
        finally:
            self.stop.set()
            watcher.join(2.0)
            beater.join(2.0)
            self.client.close()
            self.watch_client.close()
            self.beat_client.close()

    def _tick(self) -> bool:
        """One pass: what is due now, sent as pipelined batches; False when nothing was due."""
        now = time.time()
        elapsed, self.last_tick = now - self.last_tick, now
        # What keeps the nodes alive in the coordinator's eyes goes first; the rest within a budget per pass, so
        # that an overloaded stand-in (this machine, not a real node) falls behind on flag polls, not on beats.
        with self.lock:
            recovery, reported = self._recovery(now, self.client)
            self._steps(now)
        if recovery:  # (as one burst, as the nodes' launchers send them: each node's at once)
            self._flush(self.client, recovery, reported, len(recovery))
        requests = self._beats(elapsed, now)
        budget = len(requests) + BUDGET
        while self.metrics and len(requests) < budget:
            requests.append(self.metrics.popleft())
        self._flush(self.client, requests, None)
        return bool(requests or recovery)

    def _flush(self, client: PipelinedClient, requests: list[Request], reported: int | None,
               batch: int = BATCH) -> None:
        """Send `requests` in pipelined batches and hand each reply to its callback; `reported`: the generation
        whose stop reports are among them (timed for the benchmark). A recovery's requests (every node's stop digest,
        or its workers' records of the next generation) go in one batch: 2,048 launchers send theirs at once, not
        in rounds of BATCH that each wait for the last one's replies."""
        for start in range(0, len(requests), max(1, batch)):
            chunk = requests[start:start + max(1, batch)]
            replies = client.pipeline([payload for payload, _ in chunk])
            for (_, on_reply), (status, values) in zip(chunk, replies):
                if on_reply is not None:
                    on_reply(status, values)
        if reported is not None:
            self.events.append({"kind": "reports_sent", "generation": reported, "time": time.time()})

    def _running(self, rank: int) -> bool:
        return rank not in self.exit_code and rank not in self.frozen and self.node_of[rank] not in self.down_nodes

    def _send(self, kind: str, op: Op, fields: tuple[bytes, ...],
              on_reply: Callable[[Status, list[bytes]], None] | None = None) -> Request:
        self.counters.sent[kind] += 1
        return pack_fields(op, fields), on_reply

    def _send_packed(self, kind: str, payload: bytes, on_reply: OnReply | None = None) -> Request:
        """_send of a request packed once and sent every pass (a node's heartbeat, its wait, the hang limit's read):
        the same bytes each time, as a real launcher's would be."""
        self.counters.sent[kind] += 1
        return payload, on_reply

    # -- the workers' watcher threads: beats (round-robin at the protocol's rate) --------------------------------
    def _beats(self, elapsed: float, now: float) -> list[Request]:
        """The workers beat to their node's own store (free here); each node's NodeWatch, every heartbeat_s, tells
        the job's store about a worker silent past the timeout, once, and reads the hang limit once per timeout."""
        requests: list[Request] = []
        # (a running worker beats all the time: only a frozen one's last beat matters, noted when it froze by
        # _last_signs; not a pass over every rank each time round, which at 16,384 ranks was this loop's own cost)
        if now < self.next_watch:
            return requests
        self.next_watch = now + self.spec.heartbeat_s
        read_limit = now >= self.next_limit_read
        if read_limit:
            self.next_limit_read = now + self.spec.heartbeat_timeout_s
        for node, ranks in self.nodes.items():
            if node in self.down_nodes:
                continue
            if read_limit:
                self.counters.due["watch"] += 1
                requests.append(self._send_packed("watch", HANG_LIMIT_GET))
            for rank in ranks:
                silent = now - self.last_beat.get(rank, now)
                if rank in self.frozen and rank not in self.silence_told and silent > self.spec.heartbeat_timeout_s:
                    self.silence_told.add(rank)
                    cause = _b(f"stopped responding (no heartbeat for {silent:.1f} s; fenced)")
                    requests.append(self._send("watch", Op.SET, (_b(Flags.SILENT.name(rank)), cause)))
        return requests

    def _beat_loop(self) -> None:
        """The node launchers' heartbeats and waits, every NODE_POLL_S, on their own connection (_node_heartbeats)."""
        last = time.time()
        while not self.stop.wait(NODE_POLL_S):
            with self.beat_lock:
                now = time.time()
                requests = self._node_heartbeats(now - last)
                last = now
                try:
                    self._flush(self.beat_client, requests, None)
                except Exception:
                    if self.stop.is_set():
                        return
                    raise

    def _watch(self) -> None:
        """One watcher for every simulated worker: the current and next generation's abort and drain keys, and the
        announcement of the next one (which the workers wait for after they stop, or to be admitted)."""
        while not self.stop.is_set():
            with self.lock:
                generation = self.generation
                watched = []
                for g in (generation, generation + 1):
                    if self.aborted < g:
                        watched.append((Keys.abort(g), "abort", g))
                    if self.drain is None or self.drain[0] < g:
                        watched.append((Keys.drain(g), "drain", g))
                if self.stopped or self.joiners:
                    watched.append((Keys.announce(generation + 1), "announce", generation + 1))
            try:
                hit = self.watch_client.wait_any([key for key, _, _ in watched], 0.2)
                if hit is None:
                    continue
                key, what, g = watched[hit]
                value = self.watch_client.get(key) if what == "drain" else b""
            except Exception:
                if self.stop.is_set():
                    return
                raise
            with self.lock:
                if what == "abort":
                    self.aborted = max(self.aborted, g)
                elif what == "drain":
                    self.drain = (g, int(value))
                elif self.announced is None or self.announced < g:
                    self.announced = g
            with self.lock:
                requests, reported = self._recovery(time.time(), self.watch_client)
            self._flush(self.watch_client, requests, reported, len(requests))

    # -- the workers' main threads: steps, stop reports, the next generation ---------------------------------------
    def _steps(self, now: float) -> None:
        """At each step's end, every member's StepRecord joins the queue of records to send."""
        if self.stopped:
            return
        ends = self.step_origin + (self.next_step - self.first_step + 1) * self.spec.step_s
        if now < ends:
            return
        step = self.next_step
        self.next_step += 1
        last = self.spec.num_stages - 1
        # The workers write their records to their node launcher's own store (no request here); each launcher hands
        # the coordinator one NodeSteps record of the step (control/node_steps.py StepForwarder).
        by_node: dict[int, list[tuple[int, int]]] = {}
        for rank in sorted(self.members):
            if not self._running(rank):
                continue
            by_node.setdefault(self.node_of[rank], []).append(divmod(rank, self.spec.num_stages))
        for node, workers in by_node.items():
            # (packed once per node, workers and generation: each step adds its number and times)
            shape = (node, tuple(workers), self.generation)
            writer = self.steps_writer.get(shape)
            if writer is None:
                self.steps_writer = {k: v for k, v in self.steps_writer.items() if k[2] == self.generation}
                writer = self.steps_writer[shape] = NodeStepsWriter(node, workers, self.generation, last)
            batch = writer(step, ends - self.spec.step_s, ends)
            self.node_seq[node] = self.node_seq.get(node, -1) + 1
            self.metrics.append(self._send("metrics", Op.SET, (_b(Keys.node_metrics(step, node, self.node_seq[node])),
                                                               batch)))

    def _recovery(self, now: float, client: PipelinedClient) -> tuple[list[Request], int | None]:
        """Stop reports when the generation is aborted (or drains at this step); the next generation once it is
        announced. With the generation whose stop reports are among the requests."""
        requests: list[Request] = []
        reported = None
        drain = self.drain
        draining = drain is not None and drain[0] == self.generation and self.next_step >= drain[1]
        if not self.stopped and (self.aborted >= self.generation or draining):
            self.stopped = True
            error = (f"generation {self.generation} was aborted by the coordinator" if self.aborted >= self.generation
                     else f"generation {self.generation} drains before step {drain[1] + 1 if drain else 0}")
            # Each worker hands its report to its node's store (no request here); each launcher's thread writes
            # the coordinator one digest of them (control/node_stops.py StopForwarder).
            by_node: dict[int, list[int]] = {}
            for rank in sorted(self.members):
                if self._running(rank):
                    by_node.setdefault(self.node_of[rank], []).append(rank)
            for node, ranks in by_node.items():
                self.stops_seq[node] = seq = self.stops_seq.get(node, -1) + 1
                digest = node_stops_json(node, self.generation, ranks, self.next_step - 1, self.next_step, error, now)
                requests.append(self._send("stopped", Op.SET, (_b(Keys.node_stopped(self.generation, node, seq)),
                                                               digest)))
            self.events.append({"kind": "stopped", "generation": self.generation, "time": time.time()})
            reported = self.generation
        if self.announced is not None and self.announced > self.generation:
            requests += self._next_generation(self.announced, client)
        return requests, reported

    def _next_generation(self, generation: int, client: PipelinedClient) -> list[Request]:
        """The workers read the announcement (each real worker reads it; here once) and each its own view of the
        plan, join the generation or exit, and resume from its redo step."""
        raw = client.try_get(Keys.announce(generation))
        assert raw is not None, "the watcher saw the announcement"
        announcement = from_json(Announcement, raw)
        live = set(announcement.live)
        readers = sorted((self.members | self.joiners) & live)
        # The start every view shares, stored once (each real worker reads it; here once), then each worker's part.
        shared = client.try_get(Keys.plan_shared(generation))
        assert shared is not None, "the views' shared start is stored before the announcement"
        asks = [pack_fields(Op.GET, (_b(Keys.plan_view(generation, rank)), b"0")) for rank in readers]
        # (BATCH at a time, as the other traffic: a real worker reads its own view, 2 KB; 8,192 in one pipelined
        # burst kept 16 MB of replies queued on the store)
        views = [reply for start in range(0, len(asks), BATCH) for reply in client.pipeline(asks[start:start + BATCH])]
        assert all(status == Status.OK and values for status, values in views), "every live rank has a plan view"
        for rank in self.members | self.joiners:
            if rank not in live and self._running(rank):
                self.exit_code[rank] = EXIT_LEFT_OUT  # left out of the generation: it exits, its node reports it
        requests: list[Request] = []
        self.generation = announcement.generation
        self.members = {r for r in (self.members | self.joiners) & live if self._running(r)}
        self.joiners -= live
        now = time.time()
        # Each worker writes its Joined and Resumed records to its node's store (no request here); its launcher's
        # thread writes the coordinator one NodeStarted digest of them (control/node_digests.py DigestForwarder).
        by_node: dict[int, list[int]] = {}
        for rank in sorted(self.members):
            by_node.setdefault(self.node_of[rank], []).append(rank)
        for node, ranks in by_node.items():
            digest = NodeStarted(node, self.generation, tuple((rank, now, 0.0, "init") for rank in ranks),
                                 tuple((rank, now) for rank in ranks))
            self.starts_seq[node] = seq = self.starts_seq.get(node, -1) + 1
            requests.append(self._send("started", Op.SET, (_b(Keys.node_started(self.generation, node, seq)),
                                                           _b(to_json(digest)))))
        self.stopped = False
        self.first_step = self.next_step = announcement.redo_step
        self.step_origin = now
        self.events.append({"kind": "resumed", "generation": self.generation, "time": now,
                            "plan_bytes": len(shared) + max((len(v[0]) for _, v in views), default=0),
                            "members": len(self.members)})
        return requests

    # -- the node launchers' follow loops ------------------------------------------------------------------------
    def _node_heartbeats(self, elapsed: float) -> list[Request]:
        """Each node launcher's pass, at its rate (once per min(heartbeat_s, heartbeat timeout / 4), as _follow_once
        beats; at most one round per pass): its heartbeat and its wait on the coordinator's word, one request."""
        with self.lock:
            up = [n for n in self.nodes if n not in self.down_nodes]
            if not up:
                return []
            rate = len(up) / max(NODE_POLL_S, min(self.spec.heartbeat_s, self.spec.heartbeat_timeout_s / 4))
            self.counters.due["node"] += elapsed * rate
            self.node_credit = min(self.node_credit + elapsed * rate, float(len(up)))
            requests: list[Request] = []
            while self.node_credit >= 1.0:
                self.node_credit -= 1.0
                node = up[self.node_cursor % len(up)]
                self.node_cursor += 1
                requests += self._node_poll(node, beat=True)
            return requests

    def _node_poll(self, node: int, beat: bool = False) -> list[Request]:
        """control/launcher._follow_once: its exit reports, then one wait on the keys of the coordinator's word (the
        run's failure and end, a FENCE flag per running worker, a RESPAWN flag per ended one), with its heartbeat
        when `beat`; here with no wait (a real launcher waits until its next beat in the store, which costs the store
        no more than this)."""
        requests: list[Request] = []
        ended = tuple(rank for rank in self.nodes[node] if rank in self.exit_code)
        for rank in ended:
            if rank not in self.exit_reported:
                requests += self._report_exit(rank)
        cached = self.order_keys.get(node)
        if cached is None or cached[0] != ended:  # (the keys change only when one of its workers ends or restarts)
            keys = [b"0", _b(Flags.ABORT_RUN.name()), _b(Flags.FINISHED.name())]
            fenced: list[int | None] = [None, None]
            for rank in self.nodes[node]:
                keys.append(_b(Flags.RESPAWN.name(rank) if rank in ended else Flags.FENCE.name(rank)))
                fenced.append(None if rank in ended else rank)
            cached = self.order_keys[node] = (ended, pack_fields(Op.WAIT_ANY, keys),
                                              pack_fields(Op.WAIT_ANY_BEAT, [_b(Keys.node_heartbeat(node)), *keys]),
                                              self._order_reply(fenced))
        requests.append(self._send_packed("node", cached[2] if beat else cached[1], cached[3]))
        return requests

    def _order_reply(self, fenced: list[int | None]) -> Callable[[Status, list[bytes]], None]:
        def on_reply(status: Status, values: list[bytes]) -> None:
            rank = fenced[int(values[0])] if status == Status.OK else None
            if rank is not None:
                with self.lock:  # (the heartbeat thread's replies too)
                    if rank not in self.exit_code:
                        self.exit_code[rank] = EXIT_KILLED  # the launcher SIGKILLs it (frozen or not)
                        self.frozen.discard(rank)
        return on_reply

    def _report_exit(self, rank: int) -> list[Request]:
        self.exit_reported.add(rank)
        return [self._send("node", Op.SET, (_b(Flags.EXITED.name(rank)), _b(str(self.exit_code[rank])))),
                self._send("node", Op.DELETE, (_b(Flags.FENCE.name(rank)),)),
                self._send("node", Op.DELETE, (_b(Flags.SILENT.name(rank)),))]

    # -- the benchmark's commands --------------------------------------------------------------------------------
    def _command(self, commands: Any, what: str, *args: Any) -> None:
        if what == "stop":
            self.stop.set()
            commands.send(("stopped",))
            return
        if what == "stats":
            # `at`: the end of the last pass, up to which `due` is counted (a pass can take seconds when this
            # machine cannot keep up: rates are taken over this clock, not the benchmark's).
            commands.send(("stats", dict(self.counters.sent), dict(self.counters.due), list(self.events),
                           self.last_tick))
            return
        # The heartbeat thread's lock first (its pass takes this one inside it): a node_down's last beat is the last.
        with self.beat_lock, self.lock:
            reply: dict[str, Any] = {}
            if what == "kill":  # the process dies: its launcher's wait is cut short, it raises the EXITED flag
                (rank,) = args  # and waits again
                self.exit_code[rank] = EXIT_KILLED
                reply["time"] = time.time()
                self.client.pipeline([CANCEL] + [payload for payload, _ in self._report_exit(rank)]
                                     + [payload for payload, _ in self._node_poll(self.node_of[rank])])
            elif what == "freeze":  # SIGSTOP, right after a beat: only its silence tells, from then on
                (rank,) = args
                reply["last_beat"] = self._last_signs([rank], None)
                self.frozen.add(rank)
            elif what == "node_down":  # the machine is gone, right after its beats: launcher and workers silent
                (node,) = args
                reply["last_beat"] = self._last_signs([r for r in self.nodes[node] if self._running(r)], node)
                self.down_nodes.add(node)
            elif what == "node_up":  # repaired: a new launcher starts every worker of the node as a replacement
                (node,) = args
                reply.update(self._repair(node))
            else:
                raise ValueError(f"unknown command {what!r}")
        commands.send(("done", reply))

    def _last_signs(self, ranks: list[int], node: int | None) -> float:
        """Beat for `ranks` (and `node`'s launcher) now, so that their silence starts at one known moment."""
        now = time.time()
        requests = []
        for rank in ranks:
            self.beats[rank] += 1
            self.last_beat[rank] = now  # to its node's store: no request to the job's store
        if node is not None:
            requests.append(self._send("node", Op.ADD, (_b(Keys.node_heartbeat(node)), b"1")))
        if requests:
            self.client.pipeline([payload for payload, _ in requests])
        return time.time()

    def _repair(self, node: int) -> dict[str, Any]:
        requests: list[bytes] = []
        self.down_nodes.discard(node)
        for rank in self.nodes[node]:
            self.exit_code.pop(rank, None)
            self.frozen.discard(rank)
            self.exit_reported.discard(rank)
            self.silence_told.discard(rank)
            self.members.discard(rank)
            self.incarnation[rank] += 1
            self.beats[rank] = 0
            # control/processes.WorkerProcesses.start(joining=True), then _follow_loop's first pass lowers FENCE.
            for key in (Keys.join_ready(rank), Keys.join_generation(rank), Keys.exited(rank), Keys.error(rank),
                        Keys.fence(rank)):
                requests.append(pack_fields(Op.DELETE, (_b(key),)))
            self.counters.sent["join"] += 5
        self.client.pipeline(requests)
        ready = []
        now = time.time()
        for rank in self.nodes[node]:
            ready.append(pack_fields(Op.SET, (_b(Keys.join_ready(rank)), _b(to_json(JoinReady(now, 0))))))
            self.joiners.add(rank)
            self.counters.sent["join"] += 1
        self.client.pipeline(ready)
        return {"ready": time.time()}


def standin_main(spec: NodesSpec, commands: Any) -> None:
    """A stand-in process's entry point."""
    if spec.niceness:
        os.nice(spec.niceness)
    if not spec.profile_path:
        StandInNodes(spec).run(commands)
        return
    import cProfile

    profiler = cProfile.Profile(time.process_time)  # (its watcher thread's calls are not seen: the loop's are)
    profiler.enable()
    try:
        StandInNodes(spec).run(commands)
    finally:
        profiler.disable()
        profiler.dump_stats(spec.profile_path)
