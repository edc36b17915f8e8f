"""When the nodes of a trace become usable: instance creation delays every addition.

A node the trace adds becomes usable ``node_creation_s`` later (the time to create its instance),
the nodes the trace starts with included, so a job starts only once its nodes exist; a node
removed before then never joins. ``delayed_changes`` is the trace as the simulator replays it.
"""

from __future__ import annotations

from collections.abc import Mapping

from oobleck.faults.trace import Trace, TraceChange


def delayed_changes(trace: Trace, node_creation_s: float) -> list[TraceChange]:
    """The trace's changes with every addition taking effect ``node_creation_s`` later.

    A node removed before its addition took effect never joins (both are dropped); a name that
    leaves and comes back is a new instance (``name#k`` for its k-th arrival after the first).
    """
    changes = trace.changes()
    if node_creation_s <= 0:
        return list(changes)
    delay_ms = round(node_creation_s * 1000)
    arrivals: dict[str, int] = {}
    effective: dict[str, int] = {}  # instance name -> time its addition takes effect
    events: dict[int, tuple[list[str], list[str]]] = {}
    for change in changes:
        for name in change.removed:
            instance = _instance(name, arrivals)
            if effective.get(instance, -1) >= change.time_ms:
                adds = events[effective.pop(instance)][0]
                adds.remove(instance)  # it never became usable
                continue
            effective.pop(instance, None)
            events.setdefault(change.time_ms, ([], []))[1].append(instance)
        for name in change.added:
            arrivals[name] = arrivals.get(name, -1) + 1
            instance = _instance(name, arrivals)
            effective[instance] = change.time_ms + delay_ms
            events.setdefault(change.time_ms + delay_ms, ([], []))[0].append(instance)
    return [TraceChange(t, tuple(a), tuple(r)) for t, (a, r) in sorted(events.items()) if a or r]


def _instance(name: str, arrivals: Mapping[str, int]) -> str:
    count = arrivals.get(name, 0)
    return name if count <= 0 else f"{name}#{count}"
