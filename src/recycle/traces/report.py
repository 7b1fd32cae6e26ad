"""Write a trace experiment's report: report.md (tables), throughput.png (all systems), summary.json (the numbers)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from recycle.fileio import atomic_write_bytes, atomic_write_text
from recycle.report.units import human_seconds, percent

from recycle.traces.jobsim import JobResult, binned, compare_series
from recycle.traces.model import CAUSES

__all__ = ["write_report", "summary_dict", "markdown_table", "best_recycle"]

RECYCLE_POLICIES = ("recycle", "recycle-plus")  # ReCycle's lines: the paper's re-routing, and ReCycle+


def best_recycle(runs: dict[str, Any]) -> str | None:
    """The ReCycle line with the highest goodput among those replayed (None if neither ran)."""
    mine = [name for name in RECYCLE_POLICIES if name in runs]
    return max(mine, key=lambda name: runs[name].goodput) if mine else None


def summary_dict(result: JobResult) -> dict[str, Any]:
    """The JSON behind the report, plus ReCycle's margin over the fault-scaled line when both ran."""
    summary = result.summary()
    runs = result.runs
    if "recycle" in runs and "fault-scaled" in runs:
        end = result.timeline.end_s
        steady_margin, steady_below = compare_series(runs["recycle"].steady, runs["fault-scaled"].steady, end)
        actual_margin, actual_below = compare_series(runs["recycle"].series, runs["fault-scaled"].series, end)
        summary["recycle_vs_fault_scaled"] = {
            "steady_worst_margin": steady_margin,  # ReCycle's running rate - fault-scaled, worst moment
            "steady_fraction_below": steady_below,
            "actual_worst_margin": actual_margin,  # including pauses and state transfers
            "actual_fraction_below": actual_below,
        }
    # ReCycle over each system, by goodput (useful work: the headline) and by mean throughput (which counts work
    # later rolled back); None where the system made no progress (its "reason" says why).
    by_goodput: dict[str, float | None] = {}
    by_mean: dict[str, float | None] = {}
    if "recycle" in runs:
        mine = runs["recycle"]
        for name, run in runs.items():
            if name != "recycle":
                by_goodput[name] = mine.goodput / run.goodput if run.goodput > 0 else None
                by_mean[name] = mine.mean_throughput / run.mean_throughput if run.mean_throughput > 0 else None
    summary["recycle_goodput_ratio_to"] = by_goodput
    summary["recycle_mean_ratio_to"] = by_mean
    if "torchft-like" in runs:
        summary["torchft_like"] = _torchft_summary(result)
    # The curves behind the plot: (time_s, samples/s) steps per system, pauses included as 0.
    summary["series"] = {name: [[t, r] for t, r in run.series] for name, run in runs.items()}
    summary["live_workers"] = [[t, len(live)] for t, live in zip(result.timeline.times_s, result.timeline.live)]
    return summary


def _torchft_summary(result: JobResult) -> dict[str, Any]:
    """torchft-like's changing global batch (it runs A x M micro-batches with A groups active) and the best ReCycle
    line's goodput over it."""
    cfg = result.context.config
    full = cfg.num_replicas * cfg.num_microbatches * cfg.workload.microbatch_size
    log = result.extra.get("torchft_groups", [])
    end = result.timeline.end_s
    area = sum(entry["active_groups"] * (min(end, log[i + 1]["time_s"] if i + 1 < len(log) else end) - entry["time_s"])
               for i, entry in enumerate(log))
    per_group = full / cfg.num_replicas
    torchft = result.runs["torchft-like"]
    best = best_recycle(result.runs)
    ratio = result.runs[best].goodput / torchft.goodput if best and torchft.goodput > 0 else None
    return {
        "global_batch_changes": True,
        "full_global_batch_samples": full,
        "mean_global_batch_samples": per_group * area / end if end > 0 and log else None,
        "smallest_global_batch_samples": per_group * min(e["active_groups"] for e in log) if log else None,
        "best_recycle": best,
        "best_recycle_goodput_ratio": ratio,
    }


