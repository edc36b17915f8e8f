"""Node-availability traces: parsing, validation and name resolution.

A trace is a CSV file, one event per line, ``time_ms,add|remove,node_name`` with no header, times
in milliseconds from the start of the trace and non-decreasing. The events at the first
timestamp form the initial cluster. Blank lines and lines starting with ``#`` are ignored.

``load_trace("synthetic/10m")`` resolves a shipped name to ``oobleck/faults/traces/synthetic/10m.csv``
(the README there gives provenance); any other argument is a file path. Every malformed input
raises ``TraceError`` naming the file and the line. Both the real runtime (trace replay) and the
simulator read traces only through this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from oobleck.errors import TraceError
from oobleck.faults.kinds import FaultKind

TRACES_DIR = Path(__file__).resolve().parent / "traces"
# The file format's words (the Oobleck artifact's traces) for the shared failure vocabulary.
TRACE_WORDS = {"add": FaultKind.JOIN, "remove": FaultKind.REMOVE}


@dataclass(frozen=True)
class TraceEvent:
    """One membership change: ``node`` joins or is removed at ``time_ms``."""

    time_ms: int
    kind: FaultKind  # JOIN (the file's "add") | REMOVE
    node: str
    line: int  # 1-based line in the source file (for error messages downstream)

    @property
    def time_s(self) -> float:
        return self.time_ms / 1000.0


@dataclass(frozen=True)
class TraceChange:
    """All events of one timestamp, applied together: a simultaneous membership change."""

    time_ms: int
    added: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def time_s(self) -> float:
        return self.time_ms / 1000.0


@dataclass(frozen=True)
class Trace:
    """A validated trace: events in file order (sorted by time)."""

    name: str
    path: Path
    events: tuple[TraceEvent, ...]

    @property
    def start_ms(self) -> int:
        return self.events[0].time_ms

    @property
    def end_ms(self) -> int:
        """Time of the last event."""
        return self.events[-1].time_ms

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node name that appears, in order of first appearance."""
        return tuple(dict.fromkeys(event.node for event in self.events))

    def changes(self) -> tuple[TraceChange, ...]:
        """Events grouped by timestamp (one change per distinct time), as net effects.

        A node added and removed again at the same timestamp never joins (the change drops both);
        a node removed and added again at the same timestamp appears in both ``removed`` and
        ``added`` (a fresh instance replaces it). Apply ``removed`` first, then ``added``.
        """
        grouped: dict[int, tuple[list[str], list[str]]] = {}
        for event in self.events:
            added, removed = grouped.setdefault(event.time_ms, ([], []))
            if event.kind is FaultKind.JOIN:
                added.append(event.node)
            elif event.node in added:
                added.remove(event.node)  # came and went within one instant
            else:
                removed.append(event.node)
        return tuple(TraceChange(t, tuple(a), tuple(r)) for t, (a, r) in grouped.items() if a or r)

    def initial_nodes(self) -> tuple[str, ...]:
        """The nodes added at the first timestamp: the cluster the run starts with."""
        return self.changes()[0].added

    def membership(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """``(time_ms, live nodes after the change)`` for every change, live nodes in arrival order."""
        live: dict[str, None] = {}
        for change in self.changes():
            for node in change.removed:
                live.pop(node, None)
            for node in change.added:
                live[node] = None
            yield change.time_ms, tuple(live)

    def max_nodes(self) -> int:
        return max(len(nodes) for _, nodes in self.membership())

    def removals(self) -> int:
        return sum(1 for event in self.events if event.kind is FaultKind.REMOVE)

    def additions(self) -> int:
        return sum(1 for event in self.events if event.kind is FaultKind.JOIN)


def shipped_traces() -> tuple[str, ...]:
    """Names accepted by ``load_trace`` without a path, e.g. ``synthetic/10m``."""
    return tuple(sorted(str(p.relative_to(TRACES_DIR).with_suffix("")) for p in TRACES_DIR.rglob("*.csv")))


def resolve_trace(name_or_path: str | Path) -> Path:
    """A shipped trace name (``synthetic/10m``, with or without ``.csv``) or an existing file path."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate
    text = str(name_or_path)
    for shipped in (TRACES_DIR / text, TRACES_DIR / f"{text}.csv"):
        if shipped.is_file():
            return shipped
    raise TraceError(
        f"trace {text!r} is neither a file nor a shipped trace; use a path to a "
        f"time_ms,add|remove,node CSV or one of: {', '.join(shipped_traces())}"
    )


def parse_trace(text: str, *, origin: str = "<trace>", name: str | None = None, path: Path | None = None) -> Trace:
    """Parse and validate trace text; ``origin`` names the file in error messages."""
    events: list[TraceEvent] = []
    live: set[str] = set()
    previous_ms = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{origin}:{number}"
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            raise TraceError(f"{where}: expected 'time_ms,add|remove,node_name', got {raw!r} ({len(fields)} fields)")
        time_text, action, node = fields
        try:
            time_ms = int(time_text)
        except ValueError:
            raise TraceError(f"{where}: time {time_text!r} is not an integer number of milliseconds") from None
        if time_ms < 0:
            raise TraceError(f"{where}: time {time_ms} ms is negative; times count from the start of the trace")
        if time_ms < previous_ms:
            raise TraceError(
                f"{where}: time {time_ms} ms is earlier than the previous event ({previous_ms} ms); sort the trace by time"
            )
        if action not in TRACE_WORDS:
            raise TraceError(f"{where}: action {action!r} must be 'add' or 'remove'")
        kind = TRACE_WORDS[action]
        if not node:
            raise TraceError(f"{where}: empty node name")
        if kind is FaultKind.JOIN and node in live:
            raise TraceError(f"{where}: node {node!r} is added while already present; remove it first")
        if kind is FaultKind.REMOVE and node not in live:
            raise TraceError(f"{where}: node {node!r} is removed but is not present at {time_ms} ms")
        (live.add if kind is FaultKind.JOIN else live.discard)(node)
        events.append(TraceEvent(time_ms=time_ms, kind=kind, node=node, line=number))
        previous_ms = time_ms
    if not events:
        raise TraceError(f"{origin}: the trace has no events; add lines 'time_ms,add,node_name'")
    return Trace(name=name or origin, path=path or Path(origin), events=tuple(events))


def load_trace(name_or_path: str | Path) -> Trace:
    """Load a shipped trace by name (``synthetic/10m``) or a trace file by path; validate it."""
    path = resolve_trace(name_or_path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"{path}: cannot read the trace ({error})") from None
    try:
        name = str(path.resolve().relative_to(TRACES_DIR).with_suffix(""))
    except ValueError:
        name = path.stem
    return parse_trace(text, origin=str(path), name=name, path=path)
