"""Generate synthetic traces: per-node Poisson or Weibull failures with repairs (seeded), and named presets."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace

from recycle.errors import TraceError
from recycle.traces.placement import availability_to_events
from recycle.traces.trace import (ADD, MAX_NODES_WHY, MAX_TRACE_EVENTS, MAX_TRACE_NODES, REMOVE, AvailabilityTrace,
                                  EventTrace, TraceEvent, WorkerGrid, check_replay_size)

__all__ = [
    "FailureModel",
    "LLAMA3_INTERRUPTIONS",
    "LLAMA3_DAYS",
    "LLAMA3_GPUS",
    "llama3_model",
    "generate_trace",
    "paper_gcp_shape",
    "PAPER_GCP_PROFILE",
    "PAPER_GCP_HOURS",
    "paper_gcp_grid",
    "parse_generate_spec",
    "GENERATE_HELP",
]

HOUR_MS = 3_600_000

# Llama 3 (Meta, arXiv 2407.21783; peers.md §8.1): 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384


@dataclass(frozen=True)
class FailureModel:
    """Each node alternates up and down: time to failure ~ exponential (Poisson process) or Weibull with mean
    `mtbf_h` (per node, counted over the node's up time), then a repair of mean `repair_mean_h` (exponential,
    fixed or lognormal) after which the same node re-joins. `repair_mean_h = 0` means a failed node never returns."""

    num_nodes: int
    duration_h: float
    mtbf_h: float
    distribution: str = "exponential"  # "exponential" (Poisson failures) or "weibull"
    weibull_shape: float = 0.7  # < 1: infant mortality / bursty, as fleet studies commonly fit
    repair: str = "exponential"  # "exponential", "fixed" or "lognormal"
    repair_mean_h: float = 2.0
    repair_sigma: float = 1.0  # lognormal only: sigma of log(repair time)
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> TraceError:
            return TraceError(f"failure model: {what}; {fix}")

        if self.num_nodes < 1:
            raise bad(f"nodes = {self.num_nodes} must be >= 1", "give the number of nodes, e.g. nodes=30")
        if not (self.duration_h > 0 and math.isfinite(self.duration_h)):
            raise bad(f"duration = {self.duration_h} h must be > 0", "give hours=H or days=D")
        if not (self.mtbf_h > 0 and math.isfinite(self.mtbf_h)):
            raise bad(f"mtbf_h = {self.mtbf_h} must be > 0", "give the per-node mean time between failures in hours")
        if self.distribution not in ("exponential", "weibull"):
            raise bad(f"distribution {self.distribution!r} is unknown", "use exponential (Poisson) or weibull")
        if self.weibull_shape <= 0:
            raise bad(f"shape = {self.weibull_shape} must be > 0", "use e.g. shape=0.7")
        if self.repair not in ("exponential", "fixed", "lognormal"):
            raise bad(f"repair {self.repair!r} is unknown", "use exponential, fixed or lognormal")
        if self.repair_mean_h < 0 or self.repair_sigma <= 0:
            raise bad(f"repair_h = {self.repair_mean_h}, repair_sigma = {self.repair_sigma}",
                      "repair_h must be >= 0 and repair_sigma > 0")
        if self.num_nodes > MAX_TRACE_NODES:
            raise bad(f"nodes = {self.num_nodes:,} is above the limit of {MAX_TRACE_NODES:,} ({MAX_NODES_WHY})",
                      "give fewer nodes")
        expected = self.expected_events
        if expected > MAX_TRACE_EVENTS:
            raise bad(f"nodes x hours / mtbf_h = {self.num_nodes:,} x {self.duration_h:g} / {self.mtbf_h:g} makes "
                      f"about {expected:,.0f} node events (a failure and a repair each), above the limit of "
                      f"{MAX_TRACE_EVENTS:,} for one trace", "use fewer nodes, fewer hours or a longer mtbf_h")
        check_replay_size(int(expected) + 1, self.num_nodes, "failure model",
                          "use fewer nodes, fewer hours or a longer mtbf_h")

    @property
    def rate_per_node_hour(self) -> float:
        return 1.0 / self.mtbf_h

    @property
    def expected_events(self) -> float:
        """About how many events the trace has: each node fails about duration / mtbf times (its up time is at
        most the duration) and is repaired after each failure (when repairs are on)."""
        return self.num_nodes * self.duration_h / self.mtbf_h * (2 if self.repair_mean_h > 0 else 1)


def llama3_model(num_nodes: int = LLAMA3_GPUS // 8, days: float = LLAMA3_DAYS, gpus_per_node: int = 8,
                 repair_mean_h: float = 2.0, seed: int = 0) -> FailureModel:
    """Per-node failure rate calibrated to Llama 3: 419 unexpected interruptions / (2,048 8-GPU nodes x 54 days),
    i.e. a per-GPU rate scaled by the node's GPU count. The repair time is an assumption (not in the report)."""
    gpu_hours_per_failure = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # ~50.7k GPU-hours
    mtbf_node_h = gpu_hours_per_failure / gpus_per_node
    return FailureModel(num_nodes=num_nodes, duration_h=days * 24, mtbf_h=mtbf_node_h, repair_mean_h=repair_mean_h,
                        seed=seed)