def _torchft_lines(summary: dict[str, Any], result: JobResult) -> list[str]:
    """The report section saying that torchft-like's global batch changes, and by how much."""
    tf = summary.get("torchft_like")
    if not tf:
        return []
    cfg = result.context.config
    lines = [
        "## torchft-like: its global batch changes",
        "",
        f"torchft-like drops a whole replica group (one pipeline of S = {cfg.num_stages} workers) when any of its "
        "workers fails and trains on without it until the group is complete again: with A of D groups active its "
        f"global batch is A x M micro-batches, not D x M = {tf['full_global_batch_samples']} samples. Goodput counts "
        "samples, so it compares with the fixed-batch systems in work done, but the optimizer sees a smaller batch "
        "while groups are out. Model parameters and their sources: docs/traces.md.",
        "",
    ]
    if tf["mean_global_batch_samples"] is not None:
        lines.append(f"- global batch: {tf['full_global_batch_samples']} samples with every group, "
                     f"{tf['mean_global_batch_samples']:.1f} on average over the trace, "
                     f"{tf['smallest_global_batch_samples']:.0f} at its smallest")
    if tf["best_recycle"] is not None:
        ratio = tf["best_recycle_goodput_ratio"]
        label = result.runs[tf["best_recycle"]].label
        lines.append(f"- best ReCycle line ({label}) / torchft-like by goodput: "
                     + (f"{ratio:.2f}x" if ratio is not None else "n/a (torchft-like made no progress)"))
    return lines + [""]


def _ratio(name: str, ratios: dict[str, float | None], run: Any) -> str:
    if name == "recycle":
        return "-"
    ratio = ratios.get(name)
    return f"{ratio:.2f}x" if ratio is not None else "n/a (no progress)"


