"""Baseline MODELS (not the real systems): fault-free, fault-scaled, checkpoint-restart, Oobleck-like, Bamboo-like.

Every assumption is written on the class with its source; docs/traces.md repeats them. Rates are anchored to the
same fault-free rate (ReCycle's fault-free plan), as the paper measured for DeepSpeed, Oobleck and ReCycle (S29).
"""

from __future__ import annotations

import math
from functools import lru_cache

from recycle.config import Config
from recycle.traces.model import Decision, JobContext, StageLayout

__all__ = [
    "FaultFree",
    "FaultScaled",
    "CheckpointRestart",
    "OobleckLike",
    "BambooLike",
    "pipeline_time",
    "bamboo_fits",
    "oobleck_min_template",
    "oobleck_iteration_time",
]


def pipeline_time(loads: list[float], num_microbatches: int) -> float:
    """1F1B iteration time of one pipeline whose workers take `loads[i]` per micro-batch (F + B + W):
    (M - 1) * max(load) + sum(load) -- the steady state is paced by the slowest worker, plus one fill/drain."""
    return (num_microbatches - 1) * max(loads) + sum(loads)


def _stage_cost(config: Config, stage: int) -> float:
    c = config.costs
    return c.forward[stage] + c.backward_input[stage] + c.backward_weight[stage]


class FaultFree:
    """Every worker always live: the reference line."""

    name, label, checkpoint = "fault-free", "Fault-free (reference)", None

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def start(self, now: float, live: frozenset[int]) -> Decision:
        return Decision(self.ctx.fault_free_rate)

    def on_change(self, now, live, lost, joined) -> Decision:
        return self.start(now, live)

    def on_wake(self, now: float) -> Decision:
        return self.start(now, frozenset())


class FaultScaled:
    """Fault-free throughput x live workers / total workers, with no pauses: the analytic line of the paper (S31).
    Live units beyond D x S are spares and do not raise it above fault-free."""

    name, label, checkpoint = "fault-scaled", "Fault-scaled (analytic)", None

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def start(self, now: float, live: frozenset[int]) -> Decision:
        n = self.ctx.num_workers
        return Decision(self.ctx.fault_free_rate * min(len(live), n) / n)

    def on_change(self, now, live, lost, joined) -> Decision:
        return self.start(now, live)

    def on_wake(self, now: float) -> Decision:
        raise AssertionError("fault-scaled never asks to be woken")