def _time_to_failure(model: FailureModel, rng: random.Random) -> float:
    if model.distribution == "exponential":
        return rng.expovariate(1.0 / model.mtbf_h)
    # Weibull with mean mtbf: scale = mean / Gamma(1 + 1/k).
    scale = model.mtbf_h / math.gamma(1.0 + 1.0 / model.weibull_shape)
    return rng.weibullvariate(scale, model.weibull_shape)


def _repair_time(model: FailureModel, rng: random.Random) -> float:
    mean = model.repair_mean_h
    if mean == 0:
        return math.inf
    if model.repair == "fixed":
        return mean
    if model.repair == "exponential":
        return rng.expovariate(1.0 / mean)
    mu = math.log(mean) - model.repair_sigma ** 2 / 2  # lognormal with the requested mean
    return rng.lognormvariate(mu, model.repair_sigma)


def generate_trace(model: FailureModel) -> EventTrace:
    """Simulate every node's up/down renewal process over the duration; all nodes are up at time 0."""
    rng = random.Random(model.seed)
    names = [f"node{i + 1}" for i in range(model.num_nodes)]
    horizon = model.duration_h
    events: list[tuple[int, int, str, str]] = []  # (time_ms, order, action, node); removes before adds at a tie
    for node in names:
        t = 0.0
        while True:
            t += _time_to_failure(model, rng)
            if t >= horizon:
                break
            events.append((int(t * HOUR_MS), 0, REMOVE, node))
            t += _repair_time(model, rng)
            if t >= horizon:
                break
            events.append((int(t * HOUR_MS), 1, ADD, node))
            if len(events) > MAX_TRACE_EVENTS:  # a heavy-tailed draw far above the expected count
                raise TraceError(f"failure model: more than {MAX_TRACE_EVENTS:,} node events drawn, the limit for one "
                                 "trace; use fewer nodes, fewer hours or a longer mtbf_h")
    events.sort(key=lambda e: (e[0], e[1], e[3]))
    trace = tuple(TraceEvent(t, action, node) for t, _, action, node in events if t > 0)
    return EventTrace(trace, frozenset(names), int(horizon * HOUR_MS), source=f"generated:{_describe(model)}")


def _describe(model: FailureModel) -> str:
    return ",".join(f"{f.name}={getattr(model, f.name)}" for f in fields(model))


# Availability (hours, live workers out of 24) shaped like the GCP trace on ReCycle's poster/slides (S27, PO(a)):
# mostly 20-23, the worst excursion 4.1-4.9 h down to 15 at ~4.6 h, back to 21 at ~5 h and to 24 at ~6.2 h.
# A hand-made shape, not the real trace (which is not public); its time-average is 21.7 live workers.
PAPER_GCP_PROFILE: tuple[tuple[float, int], ...] = (
    (0.00, 24), (0.25, 23), (0.55, 23), (0.80, 23), (1.05, 22), (1.35, 22), (1.60, 22), (1.90, 23),
    (2.15, 23), (2.40, 22), (2.70, 22), (3.00, 23), (3.20, 22), (3.45, 22), (3.70, 22), (3.90, 21),
    (4.10, 19), (4.30, 17), (4.50, 15), (4.75, 17), (4.90, 19), (5.00, 21), (5.30, 23), (5.60, 23),
    (5.90, 23), (6.20, 24),
)
PAPER_GCP_HOURS = 6.3


def paper_gcp_grid() -> WorkerGrid:
    """The paper's job: D=6 x S=4 workers, one GPU per trace node and per worker (GPT-3 6.7B on 24 A100s)."""
    return WorkerGrid(num_stages=4, num_replicas=6)