def _margin(worst: float, fraction_below: float, end_s: float) -> str:
    """The worst gap to the fault-scaled line and the time spent below it, in words that match the sign."""
    if worst >= 0:
        return f"never below the line (closest margin {worst:+.3f} samples/s)"
    if fraction_below <= 0:
        return f"below the line only at isolated instants (no measurable time), at worst by {-worst:.3f} samples/s"
    return (f"below the line for {human_seconds(fraction_below * end_s)} ({percent(fraction_below)} of the time), "
            f"at worst by {-worst:.3f} samples/s")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _plot(result: JobResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end_h = result.timeline.end_s / 3600.0
    # Average over bins (as measured throughput curves are): a 10 s pause would otherwise be a line to zero.
    bin_s = max(60.0, result.timeline.end_s / 400)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, run in result.runs.items():
        points = binned(run.series, result.timeline.end_s, bin_s)
        xs = [t / 3600.0 for t, _ in points] + [end_h]
        ys = [r for _, r in points] + [points[-1][1] if points else 0.0]
        style = {"fault-free": ":", "fault-scaled": "--"}.get(name, "-")
        ax.step(xs, ys, where="post", linestyle=style, linewidth=1.2, label=run.label)
    ax.set_ylabel(f"throughput (samples/s, {bin_s / 60:.0f}-min mean)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    times = [t / 3600.0 for t in result.timeline.times_s] + [end_h]
    live = [len(s) for s in result.timeline.live]
    ax2.step(times, live + [live[-1]], where="post", color="black", linewidth=1)
    ax2.axhline(result.context.num_workers, color="grey", linestyle=":", linewidth=1)
    ax2.set_ylabel("live workers")
    ax2.set_xlabel("time (h)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def write_report(result: JobResult, out_dir: str | Path, title: str = "Trace replay") -> dict[str, Any]:
    """Write report.md, throughput.png and summary.json into `out_dir`; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_dict(result)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    _plot(result, out / "throughput.png", title)
    extra = result.extra
    lines = [
        *_job_lines(result, title),
        "",
        "Baselines are models, not the real systems; their assumptions are in docs/traces.md.",
        "goodput = useful samples (rolled-back work excluded) / (duration x fault-free rate): the headline; mean "
        "throughput = time-average of the plotted rate, which also counts work that was later rolled back.",
        "",
        "![throughput over time](throughput.png)",
        "",
        *_system_tables(result, summary),
        *_fault_scaled_lines(summary.get("recycle_vs_fault_scaled"), result.timeline.end_s),
        *_torchft_lines(summary, result),
        *policy_lines(extra.get("recycle_policy", []), result.timeline.end_s),
        *plus_lines(extra.get("recycle_plus_policy", []), extra.get("partitions", []), result),
    ]
    atomic_write_text(out / "report.md", "\n".join(lines))
    return summary


def _job_lines(result: JobResult, title: str) -> list[str]:
    """The title and what was replayed: the job, the trace (and its notes), the throughput model."""
    extra = result.extra
    lines = [
        f"# {title}",
        "",
        f"- config: `{extra.get('config', result.context.config.name)}` (D={result.context.config.num_replicas}, "
        f"S={result.context.config.num_stages}, {result.context.num_workers} workers)",
        f"- trace: `{extra.get('trace', result.timeline.source)}`, {result.timeline.end_s / 3600:.2f} h, "
        f"{len(result.timeline.times_s) - 1} change(s), {result.timeline.mean_live():.2f} live worker units on "
        "average",
        f"- ReCycle throughput per failure state: {extra.get('period_model', '?')}; "
        f"{extra.get('keys_planned', '?')} normalized state(s) planned; fault-free reference: "
        f"{extra.get('reference', '?')}",
        f"- fault-free throughput: {result.fault_free_rate:.3f} samples/s",
    ]
    cache = extra.get("plan_cache")
    if cache:
        where = f"`{cache['folder']}`" if cache.get("folder") else "this run only (--no-plan-cache)"
        lines.append(f"- plan cache {where}: {cache['hits']} plan(s) and partition choice(s) read and validated, "
                     f"{cache['misses']} planned, {cache['rejected']} entry(ies) rejected and rebuilt")
        lines += [f"- plan cache: {reason}" for reason in cache.get("reasons", [])]
    return lines + [f"- trace note: {note}" for note in extra.get("trace_notes", [])]


def _system_tables(result: JobResult, summary: dict[str, Any]) -> list[str]:
    """Per system: throughput and goodput (with ReCycle's ratios), then the time lost by cause."""
    ff = result.fault_free_rate
    rows = []
    reasons = []
    for name, run in result.runs.items():
        if run.unable_reason:
            reasons.append(f"- {run.label}: {run.unable_reason}")
        rows.append([run.label, f"{run.goodput:.1%}", _ratio(name, summary["recycle_goodput_ratio_to"], run),
                     f"{run.mean_throughput:.3f}", f"{run.mean_throughput / ff:.1%}" if ff else "-",
                     _ratio(name, summary["recycle_mean_ratio_to"], run), str(run.rollbacks)])
    lost_rows = [[run.label] + [f"{run.lost_s.get(c, 0.0) / 3600:.2f}" for c in CAUSES]
                 for run in result.runs.values()]
    return [
        "## Average throughput and goodput",
        "",
        markdown_table(["system", "goodput", "ReCycle / system (goodput)", "mean throughput (samples/s)",
                        "mean of fault-free", "ReCycle / system (mean)", "rollbacks"], rows),
        "",
        *([*reasons, ""] if reasons else []),
        "## Time lost by cause (fault-free-equivalent hours)",
        "",
        markdown_table(["system", *CAUSES], lost_rows),
        "",
    ]


def _fault_scaled_lines(cmp: dict[str, Any] | None, end: float) -> list[str]:
    """How often and by how much ReCycle's rate fell below the fault-scaled line (nothing without that line)."""
    if not cmp:
        return []
    return [
        "## ReCycle against the fault-scaled line",
        "",
        "- running rate (pauses excluded): "
        f"{_margin(cmp['steady_worst_margin'], cmp['steady_fraction_below'], end)}",
        f"- actual rate (detection, plan switches and state transfers included): "
        f"{_margin(cmp['actual_worst_margin'], cmp['actual_fraction_below'], end)}",
        "",
    ]


def plus_lines(log: list[dict[str, Any]], partitions: list[dict[str, Any]], result: JobResult) -> list[str]:
    """ReCycle+'s decisions (with their predicted gains) and, per failure state it planned, the period of
    re-routing alone vs re-partitioned vs the ideal live-proportional period."""
    if not log and not partitions:
        return []
    unit = result.context.config.time_unit
    scale = 1e-6 if unit == "us" else result.context.seconds_per_unit
    rows = [[str(tuple(p["key"])), "/".join(map(str, p["partition"])), f"{p['configured_period'] * scale:.3f}",
             f"{p['period'] * scale:.3f}", f"{p['ideal_period'] * scale:.3f}",
             f"{p['configured_period'] / p['period']:.3f}x"] for p in partitions]
    lines = [
        "## ReCycle+ (layer re-partitioning)",
        "",
        "Per failure state planned: period (s) of re-routing alone on the configured layers, with the layers "
        "re-partitioned, and the ideal live-proportional period (every live worker's busy time shared evenly; the "
        "first two are capped at the 1F1B period under the paper's reference, the ideal is not).",
        "",
        markdown_table(["key", "layers per stage", "re-routing", "re-partitioned", "ideal", "speed-up"], rows),
        "",
        "ReCycle+'s policies, besides ReCycle's: repartition = layers moved (its predicted gain over the expected "
        "state duration repays the migration pause); re-route = kept re-routing alone (it did not); layers back = "
        "every worker returned, configured layers restored; re-route (layers moved) = re-routing on a "
        "re-partitioned layout.",
        "",
    ]
    return lines + policy_lines(log, result.timeline.end_s, title="ReCycle+ policy over time") + decision_lines(log)


PLUS_DECISIONS = ("repartition", "re-route", "layers back")  # ReCycle+'s choices about layers (the rest: ReCycle's)


def decision_lines(log: list[dict[str, Any]]) -> list[str]:
    """Every ReCycle+ layer decision, with its rates, pause and predicted gain (`recycle simulate` keeps stdout to
    the summary and points here)."""
    decisions = [e for e in log if e["policy"] in PLUS_DECISIONS]
    if not decisions:
        return []
    return [
        f"### ReCycle+ layer decisions ({len(decisions)})",
        "",
        markdown_table(["at (s)", "decision", "detail"],
                       [[f"{e['time_s']:.0f}", e["policy"], e["detail"]] for e in decisions]),
        "",
    ]


def policy_lines(log: list[dict[str, Any]], end_s: float, limit: int = 40,
                 title: str = "ReCycle policy over time") -> list[str]:
    """The report section saying which ReCycle policy ran when: hours per policy and the switches."""
    if not log:
        return []
    hours: dict[str, float] = {}
    for i, entry in enumerate(log):
        stop = log[i + 1]["time_s"] if i + 1 < len(log) else end_s
        hours[entry["policy"]] = hours.get(entry["policy"], 0.0) + max(0.0, stop - entry["time_s"]) / 3600
    rows = [[f"{e['time_s']:.0f}", e["policy"], e["detail"]] for e in log[:limit]]
    lines = [
        f"## {title}",
        "",
        "adapt = re-route on the D x S grid; reshape = D' = live // S full pipelines plus re-routed leftovers (state "
        "copied from live peers, no rollback); restore = from the checkpoint after a stage lost every replica; "
        "down = fewer live workers than stages.",
        "",
        "- hours per policy: " + ", ".join(f"{name} {h:.2f}" for name, h in hours.items()),
        "",
        markdown_table(["from (s)", "policy", "detail"], rows),
    ]
    if len(log) > limit:
        lines.append(f"... and {len(log) - limit} more switches (summary.json has them all)")
    lines.append("")
    return lines
