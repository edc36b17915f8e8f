"""REFERENCE (not used by the package): ``oobleck.schedules.recycle.rerouted_orders`` written the
plain way, offering every free slot a task in every pass. The package offers only the slots whose
pick can have changed; the tests compare its orders with these on many plans and the two must agree
exactly (same tasks, same order, every slot), so keep this copy as it is: it is the specification
of the greedy list scheduler's output (the package's module docstring says what the priorities are).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from oobleck.errors import PlanningError
from oobleck.schedules.lower import Slot, Task
from oobleck.schedules.ops import OpKind
from oobleck.schedules.recycle import task_seconds  # the inputs: the same for both loops
from oobleck.schedules.routes import Routes

F, I, W, B = OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT, OpKind.BACKWARD


@dataclass(frozen=True)
class _Need:
    """What a task of a slot waits for: the task (kind, microbatch, slot) whose end makes its input
    (None: none, a first stage's forward), and the channel its message arrives on."""

    after: tuple[OpKind, int, Slot] | None
    channel: tuple[Slot, Slot, OpKind] | None
    sends: tuple[Slot, Slot, OpKind] | None  # the channel this task's own output leaves on


@dataclass
class _SlotState:
    slot: Slot
    limit: int  # microbatches that may be in flight (forward done, input gradient not)
    seconds: dict[OpKind, float]
    remaining: int = 0
    # Tasks whose input is (or will be) there, with when: kind -> [(ready at, microbatch, task)],
    # each list sorted (a slot sees a microbatch's task of one kind once, so the order is total).
    eligible: dict[OpKind, list[tuple[float, int, Task]]] = field(default_factory=lambda: {F: [], I: [], W: []})
    order: list[Task] = field(default_factory=list)
    free_at: float = 0.0
    in_flight: int = 0
    deferred: int = 0  # W tasks whose I ran


def rerouted_orders(routes: Routes, split: bool = True) -> dict[Slot, list[Task]]:
    """Every slot's compute order, list-scheduled (see the module docstring): F, I and W tasks, or
    with ``split`` false F and whole-backward B tasks (ReCycle without decoupled back-propagation,
    to measure what the split buys)."""
    states: dict[Slot, _SlotState] = {
        slot: _SlotState(slot, 0, task_seconds(routes, slot)) for slot in sorted(routes.slots)
    }
    backward = I if split else B
    needs: dict[tuple[Slot, Task], _Need] = {}
    waiting: dict[tuple[OpKind, int, Slot], list[tuple[Slot, Task]]] = {}  # a task's end -> who it unblocks
    for route in routes.routes:
        mb, hops = route.microbatch, route.hops
        slots = [(hop.pipeline, hop.stage) for hop in hops]
        for at, slot in enumerate(slots):
            state = states[slot]
            state.limit = max(state.limit, len(hops) - at)
            before = slots[at - 1] if at > 0 else None
            after = slots[at + 1] if at < len(hops) - 1 else None
            kinds = {
                F: _Need(
                    (F, mb, before) if before else None,
                    (before, slot, F) if before else None,
                    (slot, after, F) if after else None,
                ),
                backward: _Need(
                    (I, mb, after) if after else (F, mb, slot),
                    (after, slot, I) if after else None,
                    (slot, before, I) if before else None,
                ),
            }
            if split:
                kinds[W] = _Need((I, mb, slot), None, None)
            for kind, need in kinds.items():
                task = Task(kind, mb)
                needs[(slot, task)] = need
                state.remaining += 1
                if need.after is None:
                    bisect.insort(state.eligible[F], (0.0, mb, task))
                else:
                    waiting.setdefault(need.after, []).append((slot, task))
    channels: dict[tuple[Slot, Slot, OpKind], list[int]] = {}  # sent, not yet consumed, in order
    events: list[float] = []  # end times of started tasks (a heap): when something may change
    relaxed = False
    now = 0.0
    while any(state.remaining for state in states.values()):
        started = False
        for state in states.values():
            if state.free_at > now or not state.remaining:
                continue
            picked = _pick(state, now, needs, channels, relaxed)
            if picked is None:
                continue
            end = _start(state, picked, now, needs[(state.slot, picked)], channels)
            heapq.heappush(events, end)
            # a B gives the input gradient
            produced = (I if picked.kind is B else picked.kind, picked.microbatch, state.slot)
            for slot, unblocked in waiting.pop(produced, []):
                kind = I if unblocked.kind is B else unblocked.kind
                bisect.insort(states[slot].eligible[kind], (end, unblocked.microbatch, unblocked))
            started = True
        if started:
            continue
        while events and events[0] <= now:
            heapq.heappop(events)
        if events:
            now = heapq.heappop(events)
        elif not relaxed:
            relaxed = True  # in-flight limits held every slot: let forwards run past them
        else:
            stuck = {s.slot: s.remaining for s in states.values() if s.remaining}
            raise PlanningError(f"the re-routed schedule cannot be ordered; tasks left per (pipeline, stage): {stuck}")
    return {slot: state.order for slot, state in states.items()}


def _pick(
    state: _SlotState, now: float, needs: dict[tuple[Slot, Task], _Need], channels: dict, relaxed: bool
) -> Task | None:
    """The slot's next task at ``now`` by the priorities of the module docstring, or None."""

    def best(kind: OpKind) -> tuple[float, int, Task] | None:
        """The earliest-ready, then lowest-microbatch task of ``kind`` that can start now."""
        for entry in state.eligible[kind]:  # sorted: the first that can start is the best
            if entry[0] > now:
                return None
            channel = needs[(state.slot, entry[2])].channel
            if channel is not None:
                queue = channels.get(channel)
                if not queue or queue[0] != entry[1]:
                    continue  # not the oldest message on its channel
            return entry
        return None

    inputs = best(I)
    if inputs is not None:
        return _take(state, I, inputs)
    limit = math.inf if relaxed else state.limit
    forward = best(F) if state.in_flight < limit else None
    weights = best(W)
    if weights is not None and (state.deferred >= state.limit or forward is None):
        return _take(state, W, weights)
    if forward is not None:
        return _take(state, F, forward)
    return None


def _take(state: _SlotState, kind: OpKind, entry: tuple[float, int, Task]) -> Task:
    entries = state.eligible[kind]
    del entries[bisect.bisect_left(entries, entry)]
    return entry[2]


def _start(state: _SlotState, task: Task, now: float, need: _Need, channels: dict) -> float:
    """Start ``task`` at ``now``; returns when it ends."""
    state.remaining -= 1
    state.order.append(task)
    end = now + state.seconds[task.kind]
    state.free_at = end
    if need.channel is not None:
        channels[need.channel].pop(0)
    if need.sends is not None:
        channels.setdefault(need.sends, []).append(task.microbatch)
    if task.kind is F:
        state.in_flight += 1
    elif task.kind in (I, B):
        state.in_flight -= 1
        state.deferred += task.kind is I
    else:
        state.deferred -= 1
    return end
