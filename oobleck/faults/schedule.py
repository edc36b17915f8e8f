"""Failure schedules: turn ``failures.*`` into a list of fault events before anything starts.

Kinds: ``none`` (the default); ``explicit`` (the ``failures.events`` list: at a step or a time,
given node ids or a count, a ``FaultKind`` action, several at once, optionally at a ``Phase`` of the
step; ``failures=demo`` is one, a removal at step 10; events are read by this kind only, and an
explicit schedule without any is refused);
``poisson`` (single-node removals with exponential gaps of mean ``failures.mtbf_s``, seeded, up to
``failures.max_events``, default one per node); ``trace`` (a node trace replayed with
``failures.seconds_per_trace_hour`` seconds per trace hour: trace node names map onto run node
ids in order of first appearance, the first ``cluster.nodes`` initial trace nodes being the run's
nodes; later additions are joins with fresh ids; removals of unmapped nodes are ignored).

A removal may come with a *preemption notice*: ``notice_s`` seconds of warning before the SIGKILL,
as spot providers give (``failures.events[].notice_s``, or ``failures.notice_s`` for every removal
of any kind; 0, the default, is a crash). A removal at a time (``time_s``, a trace's or a Poisson
process's) happens at that time and its notice comes ``notice_s`` earlier; a removal at a step
gives its notice as that step starts and happens ``notice_s`` seconds later (nobody knows ahead
when a step will start). Either way the kill follows the notice by ``notice_s``: a removal that the
schedule holds back (events apply one at a time) or that is due before its notice could have been
given (a trace's first minutes) happens that much later. ``FaultEvent.notice_s`` is a plain field: the simulator reads the same
schedule.

Everything is checked here: ``check_failures`` the section's own values (``validate`` calls it for
every entry point), ``build_schedule`` also what depends on the run (its steps and nodes, the
trace file), so a malformed schedule or trace fails before launch with one line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from oobleck.errors import ConfigError, TraceError
from oobleck.faults.kinds import FaultKind, Phase, names

log = logging.getLogger(__name__)
SCHEDULE_KINDS = ("none", "explicit", "poisson", "trace")
MS_PER_HOUR = 3_600_000.0


@dataclass(frozen=True)
class FaultEvent:
    """One scheduled change. ``nodes`` are explicit ids (for joins: the new nodes' ids)."""

    kind: FaultKind
    step: int | None = None
    time_s: float | None = None
    nodes: tuple[int, ...] | None = None
    count: int | None = None
    phase: Phase = Phase.ANY
    origin: str = ""  # where it came from, for messages (e.g. trace file:line)
    notice_s: float = 0.0  # seconds of warning before a removal (module docstring); 0: a crash

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        object.__setattr__(self, "phase", Phase(self.phase))

    @property
    def size(self) -> int:
        return len(self.nodes) if self.nodes is not None else int(self.count or 0)

    @property
    def armed(self) -> bool:
        """Struck by the node's worker inside the step (at a phase, or a raise), not by the controller."""
        return self.phase is not Phase.ANY or self.kind.in_worker

    @property
    def noticed(self) -> bool:
        """A removal announced ahead: its nodes get a preemption notice before the kill."""
        return self.notice_s > 0

    @property
    def notice_at_s(self) -> float | None:
        """Seconds of training after which a timed event is due: its notice's time (the removal's
        time less its notice), or its own time; None for an event at a step."""
        if self.time_s is None:
            return None
        return max(0.0, float(self.time_s) - self.notice_s)


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; set {key}=<one of them>")


def _event_kind(key: str, event: Any) -> FaultKind:
    _choice(f"{key}.action", event.action, names(FaultKind))
    kind = FaultKind(event.action)
    if not event.freeze:
        return kind
    if kind is not FaultKind.REMOVE:
        raise ConfigError(f"{key}.freeze=true goes with action=remove only; write action=freeze instead")
    log.warning("%s.freeze=true is deprecated; write action=freeze", key)
    return FaultKind.FREEZE


def check_failures(failures: Any) -> None:
    """The ``failures`` section's own values: kind, settings and every explicit event's fields."""
    _choice("failures.kind", failures.kind, SCHEDULE_KINDS)
    if failures.seed < 0:
        raise ConfigError(f"failures.seed={failures.seed} must be >= 0 (seeds are non-negative)")
    if not (math.isfinite(failures.mtbf_s) and failures.mtbf_s > 0):
        raise ConfigError(f"failures.mtbf_s={failures.mtbf_s} must be a finite number of seconds > 0")
    if failures.max_events is not None and failures.max_events < 1:
        raise ConfigError(f"failures.max_events={failures.max_events} must be >= 1, or null for one per node")
    if not (math.isfinite(failures.seconds_per_trace_hour) and failures.seconds_per_trace_hour > 0):
        raise ConfigError(f"failures.seconds_per_trace_hour={failures.seconds_per_trace_hour} must be > 0")
    _check_notice("failures.notice_s", failures.notice_s)
    if failures.kind == "trace" and not failures.trace:
        raise ConfigError("failures.kind=trace needs failures.trace=<file or shipped name, e.g. synthetic/10m>")
    # A trace given without failures=trace would be silently ignored (and the default schedule run).
    if failures.kind != "trace" and failures.trace:
        raise ConfigError(
            f"failures.trace={failures.trace} is read only by failures=trace, but failures.kind={failures.kind}; "
            "choose failures=trace, or drop failures.trace"
        )
    # The same for events: with no failure by default, events given alone would never fire.
    if failures.kind != "explicit" and failures.events:
        raise ConfigError(
            f"failures.events is read only by failures=explicit, but failures.kind={failures.kind}; "
            "add failures=explicit, or drop failures.events"
        )
    if failures.kind == "explicit" and not failures.events:
        raise ConfigError(
            "failures=explicit has no events: give failures.events=[{action:remove,step:10,count:1}, ...] "
            "(conf/failures/explicit.yaml), or failures=none for a run without failures"
        )
    for index, event in enumerate(failures.events):
        key = f"failures.events[{index}]"
        kind = _event_kind(key, event)
        _choice(f"{key}.phase", event.phase, names(Phase))
        if (event.step is None) == (event.time_s is None):
            raise ConfigError(f"{key} needs exactly one of step=<int> or time_s=<seconds>")
        if event.nodes is None and event.count is None:
            raise ConfigError(f"{key} needs nodes=[ids] or count=<n>")
        if event.nodes is not None and event.count is not None:
            raise ConfigError(f"{key} gives both nodes={list(event.nodes)} and count={event.count}; give one")
        if event.count is not None and event.count <= 0:
            raise ConfigError(f"{key}.count={event.count} must be > 0")
        if event.time_s is not None and not (math.isfinite(event.time_s) and event.time_s >= 0):
            raise ConfigError(f"{key}.time_s={event.time_s} must be a finite number of seconds >= 0")
        if event.phase != Phase.ANY and event.step is None:
            raise ConfigError(f"{key}.phase={event.phase} needs step=<int> (a phase is a point inside a step)")
        if kind.in_worker and event.step is None:
            raise ConfigError(
                f"{key}.action={kind}: the worker strikes inside a step; give step=<int> instead of time_s"
            )
        if event.phase != Phase.ANY and kind is FaultKind.JOIN:
            raise ConfigError(f"{key}.phase={event.phase}: a join has no phase (it starts new nodes); drop the phase")
        _check_event_notice(key, kind, event, float(failures.notice_s))


def _check_notice(key: str, value: Any) -> None:
    if value is None or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{key}={value} must be a finite number of seconds >= 0 (0: a crash without warning)")


def _check_event_notice(key: str, kind: FaultKind, event: Any, default: float) -> None:
    """A notice precedes a removal only: it is struck by the controller, at a time after the notice."""
    if event.notice_s is not None:
        _check_notice(f"{key}.notice_s", event.notice_s)
    notice = _event_notice(kind, event, default)
    if event.notice_s is not None and event.notice_s > 0 and kind is not FaultKind.REMOVE:
        what = {
            FaultKind.JOIN: "a join is no preemption",
            FaultKind.FREEZE: "a hang comes without warning",
            FaultKind.RAISE: "a worker's error comes without warning",
        }[kind]
        raise ConfigError(f"{key}.notice_s={event.notice_s}: {what}; only action=remove takes a notice_s")
    if notice > 0 and event.phase != Phase.ANY:
        source = f"{key}.notice_s={notice:g}" if event.notice_s is not None else f"failures.notice_s={notice:g}"
        raise ConfigError(
            f"{source} but {key} strikes at phase={event.phase}: a noticed removal comes notice_s seconds after "
            f"its notice, not at a point of a step; drop the phase or set {key}.notice_s=0"
        )
    if notice > 0 and event.time_s is not None and event.time_s < notice:
        raise ConfigError(
            f"{key}.time_s={event.time_s} is shorter than its notice of {notice:g} s: the notice would come before "
            f"training starts; set time_s >= {notice:g} or give the event a step"
        )


def _event_notice(kind: FaultKind, event: Any, default: float) -> float:
    """The event's notice: its own ``notice_s``, else ``failures.notice_s`` for a removal."""
    if event.notice_s is not None:
        return float(event.notice_s)
    return default if kind is FaultKind.REMOVE else 0.0


def _explicit(failures: Any, nodes: int, steps: int) -> list[FaultEvent]:
    events = []
    joins = sum(int(e.count or len(e.nodes or ())) for e in failures.events if e.action == FaultKind.JOIN)
    alive = nodes  # nodes alive when each event applies (events apply in order)
    for index, e in enumerate(failures.events):
        key = f"failures.events[{index}]"
        kind = _event_kind(key, e)
        if e.step is not None and int(e.step) < 0:
            raise ConfigError(f"{key}.step={e.step} must be >= 0 (steps count from 0)")
        if e.step is not None and int(e.step) >= steps:
            # Harmless (it never fires), and failures=demo's step 10 meets short runs such as
            # job.steps=3: said, not refused.
            log.warning(
                "%s at step %s is past the run's last step %s (job.steps=%s): it will not fire",
                key,
                e.step,
                steps - 1,
                steps,
            )
            continue
        ids = tuple(int(n) for n in e.nodes) if e.nodes is not None else None
        if ids is not None:
            limit = nodes + joins if kind.takes_nodes else None
            for n in ids:
                if n < 0 or (limit is not None and n >= limit):
                    raise ConfigError(
                        f"{key}.nodes={list(ids)} names node {n}, outside 0..{(limit or 1) - 1}; use ids of this run's nodes"
                    )
            if not kind.takes_nodes and any(n < nodes for n in ids):
                raise ConfigError(f"{key}.nodes={list(ids)}: a joining node needs a new id >= cluster.nodes={nodes}")
        count = None if e.count is None else int(e.count)
        if count is not None and kind.takes_nodes and count > alive:
            raise ConfigError(
                f"{key}.count={count} strikes more nodes than the {alive} alive then "
                f"(cluster.nodes={nodes} and the events before it); set count <= {alive}"
            )
        size = len(ids) if ids is not None else int(count or 0)
        if kind is FaultKind.JOIN:
            alive += size
        elif kind is not FaultKind.RAISE:  # a raise fails a worker; whether its node stays is the strategy's call
            alive -= size
        phase = Phase(e.phase)
        if kind.in_worker and phase is Phase.ANY:
            phase = Phase.FORWARD  # a worker strikes at a named point: "any" is the step's first
        events.append(
            FaultEvent(
                kind=kind,
                step=None if e.step is None else int(e.step),
                time_s=None if e.time_s is None else float(e.time_s),
                nodes=ids,
                count=count,
                phase=phase,
                origin=key,
                notice_s=_event_notice(kind, e, float(failures.notice_s)),
            )
        )
    return events


def _poisson(failures: Any, nodes: int) -> list[FaultEvent]:
    rng = np.random.default_rng([int(failures.seed), 5])
    limit = int(failures.max_events) if failures.max_events is not None else nodes
    times = np.cumsum(rng.exponential(float(failures.mtbf_s), size=limit))
    notice = float(failures.notice_s)
    return [
        FaultEvent(FaultKind.REMOVE, time_s=float(t), count=1, origin=f"poisson[{i}]", notice_s=notice)
        for i, t in enumerate(times)
    ]


def _trace(failures: Any, nodes: int) -> list[FaultEvent]:
    from oobleck.faults.trace import load_trace

    trace = load_trace(str(failures.trace))
    scale = float(failures.seconds_per_trace_hour)
    changes = trace.changes()
    initial = changes[0].added
    if len(initial) < nodes:
        raise TraceError(
            f"{trace.path}: starts with {len(initial)} nodes but cluster.nodes={nodes}; lower cluster.nodes"
        )
    mapping = {name: i for i, name in enumerate(initial[:nodes])}
    line_of: dict[tuple[int, str], int] = {}
    for event in trace.events:
        line_of.setdefault((event.time_ms, event.node), event.line)
    next_id = nodes
    events: list[FaultEvent] = []
    for change in changes[1:]:
        time_s = (change.time_ms - trace.start_ms) / MS_PER_HOUR * scale
        removed = tuple(mapping.pop(n) for n in change.removed if n in mapping)
        if removed:
            line = line_of.get((change.time_ms, change.removed[0]), 0)
            events.append(
                FaultEvent(
                    FaultKind.REMOVE,
                    time_s=time_s,
                    nodes=removed,
                    origin=f"{trace.path}:{line}",
                    notice_s=float(failures.notice_s),
                )
            )
        added = []
        for name in change.added:
            mapping[name] = next_id
            added.append(next_id)
            next_id += 1
        if added:
            line = line_of.get((change.time_ms, change.added[0]), 0)
            events.append(FaultEvent(FaultKind.JOIN, time_s=time_s, nodes=tuple(added), origin=f"{trace.path}:{line}"))
    return events


def build_schedule(failures: Any, *, nodes: int, steps: int) -> tuple[FaultEvent, ...]:
    """The validated schedule of ``failures`` for a run of ``nodes`` nodes and ``steps`` steps."""
    check_failures(failures)
    kind = str(failures.kind)
    if kind == "explicit":
        return tuple(_explicit(failures, nodes, steps))
    if kind == "poisson":
        return tuple(_poisson(failures, nodes))
    if kind == "trace":
        return tuple(_trace(failures, nodes))
    return ()
