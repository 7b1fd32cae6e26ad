"""ReCycle replayed over a trace: re-route around failed workers with the plan for the normalized failure state."""

from __future__ import annotations

from dataclasses import replace

from recycle.traces.model import CheckpointTiming, Decision, JobContext, StageLayout
from recycle.traces.runtime_layout import balancing_moves, return_slot
from recycle.traces.throughput import ThroughputModel

__all__ = ["ReCycleSystem"]


class ReCycleSystem:
    """ReCycle as the job simulator sees it:

    * units are laid out on the D x S grid; a failed worker's slot stays empty and the rate is the throughput of
      the plan for the normalized key of the empty slots (`ThroughputModel`, cached per key);
    * a failure of a working worker costs `detect_s` then `plan_switch_s` (a plan-store lookup, not a solve), and the
      work of the iteration it interrupted that was thrown away is redone on the new plan: `redo_fraction` of one
      period of the state after the failure (the runtime's records measure that fraction: traces/calibration.py);
    * a re-joining unit (or a spare) fills an empty slot of the most depleted stage; it first copies its stage's
      parameters and optimizer state from a live peer over one link while training goes on with the old plan,
      then every worker switches plan (`plan_switch_s`);
    * a stage that loses every replica has lost its weights: the progress since the last (fallback) checkpoint is
      lost, and once at least S units are live the job restores from the checkpoint (`restart_s`) onto all live
      units, laid out stage by stage;
    * periodic fallback checkpoints (`fallback_checkpoint_*`, asynchronous by default), or every
      `checkpoint_every_steps` iterations of progress as the runtime takes them, each restorable only
      `checkpoint_latency_s` after it is taken (write + merge);
    * `runtime_layout`: the runtime's layout rules instead (traces/runtime_layout.py): a returning unit takes back
      its own slot (or the one its reshape donor left), a lost stage is refilled by moving workers within their
      pipelines (then restored from the checkpoint; down while a stage stays empty), and no reshape;
    * reshape policy (`JobCosts.reshape`, on by default): after every change, the live workers (spares included)
      could instead form D' = live // S full pipelines plus leftover workers whose micro-batches are re-routed
      (the global batch stays D x M micro-batches: `_compact`). When that layout's rate beats the current one's
      (every placed worker counted ready) by enough that the gain over `reshape_horizon_s` repays the pause, the
      job reshapes: training pauses for `oobleck_reconfig_s` (rebuild pipelines and communicators, as Oobleck's
      reconfiguration) plus the slowest copy of a new stage's parameters and optimizer state to a worker that
      changes stage (from a live peer: no checkpoint, no rollback). Workers that return later grow the job back
      through the usual re-join path (most depleted stage first), and the check runs again.

    `policy_log` records (time, policy, detail) for every reshape, restore (from the checkpoint after a lost stage)
    and down event, and each return to "adapt" (re-routing on the D x S grid).
    """

    name = "recycle"

    def __init__(self, ctx: JobContext, throughput: ThroughputModel) -> None:
        self.ctx = ctx
        self.model = throughput
        self.label = f"ReCycle ({throughput.label})" if throughput.label else "ReCycle"
        self.checkpoint = (ctx.costs.fallback_checkpoint_interval_s, ctx.costs.fallback_checkpoint_cost_s)
        cfg = ctx.config
        self.batch_samples = cfg.num_replicas * cfg.num_microbatches * cfg.workload.microbatch_size
        self.checkpoint_timing = CheckpointTiming(ctx.costs.checkpoint_every_steps * self.batch_samples,
                                                  ctx.costs.checkpoint_latency_s,
                                                  ctx.costs.steps_done_at_start * self.batch_samples,
                                                  ctx.costs.restore_expected_loss)
        self.home: dict[int, tuple[int, int]] = {}  # runtime_layout: the slot each unit last held
        self.vacated: dict[tuple[int, int], tuple[int, int]] = {}  # a lost stage's slot -> the slot its donor left
        self.layout = StageLayout(cfg.num_replicas, cfg.num_stages)
        self.down = False
        self.key: tuple[int, ...] | None = None
        self.policy_log: list[tuple[float, str, str]] = []

    def _log(self, now: float, policy: str, detail: str) -> None:
        if not self.policy_log or self.policy_log[-1][1] != policy or policy != "adapt":
            self.policy_log.append((now, policy, detail))

    def _stage_lost(self, now: float) -> int | None:
        counts = self.layout.live_per_stage(now)
        return counts.index(0) if 0 in counts else None

    def _running(self, now: float, pauses: tuple[tuple[str, float], ...], note: str = "") -> Decision:
        key = self.model.key_for(self.layout.failed_workers(now))
        switch = key != self.key and self.key is not None
        self.key = key
        if switch:
            pauses = pauses + (("plan switch", self.ctx.costs.plan_switch_s),)
        return Decision(self.model.throughput_for_key(key), pauses=pauses, wake_at=self.layout.next_ready(now),
                        note=note or f"key {key}")

    def _restore(self, now: float, live: frozenset[int], first_loss: bool, lost_stage: int) -> Decision:
        S = self.ctx.config.num_stages
        note = f"stage {lost_stage} lost every replica" if lost_stage >= 0 else "workers returned"
        if self.ctx.costs.runtime_layout:
            return self._restore_in_place(now, first_loss, note)
        if len(live) < S:
            self.down = True
            self.key = None
            self._log(now, "down", f"{len(live)} live workers < S = {S}")
            return Decision(0.0, rollback=first_loss, down_cause="down", note=note + "; waiting for workers")
        self.down = False
        self.layout.place_all(live)
        self.key = None
        full = min(len(live) // S, self.ctx.config.num_replicas)
        self._log(now, "restore", f"from the checkpoint onto {len(live)} live workers: {full} full pipeline(s), "
                                  f"key {self.model.key_for(self.layout.failed_workers(now))}")
        decision = self._running(now, (("restart", self.ctx.costs.restart_s),), note=note + "; restored")
        return Decision(decision.rate, pauses=decision.pauses, rollback=first_loss, wake_at=decision.wake_at,
                        note=decision.note)

    def _restore_in_place(self, now: float, first_loss: bool, note: str) -> Decision:
        """The runtime's restore: every unit keeps its slot, workers of the fullest stages move into the emptied
        one within their pipelines; while a stage stays empty (no stage to spare) the job waits for a returning
        unit (a spare, a unit the trace never placed, fills an empty slot first). Everyone loads the checkpoint, so
        no state copy is pending."""
        self.layout.fill_from_spares(now, lambda stage: 0.0)
        moves = balancing_moves(self.layout)
        for donor, slot in moves:
            self.vacated[slot] = donor
        self.layout.ready_at.clear()
        self.home.update(self.layout.where)
        self.key = None
        if 0 in self.layout.live_per_stage(now):
            self.down = True
            self._log(now, "down", "a stage holds no worker and no stage has one to spare")
            return Decision(0.0, rollback=first_loss, down_cause="down", note=note + "; waiting for workers")
        self.down = False
        moved = ", ".join(f"{d[0]}:{d[1]} -> {t[0]}:{t[1]}" for d, t in moves)
        self._log(now, "restore", f"from the checkpoint in place{f' (moved {moved})' if moved else ''}, key "
                                  f"{self.model.key_for(self.layout.failed_workers(now))}")
        decision = self._running(now, (("restart", self.ctx.costs.restart_s),), note=note + "; restored")
        return replace(decision, rollback=first_loss)

    def _return(self, now: float, unit: int, restoring: bool) -> None:
        """runtime_layout: a unit comes back to its own slot (or its donor's) after copying its stage's state from
        a live peer (none to copy when the job restores anyway); else it waits as a spare."""
        slot = return_slot(self.layout, self.home.get(unit), self.vacated)
        if slot is None:
            self.layout.add_spare(unit)
            return
        self.layout.slot[slot] = unit
        self.layout.where[unit] = slot
        self.home[unit] = slot
        delay = 0.0 if restoring else self.ctx.stage_transfer_s(slot[1])
        if delay > 0:
            self.layout.ready_at[unit] = now + delay

    def start(self, now: float, live: frozenset[int]) -> Decision:
        self.layout.place_all(live)
        self.home.update(self.layout.where)
        lost = self._stage_lost(now)
        if lost is not None:
            return self._restore(now, live, first_loss=False, lost_stage=lost)
        self._log(now, "adapt", "start")
        return self._running(now, ())

    def _settled_key(self) -> tuple[int, ...]:
        """The key once every placed worker has its state (transfers in flight counted done)."""
        cfg = self.ctx.config
        empty = [(p, s) for p in range(cfg.num_replicas) for s in range(cfg.num_stages)
                 if (p, s) not in self.layout.slot]
        return self.model.key_for(empty)

    def _compact(self, live: frozenset[int]) -> tuple[dict[int, int], list[int]]:
        """Target workers per stage for the reshaped layout and the stage each live unit takes.

        D' = live // S (at most D) full pipelines; the leftover live % S workers (when D' < D) go to the stages
        that already hold the most units, so as few units as possible change stage. Units keep their stage while
        it is under target; the rest (and spares) fill the stages still short, in order.
        """
        cfg = self.ctx.config
        D, S = cfg.num_replicas, cfg.num_stages
        full = min(len(live) // S, D)
        extra = len(live) - full * S if full < D else 0
        current = {s: [u for (_, st), u in sorted(self.layout.slot.items()) if st == s and u in live]
                   for s in range(S)}
        by_size = sorted(range(S), key=lambda s: (-len(current[s]), s))
        target = [full + (1 if s in by_size[:extra] else 0) for s in range(S)]
        stage_of: dict[int, int] = {}
        movers = sorted(set(live) - {u for us in current.values() for u in us})
        for s in range(S):
            keep = current[s][:target[s]]
            stage_of.update({u: s for u in keep})
            movers.extend(current[s][target[s]:])
        movers.reverse()  # pop() from the end takes them in the order collected
        for s in range(S):
            for _ in range(target[s] - min(len(current[s]), target[s])):
                if movers:
                    stage_of[movers.pop()] = s
        return stage_of, target

    def _maybe_reshape(self, now: float, live: frozenset[int]) -> Decision | None:
        """Reshape when the compact layout is faster by enough to repay its pause within the horizon."""
        c = self.ctx.costs
        cfg = self.ctx.config
        D, S = cfg.num_replicas, cfg.num_stages
        if not c.reshape or len(live) < S:
            return None
        stage_of, target = self._compact(live)
        new_key = tuple(D - t for t in target)
        if any(k >= D for k in new_key):
            return None
        current_rate = self.model.throughput_for_key(self._settled_key())
        moved = {u for u, s in stage_of.items() if self.layout.where.get(u, (None, None))[1] != s}
        # Copies run in parallel: the slowest new-stage copy, or a re-join copy still in flight for a kept unit.
        copies = [self.ctx.stage_transfer_s(stage_of[u]) for u in moved]
        copies += [self.layout.ready_at[u] - now for u in stage_of
                   if u not in moved and self.layout.ready_at.get(u, now) > now]
        pause = c.oobleck_reconfig_s + max(copies, default=0.0)

        def repays(new_rate: float) -> bool:  # never falls as new_rate grows, so an upper bound can rule it out
            return new_rate > current_rate and (new_rate - current_rate) * c.reshape_horizon_s > new_rate * pause

        # Most reshapes do not pay; a bound on the new layout's rate says so without planning its key.
        if not repays(self.model.rate_bound(new_key)):
            return None
        new_rate = self.model.throughput_for_key(new_key)
        if not repays(new_rate):
            return None
        # Re-place: stage s gets rows 0..target[s]-1; units already ready keep no transfer (the pause covers copies).
        self.layout.slot.clear()
        self.layout.where.clear()
        self.layout.ready_at.clear()
        rows = {s: 0 for s in range(S)}
        for u in sorted(stage_of, key=lambda u: (stage_of[u], u)):
            s = stage_of[u]
            self.layout.slot[(rows[s], s)] = u
            self.layout.where[u] = (rows[s], s)
            rows[s] += 1
        self.layout.spares = sorted(set(live) - set(stage_of))
        full = min(target)
        detail = (f"D'={full} full pipeline(s) + {sum(target) - full * S} re-routed worker(s), key {new_key}, "
                  f"{len(moved)} worker(s) change stage, pause {pause:.0f} s, rate {current_rate:.2f} -> "
                  f"{new_rate:.2f} samples/s")
        self._log(now, "reshape", detail)
        self.key = new_key
        return Decision(new_rate, pauses=(("reconfiguration", pause),), wake_at=self.layout.next_ready(now),
                        note=f"reshape: {detail}")

    def _redo_s(self, rate: float) -> float:
        """The thrown-away work of the iteration a failure interrupted, redone on the new plan at `rate`: the
        samples it had done (`redo_fraction` of the global batch) took the old plan's time once and take the new
        plan's time again, with nothing to show for the first time."""
        if self.ctx.costs.redo_fraction == 0 or rate <= 0:
            return 0.0
        return self.ctx.costs.redo_fraction * self.batch_samples / rate

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        working = self.layout.ready_workers(now)
        hit = False
        for u in lost:
            w = self.layout.remove(u)
            hit |= w is not None and w in working
        for u in sorted(joined):
            if c.runtime_layout:
                self._return(now, u, restoring=self.down)
            else:
                self.layout.add_spare(u)
        if self.down:
            return self._restore(now, live, first_loss=False, lost_stage=-1)
        self.layout.fill_from_spares(now, self.ctx.stage_transfer_s)
        self.home.update(self.layout.where)
        stage = self._stage_lost(now)
        if stage is not None:
            return self._restore(now, live, first_loss=True, lost_stage=stage)
        detection = (("detection", c.detect_s),) if hit else ()
        reshaped = None if c.runtime_layout else self._maybe_reshape(now, live)
        if reshaped is not None:
            self.home.update(self.layout.where)
            redo = (("redone iteration", self._redo_s(reshaped.rate)),) if hit else ()
            return Decision(reshaped.rate, pauses=detection + redo + reshaped.pauses, wake_at=reshaped.wake_at,
                            note=reshaped.note)
        self._log(now, "adapt", f"key {self.model.key_for(self.layout.failed_workers(now))}")
        decision = self._running(now, detection)
        if not hit:
            return decision
        return replace(decision, pauses=detection + (("redone iteration", self._redo_s(decision.rate)),)
                       + decision.pauses[len(detection):])

    def on_wake(self, now: float) -> Decision:
        return self._running(now, (), note="re-join ready")
