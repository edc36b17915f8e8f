"""What a simulation reports: the event kinds, the tidy rows and the summary.

Events are named as the real runtime's events.csv names them (``EVENT_KIND``). Throughput counts
samples of iterations that were never rolled back; ``kept_samples`` counts those done before the
last membership change that survived it (0 after a start: the strategy kept no durable progress).
Running segments carry ``durable`` (``split_durable``): False for the stretches whose work was
later rolled back (or abandoned in flight), so a timeline can draw durable progress and discarded
work apart. ``summarize`` adds the node-seconds of ``oobleck.sim.progress.BREAKDOWN`` and their
shares, the counts of every kind of event and the recovery cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oobleck.sim.progress import BREAKDOWN, EPS
from oobleck.strategy import Kind

if TYPE_CHECKING:
    from oobleck.sim.engine import Simulator

# The event kind each decision is recorded as (the real runtime's events.csv uses the same names).
EVENT_KIND = {
    Kind.START: "start",
    Kind.RECONFIGURE: "reconfiguration",
    Kind.FAILOVER: "failover",
    Kind.REROUTE: "reroute",
    Kind.RESTART: "restart",
    Kind.STOP: "stop",
    Kind.CONTINUE: "continue",
}
# Event kinds that charge downtime (each has ``downtime_s``).
DOWNTIME_EVENTS = ("start", "reconfiguration", "failover", "reroute", "restart", "continue")
# What a strategy can do about a failure that took a working node (recorded with failure=True).
# "continue": the strategy's own workers carried on without the lost node (torchft's replicas).
REACTIONS = ("reconfiguration", "failover", "reroute", "restart", "continue", "stop", "oom")


@dataclass
class SimResult:
    """Tidy rows of one simulation: ``segments`` (throughput over time), ``events``, ``summary``."""

    segments: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any]


def split_durable(segments: list[dict[str, Any]], spans: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """``segments`` with ``durable``: running segments cut where ``spans`` (work later thrown
    away) begin and end, the pieces inside a span ``durable=False``; every other row True."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + EPS:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[dict[str, Any]] = []
    for row in segments:
        if row["phase"] != "running" or not merged:
            out.append({**row, "durable": True})
            continue
        t0, t1 = row["t_start_s"], row["t_end_s"]
        cuts = sorted({t0, t1, *(t for span in merged for t in span if t0 < t < t1)})
        for a, b in zip(cuts, cuts[1:]):
            if b - a <= EPS:
                continue
            middle = (a + b) / 2
            lost = any(start <= middle <= end for start, end in merged)
            out.append({**row, "t_start_s": a, "t_end_s": b, "durable": not lost})
    return out


def summarize(sim: Simulator) -> dict[str, Any]:
    run, ns = sim.run, sim.run.node_seconds
    duration = sim.end_s - sim.start_s
    total = sum(ns.values())
    samples = run.committed.samples
    kept = samples if sim.kept_samples is None else sim.kept_samples
    summary: dict[str, Any] = {
        **sim.labels,
        "duration_s": duration,
        "samples": samples,
        "iterations": run.committed.iters,
        "throughput": samples / duration if duration > 0 else 0.0,
        "lost_samples": run.lost_samples,
        "kept_samples": kept,
        # Only a strategy that ran can lose its progress (one that never fits is marked OOM).
        "no_durable_progress": bool(run.started and kept <= 0),
        "ran": run.started,  # False: no layout ever started (out of memory, or refused the cluster)
        "node_seconds": total,
    }
    for kind in (
        "start",
        "reconfiguration",
        "failover",
        "reroute",
        "restart",
        "continue",
        "checkpoint",
        "stop",
        "oom",
        "failure",
        "join",
    ):
        summary[f"n_{kind}"] = sim.counts.get(kind, 0)
    for key in BREAKDOWN:
        summary[f"{key}_node_s"] = ns[key]
        summary[f"{key}_fraction"] = ns[key] / total if total > 0 else 0.0
    # Out of memory only when it never ran: a strategy that could not lay the model out on the
    # first nodes and started once more joined (ReCycle needs two pipelines) started late.
    summary["oom"] = sim.counts.get("oom", 0) > 0 and not run.started
    opened = sim.opened_s if sim.opened_s is not None else sim.start_s
    summary["start_delay_s"] = sim.first_start_s - opened if sim.first_start_s is not None else math.nan
    summary.update(recovery_cycle(sim))
    return summary


def recovery_cycle(sim: Simulator) -> dict[str, float | None]:
    """How long a failure keeps the job from durable progress when it restarts: the mean
    restart a failure caused, plus one checkpoint interval of the layout it started on and
    that checkpoint's pause and write (None when no failure made it restart or it never
    checkpoints). Beyond the time between failures no checkpoint becomes durable: the cliff
    of ``oobleck.sim.ratios``."""
    reactions = [e for e in sim.events if e.get("failure") and e["kind"] in REACTIONS]
    restarts = [e["downtime_s"] for e in reactions if e["kind"] == "restart"]
    restart = sum(restarts) / len(restarts) if restarts else None
    cycle = None
    layout, interval = sim.first_layout, sim.strategy.checkpoint_every_steps
    if layout is not None and interval:
        pause, lag = sim.checkpoint_pause(layout)
        cycle = interval * layout.iteration_s + pause + lag
    total = restart + cycle if restart is not None and cycle is not None else None
    return {
        "restart_s_mean": restart,
        "checkpoint_cycle_s": cycle,
        "recovery_cycle_s": total,
        # How often a failure made it restart (Varuna: every working node lost; Bamboo: only
        # a stage and its only copy lost together).
        "restart_share": len(restarts) / len(reactions) if reactions else 0.0,
    }
