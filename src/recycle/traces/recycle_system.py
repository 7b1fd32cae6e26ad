"""ReCycle replayed over a trace: re-route around failed workers with the plan for the normalized failure state."""

from __future__ import annotations

from recycle.traces.mapping import StageLayout
from recycle.traces.model import Decision, JobContext
from recycle.traces.throughput import ThroughputModel

__all__ = ["ReCycleSystem"]


class ReCycleSystem:
    """ReCycle as the job simulator sees it:

    * units are laid out on the D x S grid; a failed worker's slot stays empty and the rate is the throughput of
      the plan for the normalized key of the empty slots (`ThroughputModel`, cached per key);
    * a failure of a working worker costs `detect_s` then `plan_switch_s` (a plan-store lookup, not a solve);
    * a re-joining unit (or a spare) fills an empty slot of the most depleted stage; it first copies its stage's
      parameters and optimizer state from a live peer over one link while training goes on with the old plan,
      then every worker switches plan (`plan_switch_s`);
    * a stage that loses every replica has lost its weights: the progress since the last (fallback) checkpoint is
      lost, and once at least S units are live the job restores from the checkpoint (`restart_s`) onto all live
      units, laid out stage by stage;
    * periodic fallback checkpoints (`fallback_checkpoint_*`, asynchronous by default).
    """

    name = "recycle"

    def __init__(self, ctx: JobContext, throughput: ThroughputModel) -> None:
        self.ctx = ctx
        self.model = throughput
        self.label = f"ReCycle ({throughput.label})" if throughput.label else "ReCycle"
        self.checkpoint = (ctx.costs.fallback_checkpoint_interval_s, ctx.costs.fallback_checkpoint_cost_s)
        cfg = ctx.config
        self.layout = StageLayout(cfg.num_replicas, cfg.num_stages)
        self.down = False
        self.key: tuple[int, ...] | None = None

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
        if len(live) < S:
            self.down = True
            self.key = None
            return Decision(0.0, rollback=first_loss, down_cause="down", note=note + "; waiting for workers")
        self.down = False
        self.layout.place_all(live)
        self.key = None
        decision = self._running(now, (("restart", self.ctx.costs.restart_s),), note=note + "; restored")
        return Decision(decision.rate, pauses=decision.pauses, rollback=first_loss, wake_at=decision.wake_at,
                        note=decision.note)

    def start(self, now: float, live: frozenset[int]) -> Decision:
        self.layout.place_all(live)
        lost = self._stage_lost(now)
        if lost is not None:
            return self._restore(now, live, first_loss=False, lost_stage=lost)
        return self._running(now, ())

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        working = self.layout.ready_workers(now)
        hit = False
        for u in lost:
            w = self.layout.remove(u)
            hit |= w is not None and w in working
        for u in sorted(joined):
            self.layout.add_spare(u)
        if self.down:
            return self._restore(now, live, first_loss=False, lost_stage=-1)
        self.layout.fill_from_spares(now, self.ctx.stage_transfer_s)
        stage = self._stage_lost(now)
        if stage is not None:
            return self._restore(now, live, first_loss=True, lost_stage=stage)
        return self._running(now, (("detection", c.detect_s),) if hit else ())

    def on_wake(self, now: float) -> Decision:
        return self._running(now, (), note="re-join ready")
