"""Failure schedules: turn ``failures.*`` into a list of fault events before anything starts.

Kinds: ``none``; ``explicit`` (the ``failures.events`` list: at a step or a time, given node ids
or a count, remove / join / raise, several at once, optionally at a phase of the step);
``poisson`` (single-node removals with exponential gaps of mean ``failures.mtbf_s``, seeded, up to
``failures.max_events``, default one per node); ``trace`` (a node trace replayed with
``failures.seconds_per_trace_hour`` seconds per trace hour: trace node names map onto run node
ids in order of first appearance, the first ``cluster.nodes`` initial trace nodes being the run's
nodes; later additions are joins with fresh ids; removals of unmapped nodes are ignored).
Everything is checked here, so a malformed schedule or trace fails before launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from oobleck.errors import ConfigError, TraceError

STEP_PHASES = ("any", "forward", "backward", "allreduce", "optimizer", "reconfigure")
MS_PER_HOUR = 3_600_000.0


@dataclass(frozen=True)
class FaultEvent:
    """One scheduled change. ``nodes`` are explicit ids (for joins: the new nodes' ids)."""

    action: str  # remove | join | raise
    step: Optional[int] = None
    time_s: Optional[float] = None
    nodes: Optional[tuple[int, ...]] = None
    count: Optional[int] = None
    phase: str = "any"
    freeze: bool = False
    origin: str = ""  # where it came from, for messages (e.g. trace file:line)

    @property
    def size(self) -> int:
        return len(self.nodes) if self.nodes is not None else int(self.count or 0)


def _explicit(failures: Any, nodes: int, steps: int) -> list[FaultEvent]:
    events = []
    joins = sum(int(e.count or len(e.nodes or ())) for e in failures.events if e.action == "join")
    for index, e in enumerate(failures.events):
        key = f"failures.events[{index}]"
        if e.step is not None and not 0 <= int(e.step) < steps:
            raise ConfigError(f"{key}.step={e.step} is outside the run's steps 0..{steps - 1}; set a step < job.steps={steps}")
        if e.time_s is not None and float(e.time_s) < 0:
            raise ConfigError(f"{key}.time_s={e.time_s} must be >= 0")
        if e.phase != "any" and e.step is None:
            raise ConfigError(f"{key}.phase={e.phase} needs step=<int> (a phase is a point inside a step)")
        if e.count is not None and int(e.count) <= 0:
            raise ConfigError(f"{key}.count={e.count} must be > 0")
        ids = tuple(int(n) for n in e.nodes) if e.nodes is not None else None
        if ids is not None:
            limit = nodes + joins if e.action != "join" else None
            for n in ids:
                if n < 0 or (limit is not None and n >= limit):
                    raise ConfigError(f"{key}.nodes={list(ids)} names node {n}, outside 0..{(limit or 1) - 1}; use ids of this run's nodes")
            if e.action == "join" and any(n < nodes for n in ids):
                raise ConfigError(f"{key}.nodes={list(ids)}: a joining node needs a new id >= cluster.nodes={nodes}")
        events.append(
            FaultEvent(
                action=str(e.action),
                step=None if e.step is None else int(e.step),
                time_s=None if e.time_s is None else float(e.time_s),
                nodes=ids,
                count=None if e.count is None else int(e.count),
                phase=str(e.phase),
                freeze=bool(e.freeze),
                origin=key,
            )
        )
    return events


def _poisson(failures: Any, nodes: int) -> list[FaultEvent]:
    rng = np.random.default_rng([int(failures.seed), 5])
    limit = int(failures.max_events) if failures.max_events is not None else nodes
    times = np.cumsum(rng.exponential(float(failures.mtbf_s), size=limit))
    return [FaultEvent(action="remove", time_s=float(t), count=1, origin=f"poisson[{i}]") for i, t in enumerate(times)]


def _trace(failures: Any, nodes: int) -> list[FaultEvent]:
    from oobleck.faults.trace import load_trace

    trace = load_trace(str(failures.trace))
    scale = float(failures.seconds_per_trace_hour)
    if scale <= 0:
        raise ConfigError(f"failures.seconds_per_trace_hour={scale} must be > 0")
    changes = trace.changes()
    initial = changes[0].added
    if len(initial) < nodes:
        raise TraceError(f"{trace.path}: starts with {len(initial)} nodes but cluster.nodes={nodes}; lower cluster.nodes")
    mapping = {name: i for i, name in enumerate(initial[:nodes])}
    line_of = {}
    for event in trace.events:
        line_of.setdefault((event.time_ms, event.node), event.line)
    next_id = nodes
    events: list[FaultEvent] = []
    for change in changes[1:]:
        time_s = (change.time_ms - trace.start_ms) / MS_PER_HOUR * scale
        removed = tuple(mapping.pop(n) for n in change.removed if n in mapping)
        if removed:
            line = line_of.get((change.time_ms, change.removed[0]), 0)
            events.append(FaultEvent(action="remove", time_s=time_s, nodes=removed, origin=f"{trace.path}:{line}"))
        added = []
        for name in change.added:
            mapping[name] = next_id
            added.append(next_id)
            next_id += 1
        if added:
            line = line_of.get((change.time_ms, change.added[0]), 0)
            events.append(FaultEvent(action="join", time_s=time_s, nodes=tuple(added), origin=f"{trace.path}:{line}"))
    return events


def build_schedule(failures: Any, *, nodes: int, steps: int) -> tuple[FaultEvent, ...]:
    """The validated schedule of ``failures`` for a run of ``nodes`` nodes and ``steps`` steps."""
    kind = str(failures.kind)
    if kind == "none":
        return ()
    if kind == "explicit":
        return tuple(_explicit(failures, nodes, steps))
    if kind == "poisson":
        if float(failures.mtbf_s) <= 0:
            raise ConfigError(f"failures.mtbf_s={failures.mtbf_s} must be > 0")
        return tuple(_poisson(failures, nodes))
    if kind == "trace":
        if not failures.trace:
            raise ConfigError("failures.kind=trace needs failures.trace=<file or shipped name, e.g. synthetic/10m>")
        return tuple(_trace(failures, nodes))
    raise ConfigError(f"failures.kind={kind!r} is not one of none, explicit, poisson, trace")