def paper_gcp_shape(seed: int = 0, scale_nodes: int = 24, placement: str = "random",
                    grid: WorkerGrid | None = None) -> EventTrace:
    """The deterministic availability trace shaped like the paper's GCP trace, as node events. Which nodes fail is
    not in the trace: `placement` (random | spread | worst, see `availability_to_events`) and `seed` choose them;
    the grid-aware placements act on `grid` (default: the paper's D=6 x S=4, one GPU per node and worker)."""
    if scale_nodes != 24:
        raise TraceError(f"paper-gcp: nodes = {scale_nodes}; the shape is defined for 24 workers only")
    times = tuple(int(h * HOUR_MS) for h, _ in PAPER_GCP_PROFILE)
    live = tuple(n for _, n in PAPER_GCP_PROFILE)
    avail = AvailabilityTrace(times, live, int(PAPER_GCP_HOURS * HOUR_MS), source="generated:paper-gcp-shape")
    if placement != "random" and grid is None:
        grid = paper_gcp_grid()
    return availability_to_events(avail, seed=seed, capacity=24, placement=placement, grid=grid)


GENERATE_HELP = (
    "SPEC is KIND[:key=value,...]. Kinds: 'poisson' / 'weibull' (keys: nodes, hours or days, mtbf_h, repair_h, "
    "repair=exponential|fixed|lognormal, repair_sigma, shape (weibull), seed); 'llama3' (Llama 3's 419 "
    "interruptions / 54 days / 16,384 GPUs: keys nodes (default 2048 8-GPU nodes), days, gpus_per_node, repair_h, "
    "seed); 'paper-gcp' (24 workers over 6.3 h dipping to 15, shaped like the ReCycle paper's trace: an "
    "availability trace; keys placement=random|spread|worst (default: --placement, else random) and seed "
    "(default: --seed, else 0), e.g. paper-gcp:placement=spread,seed=0)."
)


def parse_generate_spec(spec: str, grid: WorkerGrid | None = None, placement: str = "random",
                        seed: int = 0) -> EventTrace:
    """Build a trace from a --generate SPEC string (see GENERATE_HELP). For the availability kind (paper-gcp),
    `placement` and `seed` are the defaults when the spec names none, and `grid` is the job's worker grid the
    grid-aware placements act on (default: the paper's D=6 x S=4)."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    opts: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise TraceError(f"--generate {spec!r}: {item!r} is not key=value; {GENERATE_HELP}")
        opts[key.strip().lower()] = value.strip()

    def num(key: str, default: float) -> float:
        if key not in opts:
            return default
        try:
            value = float(opts.pop(key))
        except ValueError:
            raise TraceError(f"--generate {spec!r}: {key} must be a number") from None
        if not math.isfinite(value) or abs(value) > 1e12:
            raise TraceError(f"--generate {spec!r}: {key} = {value:g} must be a finite number of sensible size")
        return value

    def whole(key: str, default: int) -> int:
        value = num(key, default)
        if value != int(value):
            raise TraceError(f"--generate {spec!r}: {key} = {value:g} must be a whole number")
        return int(value)

    if kind == "paper-gcp":
        chosen = opts.pop("placement", placement).strip().lower()
        trace = paper_gcp_shape(seed=whole("seed", seed), placement=chosen, grid=grid)
    elif kind == "llama3":
        gpn = whole("gpus_per_node", 8)
        if gpn < 1:
            raise TraceError(f"--generate {spec!r}: gpus_per_node = {gpn} must be >= 1")
        model = llama3_model(num_nodes=whole("nodes", LLAMA3_GPUS // gpn), days=num("days", LLAMA3_DAYS),
                             gpus_per_node=gpn, repair_mean_h=num("repair_h", 2.0), seed=whole("seed", 0))
        trace = generate_trace(model)
    elif kind in ("poisson", "weibull"):
        hours = num("hours", 0.0) or num("days", 0.0) * 24
        if "mtbf_h" not in opts:
            raise TraceError(f"--generate {spec!r}: give mtbf_h (per-node mean time between failures, hours)")
        model = FailureModel(num_nodes=whole("nodes", 30), duration_h=hours or 12.0, mtbf_h=num("mtbf_h", 1.0),
                             distribution="exponential" if kind == "poisson" else "weibull",
                             weibull_shape=num("shape", 0.7), repair=opts.pop("repair", "exponential"),
                             repair_mean_h=num("repair_h", 2.0), repair_sigma=num("repair_sigma", 1.0),
                             seed=whole("seed", 0))
        trace = generate_trace(model)
    else:
        raise TraceError(f"--generate {spec!r}: unknown kind {kind!r}; {GENERATE_HELP}")
    if opts:
        raise TraceError(f"--generate {spec!r}: unknown key(s) {sorted(opts)} for {kind!r}; {GENERATE_HELP}")
    return replace(trace, source=f"generated:{spec}")
