"""torchft-like baseline MODEL (not torchft itself): replica groups drop out whole, the global batch shrinks."""

from __future__ import annotations

from recycle.traces.model import Decision, JobContext

__all__ = ["TorchftLike"]


class TorchftLike:
    """torchft (meta-pytorch/torchft: fault-tolerant HSDP/DDP across replica groups) with pipeline parallelism
    inside each replica group, as a model. Sources of every default: docs/traces.md, "torchft-like".

    * failure domain: the replica group, here one pipeline of S workers. Any of its workers failing takes the
      whole group out of the quorum (torchft README: per-step fault tolerance across the replicated dimension;
      Clockwork's comparison: "the entire replica group is removed and training continues without that replica
      group until it has been replaced");
    * the global batch shrinks: A active groups of D run A x M micro-batches per step at the fault-free step time,
      so the rate is fault-free x A / D ("samples assigned to that replica group during failure are never
      processed"); goodput counts samples, so it is comparable with the fixed-batch systems, but the optimizer sees
      a smaller batch while groups are out (the report says so);
    * a failure in an active group: every group discards the step in flight (`torchft_lost_step_fraction` of one
      step: Manager.report_error skips the step, and the survivors only learn of it at their all-reduce), the
      lighthouse notices the silent group after its heartbeat timeout (`torchft_detect_s`), and the survivors form a
      new quorum and rebuild their process group (`torchft_quorum_s`);
    * the group stays out until it has S live units again: a repaired node (a unit re-joining in the trace) or a
      spare unit fills the hole of the broken group closest to complete; its survivors wait idle in it (with
      `torchft_regroup` the idle survivors of broken groups are pooled into complete groups instead). The completed
      group relaunches (`torchft_restart_s`, nobody else waits), joins the next quorum (`torchft_quorum_s`) and heals
      by live recovery from a healthy peer: each of its workers receives its stage's parameters and optimizer state
      at `torchft_heal_bytes_per_s` per GPU (torchft PR #119: 12 GB in ~5 s). Every group waits for the heal (the
      sending peers send inside their quorum step, before their all-reduce);
    * if every group is out, the model state survives only in the fallback checkpoint: the progress since then is
      lost, and the first group complete again restores from it (`restart_s`); the others heal from that group;
    * fallback checkpoints as the other adaptive systems (`fallback_checkpoint_*`).

    Defaults and their sources (JobCosts; docs/traces.md has the table):
    * `torchft_detect_s` 5 s: the lighthouse's `heartbeat_timeout_ms` default (torchft src/lighthouse.rs);
    * `torchft_quorum_s` 2.1 s: `quorum_tick_ms` default 100 plus the 2 s communicator rebuild also assumed for
      ReCycle's plan switch (torchft reconfigures its process group on every quorum change: Manager._async_quorum);
    * `torchft_lost_step_fraction` 1.0: Manager.report_error skips the whole step, on every group;
    * `torchft_heal_bytes_per_s` 2.4e9 per GPU: torchft PR #119, in-place PGTransport, 12 GB sent in 5.05 s (48 GB
      in 18.5 s);
    * `torchft_restart_s` 60 s: an assumption (relaunch and initialise a repaired group; nobody waits for it).
    """

    name, label = "torchft-like", "torchft-like (model; global batch shrinks)"

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.checkpoint = (ctx.costs.fallback_checkpoint_interval_s, ctx.costs.fallback_checkpoint_cost_s)
        self.members: list[set[int]] = [set() for _ in range(cfg.num_replicas)]
        self.group_of: dict[int, int] = {}
        self.spares: list[int] = []
        self.active: set[int] = set()
        self.ready_at: dict[int, float] = {}  # complete group -> when its relaunch ends and it joins the quorum
        self.trained = False  # some group has made progress: a group starting with none active must restore it
        self.group_log: list[tuple[float, int]] = []  # (time, active groups) at every change of the count

    @property
    def step_s(self) -> float:
        """One step of the global batch at the fault-free rate (a group's step time does not depend on A)."""
        cfg = self.ctx.config
        samples = cfg.num_replicas * cfg.num_microbatches * cfg.workload.microbatch_size
        return samples / self.ctx.fault_free_rate if self.ctx.fault_free_rate > 0 else 0.0

    def heal_s(self) -> float:
        """Live recovery of one group: every worker receives its stage's state in parallel, per GPU of a worker."""
        cfg = self.ctx.config
        largest = max(self.ctx.stage_state_bytes(s) for s in range(cfg.num_stages))
        return largest / (self.ctx.costs.torchft_heal_bytes_per_s * cfg.topology.gpus_per_worker)

    def _rate(self) -> float:
        return self.ctx.fault_free_rate * len(self.active) / self.ctx.config.num_replicas

    def _note_count(self, now: float) -> None:
        if not self.group_log or self.group_log[-1][1] != len(self.active):
            self.group_log.append((now, len(self.active)))

    def _complete(self, group: int) -> bool:
        return len(self.members[group]) == self.ctx.config.num_stages

    def _fill(self, now: float, relaunch: float) -> None:
        """Spares fill the holes of broken groups, the group closest to complete first; a group that becomes
        complete relaunches and joins `relaunch` seconds later. With regrouping, broken groups give up their idle
        survivors first, which then form as many complete groups as they can."""
        S = self.ctx.config.num_stages
        waiting = [g for g in range(len(self.members)) if g not in self.active and g not in self.ready_at]
        if self.ctx.costs.torchft_regroup:
            for g in waiting:
                for u in sorted(self.members[g]):
                    self.spares.append(u)
                    del self.group_of[u]
                self.members[g].clear()
        while self.spares:
            broken = [g for g in waiting if not self._complete(g)]
            if not broken:
                break
            g = min(broken, key=lambda g: (S - len(self.members[g]), g))
            u = self.spares.pop(0)
            self.members[g].add(u)
            self.group_of[u] = g
            if self._complete(g):
                self.ready_at[g] = now + relaunch

    def start(self, now: float, live: frozenset[int]) -> Decision:
        self.spares = sorted(live)
        self._fill(now, 0.0)
        for g in [g for g, t in self.ready_at.items() if t <= now]:  # the job's own launch: no relaunch, no heal
            del self.ready_at[g]
            self.active.add(g)
        self.trained = bool(self.active)
        self._note_count(now)
        return Decision(self._rate(), wake_at=self._next_ready(), down_cause="down",
                        note="" if self.active else f"no complete replica group among {len(live)} live unit(s)")

    def _next_ready(self) -> float | None:
        return min(self.ready_at.values()) if self.ready_at else None

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        broken: set[int] = set()
        for u in lost:
            g = self.group_of.pop(u, None)
            if g is None:
                if u in self.spares:
                    self.spares.remove(u)
                continue
            self.members[g].discard(u)
            self.ready_at.pop(g, None)  # a relaunching group is broken again
            if g in self.active:
                self.active.discard(g)
                broken.add(g)
        self.spares.extend(sorted(u for u in joined if u not in self.group_of and u not in self.spares))
        self._fill(now, c.torchft_restart_s)
        self._note_count(now)
        wake = self._next_ready()
        if not broken:
            return Decision(self._rate(), wake_at=wake)
        if not self.active:
            return Decision(0.0, rollback=True, wake_at=wake, down_cause="down",
                            note=f"every replica group is out (group(s) {sorted(broken)} lost a worker): the state "
                                 "survives only in the fallback checkpoint")
        pauses = (("detection", c.torchft_detect_s), ("redone iteration", c.torchft_lost_step_fraction * self.step_s),
                  ("reconfiguration", c.torchft_quorum_s))
        return Decision(self._rate(), pauses=pauses, wake_at=wake,
                        note=f"group(s) {sorted(broken)} out: {len(self.active)} of {len(self.members)} train")

    def on_wake(self, now: float) -> Decision:
        c = self.ctx.costs
        joining = sorted(g for g, t in self.ready_at.items() if t <= now)
        for g in joining:
            del self.ready_at[g]
        had_state = bool(self.active)
        self.active.update(joining)
        self._note_count(now)
        if had_state:
            pauses: tuple[tuple[str, float], ...] = (("reconfiguration", c.torchft_quorum_s), ("heal", self.heal_s()))
            note = f"group(s) {joining} healed back"
        elif self.trained:
            pauses, note = (("restart", c.restart_s),), f"group(s) {joining} restore from the fallback checkpoint"
        else:
            pauses, note = (), f"group(s) {joining} start"
        self.trained = True
        return Decision(self._rate(), pauses=pauses, wake_at=self._next_ready(), down_cause="down", note=note)