class CheckpointRestart:
    """A fixed-topology job (plain DeepSpeed/Megatron) that survives failures only by restarting from a checkpoint.

    Assumptions (sources: peers.md §2 Varuna column and the Oobleck artifact's varuna_simulator):
    * a checkpoint every `checkpoint_interval_s` of training, each pausing training for `checkpoint_cost_s`;
    * losing any worker in use crashes the job: detection, then a restart (`restart_s`), and the progress since
      the last checkpoint is lost;
    * on restart it runs the largest number of full pipelines the live workers can form, D' = min(D, live // S),
      at D'/D of the fault-free rate (Varuna-style job morphing, global batch kept by more micro-batches per
      pipeline); live workers beyond D' x S wait as spares and replace failed ones at the next restart;
    * when re-joins allow a larger D', it checkpoints and restarts to grow (no work lost).
    """

    name, label = "checkpoint-restart", "Checkpoint-restart (model)"

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.checkpoint = (ctx.costs.checkpoint_interval_s, ctx.costs.checkpoint_cost_s)
        self.in_use: set[int] = set()
        self.replicas = 0

    def _form(self, live: frozenset[int]) -> float:
        S, D = self.ctx.config.num_stages, self.ctx.config.num_replicas
        self.replicas = min(D, len(live) // S)
        self.in_use = set(sorted(live)[: self.replicas * S])
        return self.ctx.fault_free_rate * self.replicas / D

    def start(self, now: float, live: frozenset[int]) -> Decision:
        rate = self._form(live)
        return Decision(rate, down_cause="down")

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        S, D = self.ctx.config.num_stages, self.ctx.config.num_replicas
        if lost & self.in_use:
            rate = self._form(live)
            return Decision(rate, pauses=(("detection", c.detect_s), ("restart", c.restart_s)), rollback=True,
                            note=f"crash: restart with {self.replicas} pipeline(s)")
        if min(D, len(live) // S) > self.replicas:
            old = self.replicas
            rate = self._form(live)
            return Decision(rate, pauses=(("checkpoint", c.checkpoint_cost_s), ("restart", c.restart_s)),
                            checkpoint_now=True, note=f"grow: restart with {self.replicas} pipeline(s) (was {old})")
        return Decision(self.ctx.fault_free_rate * self.replicas / D)

    def on_wake(self, now: float) -> Decision:
        raise AssertionError("checkpoint-restart never asks to be woken")


def oobleck_min_template(config: Config, device_memory_bytes: int) -> int:
    """Fewest workers one pipeline can span: model state / n + one micro-batch's activations of the whole model
    (the first stage of 1F1B holds n micro-batches of 1/n of the layers) must fit in device memory."""
    m = config.memory
    state = sum(m.parameter_bytes) + sum(m.optimizer_state_bytes)
    acts = sum(m.activation_bytes)
    if state == 0:
        return 1
    room = device_memory_bytes - acts
    if room <= 0:
        return math.inf  # type: ignore[return-value]
    return max(1, math.ceil(state / room))


def oobleck_iteration_time(live: int, batch: int, total_cost: float, min_size: int, max_size: int) -> float:
    """Best iteration time over instantiations of P pipelines from `live` workers (sizes as even as possible,
    each in [min_size, max_size]), with the global batch of `batch` micro-batches split continuously so that all
    pipelines finish together: pipeline i with n_i workers and x_i micro-batches takes C * (1 + (x_i - 1) / n_i),
    hence T = C * (1 + (batch - P) / sum(n_i)). Inf if no pipeline fits."""
    if live < min_size:
        return math.inf
    best = math.inf
    for pipes in range(1, min(live // min_size, batch) + 1):
        used = min(live, pipes * max_size)
        best = min(best, total_cost * (1 + (batch - pipes) / used))
    return best


class OobleckLike:
    """Oobleck-like reconfiguration (SOSP'23; peers.md §2), as a model:

    * pipeline templates for every worker count from the fewest that fit in memory (`oobleck_min_template`) up to
      2 S; on every change of the live set it re-instantiates the best set of pipelines over all live workers and
      redistributes the global batch (kept constant) across them (`oobleck_iteration_time`), using at most
      D x S workers (the job's size; extra live units are spares, as for every system); the rate is anchored
      so that D x S live workers give the fault-free rate (Oobleck = DeepSpeed = ReCycle fault-free, S29);
    * each change (failure or re-join) pauses training: detection on failures, `oobleck_reconfig_s` (the
      artifact's GPT-3 6.7B value) and the copy of one worker's share of the model state over one link;
    * its state survives as long as some template fits on the live workers (it does not track which layers
      the lost nodes held: optimistic for Oobleck); below that it is down until enough workers return;
    * it checkpoints only as a fallback (`fallback_checkpoint_*`).
    """

    name, label = "oobleck", "Oobleck-like (model)"

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.checkpoint = (ctx.costs.fallback_checkpoint_interval_s, ctx.costs.fallback_checkpoint_cost_s)
        self.min_size = oobleck_min_template(cfg, ctx.worker_memory_bytes)
        self.max_size = max(2 * cfg.num_stages, 2 * self.min_size if math.isfinite(self.min_size) else 1)
        self.batch = cfg.num_replicas * cfg.num_microbatches
        self.total_cost = sum(_stage_cost(cfg, s) for s in range(cfg.num_stages))
        self._time = lru_cache(maxsize=None)(self._iteration_time)
        self.reference = self._time(ctx.num_workers)
        self.live_count = 0

    def _iteration_time(self, live: int) -> float:
        return oobleck_iteration_time(live, self.batch, self.total_cost, self.min_size, self.max_size)

    def rate(self, live: int) -> float:
        t = self._time(min(live, self.ctx.num_workers))  # the job is sized D x S: extra units are spares
        return 0.0 if math.isinf(t) or math.isinf(self.reference) else self.ctx.fault_free_rate * self.reference / t

    def _copy_s(self) -> float:
        m = self.ctx.config.memory
        state = sum(m.parameter_bytes) + sum(m.optimizer_state_bytes)
        return self.ctx.transfer_s(state / self.ctx.num_workers)

    def start(self, now: float, live: frozenset[int]) -> Decision:
        self.live_count = len(live)
        return Decision(self.rate(len(live)), down_cause="down")

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        was_down = self.rate(self.live_count) == 0
        self.live_count = len(live)
        rate = self.rate(len(live))
        if rate == 0:
            return Decision(0.0, rollback=not was_down, down_cause="down", note="no template fits the live workers")
        pauses = (("detection", c.detect_s),) if lost else ()
        if was_down:
            return Decision(rate, pauses=pauses + (("restart", c.restart_s),), note="restore from checkpoint")
        return Decision(rate, pauses=pauses + (("reconfiguration", c.oobleck_reconfig_s + self._copy_s()),))

    def on_wake(self, now: float) -> Decision:
        raise AssertionError("oobleck never asks to be woken")


def bamboo_fits(config: Config, device_memory_bytes: int) -> tuple[bool, str]:
    """Bamboo's redundant layers: worker of stage s also holds stage s+1 (ring): both stages' parameters and
    optimizer state plus both stages' 1F1B activation stashes (eager redundant forwards) must fit."""
    m = config.memory
    S = config.num_stages
    for s in range(S):
        n = (s + 1) % S
        need = (m.parameter_bytes[s] + m.optimizer_state_bytes[s] + m.parameter_bytes[n] + m.optimizer_state_bytes[n]
                + (S - s) * m.activation_bytes[s] + (S - n) * m.activation_bytes[n])
        if need > device_memory_bytes:
            return False, (f"stage {s} needs {need / 1e9:.1f} GB with stage {n}'s redundant copy, more than "
                           f"{device_memory_bytes / 1e9:.0f} GB")
    return True, ""


class BambooLike:
    """Bamboo-like redundant computation (NSDI'23; peers.md §3), as a model:

    * every worker of stage s also holds and computes stage s+1 (ring) in bubbles: the fault-free rate is reduced
      by `bamboo_rc_overhead` (Oobleck artifact's bamboo_simulator redundant_ratio; the ReCycle poster measured
      Bamboo 35% below ReCycle fault-free for GPT-3 350M), and the redundant copy must fit in memory
      (`bamboo_fits`), otherwise zero throughput, as in the paper's 6.7B panel (PO(c));
    * a failed worker (p, s) is taken over by its predecessor (p, s-1): that worker now carries both stages and
      pipeline p slows to `pipeline_time`; all pipelines step together, so the slowest one paces the job;
    * losing two adjacent stages of one pipeline is fatal (no copy left): restart from a checkpoint, then run
      D' = min(D, live // S) full pipelines (peers.md §3, "fatal failure");
    * every change pauses training: detection on failures plus `bamboo_reconfig_s` (artifact, GPT-3 6.7B);
      re-joining workers fill holes (state transfer of both stages, then the same pause);
    * it checkpoints only as a fallback (`fallback_checkpoint_*`).
    """

    name, label = "bamboo", "Bamboo-like (model)"

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.checkpoint = (ctx.costs.fallback_checkpoint_interval_s, ctx.costs.fallback_checkpoint_cost_s)
        self.fits, self.why = bamboo_fits(cfg, ctx.worker_memory_bytes)
        self.layout = StageLayout(cfg.num_replicas, cfg.num_stages)
        self.active = cfg.num_replicas
        self.costs_per_stage = [_stage_cost(cfg, s) for s in range(cfg.num_stages)]
        self.reference = pipeline_time(self.costs_per_stage, cfg.num_microbatches)
        self.down = False

    def _transfer(self, stage: int) -> float:
        nxt = (stage + 1) % self.ctx.config.num_stages
        return self.ctx.transfer_s(self.ctx.stage_state_bytes(stage) + self.ctx.stage_state_bytes(nxt))

    def _rate(self, now: float) -> tuple[float, bool]:
        """(rate, fatal) for the current layout."""
        cfg = self.ctx.config
        S, D, M = cfg.num_stages, cfg.num_replicas, cfg.num_microbatches
        if self.active == 0:
            return 0.0, False
        ready = self.layout.ready_workers(now)
        slowest = 0.0
        for p in range(self.active):
            loads = [0.0] * S
            for s in range(S):
                host = s
                while (p, host) not in ready:
                    host = (host - 1) % S
                    if host == s or host == (s - 2) % S:  # the predecessor is dead too: no copy of stage s left
                        return 0.0, True
                loads[host] += self.costs_per_stage[s]
            slowest = max(slowest, pipeline_time([x for x in loads if x > 0], M))
        full = self.ctx.fault_free_rate * (1 - self.ctx.costs.bamboo_rc_overhead)
        return full * (self.active / D) * self.reference / slowest, False

    def _decide(self, now: float, pauses: tuple[tuple[str, float], ...], note: str = "") -> Decision:
        if not self.fits:
            return Decision(0.0, down_cause="down", note=self.why)
        rate, fatal = self._rate(now)
        if fatal:
            first = not self.down
            self.down = True
            live = list(self.layout.where) + self.layout.spares
            S, D = self.ctx.config.num_stages, self.ctx.config.num_replicas
            self.active = min(D, len(live) // S)
            self.layout.place_all(live, replicas=self.active)
            rate, _ = self._rate(now)
            restart = (("restart", self.ctx.costs.restart_s),) if rate > 0 else ()
            self.down = rate == 0
            return Decision(rate, pauses=pauses + restart, rollback=first, down_cause="down",
                            overhead=self._overhead(rate), note=f"fatal: restart with {self.active} pipeline(s)")
        return Decision(rate, pauses=pauses, wake_at=self.layout.next_ready(now), overhead=self._overhead(rate),
                        note=note)

    def _overhead(self, rate: float) -> tuple[tuple[str, float], ...]:
        if rate <= 0:
            return ()
        return (("redundant computation", self.ctx.fault_free_rate * self.ctx.costs.bamboo_rc_overhead
                 * rate / (self.ctx.fault_free_rate * (1 - self.ctx.costs.bamboo_rc_overhead))),)

    def start(self, now: float, live: frozenset[int]) -> Decision:
        S, D = self.ctx.config.num_stages, self.ctx.config.num_replicas
        self.active = min(D, len(live) // S)  # full pipelines only; the rest wait as spares
        self.layout.place_all(live, replicas=self.active)
        self.down = self.active == 0
        return self._decide(now, ())

    def on_change(self, now, live, lost, joined) -> Decision:
        c = self.ctx.costs
        hit = False
        for u in lost:
            hit |= self.layout.remove(u) is not None
        for u in sorted(joined):
            self.layout.add_spare(u)
        S, D = self.ctx.config.num_stages, self.ctx.config.num_replicas
        if self.down and len(live) // S > 0:
            self.active = min(D, len(live) // S)
            self.layout.place_all(live, replicas=self.active)
            self.down = False
            rate, _ = self._rate(now)
            return Decision(rate, pauses=(("restart", c.restart_s),), overhead=self._overhead(rate),
                            note="restore from checkpoint")
        filled = self.layout.fill_from_spares(now, self._transfer, replicas=range(self.active))
        while len(self.layout.spares) >= S and self.active < D:  # enough spares for one more pipeline
            self.active += 1
            filled += self.layout.fill_from_spares(now, self._transfer, replicas=range(self.active))
        pauses: tuple[tuple[str, float], ...] = ()
        if hit:
            pauses = (("detection", c.detect_s), ("reconfiguration", c.bamboo_reconfig_s))
        return self._decide(now, pauses, note=f"filled {len(filled)} slot(s)" if filled else "")

    def on_wake(self, now: float) -> Decision:
        # A re-joined worker finished its state transfer: rebalance onto it.
        return self._decide(now, (("reconfiguration", self.ctx.costs.bamboo_reconfig_s),), note="re-join ready")
