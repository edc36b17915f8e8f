"""ReCycle-style re-routed schedules (Gandhi et al., SOSP'24, first titled "SlipStream").

When the node of stage s of pipeline p is lost, ReCycle's *adaptive pipelining* sends p's
microbatches for stage s through stage s of the peer pipelines, which hold the same layers
(``ExecutionPlan.reroutes``; ``oobleck.schedules.routes``). The peers then have more work than
their bubbles used to hold, so ReCycle *decouples back-propagation*: each backward is split into
the input gradient (I, on the critical path: the previous stage waits for it) and the weight
gradient (W, needed only by the step's gradient reduction), and W passes are deferred into the
bubbles. ReCycle plans the adapted schedule with an MILP; this generator list-schedules it
greedily instead (deterministic, so every rank derives the same lists from the plan):

- every stage slot runs its tasks (F, I and W of each microbatch whose route passes it) as soon
  as their inputs are there, preferring an I (it unblocks the previous stage), then an F while
  fewer microbatches are in flight than 1F1B would hold there (the slot's remaining hops), then
  the oldest deferred W; a W goes before a new F once as many W's wait as microbatches may be in
  flight (their saved activations bound memory as 1F1B's do);
- task times come from the plan's templates: a stage's ``w`` split as the cost model splits it,
  a third forward (``DEFAULT_FORWARD_FRACTION``), the backward halved between I and W
  (``DEFAULT_BACKWARD_INPUT_FRACTION``); the first stage's input is token ids, so its I does
  nothing and its W is the whole backward (torch's ``PipelineStage.backward_weight_one_chunk``
  does the same for stage 0);
- each slot-to-slot channel keeps its messages in order: a task is ready only when the message
  it consumes is the oldest unconsumed one on its channel (the runtime's channels are FIFO).

Not done: ReCycle's staggered optimizer step (steps stay synchronous here: global-norm clipping
needs every stage's gradients first), its failure normalisation over several failures, and
heterogeneous templates (a re-routed range must be exactly one peer stage; a heterogeneous peer
would need the range split over several of its stages, each hop a partial range, which
``oobleck.schedules.routes`` refuses with that reason).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from oobleck.errors import PlanningError
from oobleck.planning.inputs import DEFAULT_BACKWARD_INPUT_FRACTION
from oobleck.planning.pipeline_cost import DEFAULT_FORWARD_FRACTION
from oobleck.schedules.lower import Slot, Task, position
from oobleck.schedules.ops import OpKind
from oobleck.schedules.routes import Routes

F, I, W, B = OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT, OpKind.BACKWARD


@dataclass
class _SlotState:
    slot: Slot
    limit: int  # microbatches that may be in flight (forward done, input gradient not)
    seconds: dict[OpKind, float]
    pending: list[Task] = field(default_factory=list)
    order: list[Task] = field(default_factory=list)
    free_at: float = 0.0
    in_flight: int = 0
    deferred: int = 0  # W tasks whose I ran


def task_seconds(routes: Routes, slot: Slot) -> dict[OpKind, float]:
    """F, I, W (and whole-backward B) seconds per microbatch of ``slot`` (see the module docstring)."""
    pipeline = next(p for p in routes.plan.pipelines if p.index == slot[0])
    w = float(pipeline.template.stage_seconds[slot[1]])
    forward = w * DEFAULT_FORWARD_FRACTION
    backward = w - forward
    inputs = 0.0 if routes.slots[slot].start == 0 else backward * DEFAULT_BACKWARD_INPUT_FRACTION
    return {F: forward, I: inputs, W: backward - inputs, B: backward}


def rerouted_orders(routes: Routes, split: bool = True) -> dict[Slot, list[Task]]:
    """Every slot's compute order, list-scheduled (see the module docstring): F, I and W tasks, or
    with ``split`` false F and whole-backward B tasks (ReCycle without decoupled back-propagation,
    to measure what the split buys)."""
    states: dict[Slot, _SlotState] = {}
    for slot in sorted(routes.slots):
        states[slot] = _SlotState(slot, 0, task_seconds(routes, slot))
    backward = (I, W) if split else (B,)
    for route in routes.routes:
        for index, hop in enumerate(route.hops):
            state = states[(hop.pipeline, hop.stage)]
            state.limit = max(state.limit, len(route.hops) - index)
            state.pending += [Task(kind, route.microbatch) for kind in (F, *backward)]
    done: dict[tuple[OpKind, int, Slot], float] = {}  # when each started task ends
    channels: dict[tuple[Slot, Slot, OpKind], list[int]] = {}  # sent, not yet consumed, in order
    events: list[float] = []  # end times of started tasks (a heap): when something may change
    relaxed = False
    now = 0.0
    while any(state.pending for state in states.values()):
        started = False
        for state in states.values():
            if state.free_at > now or not state.pending:
                continue
            task = _pick(routes, state, now, done, channels, relaxed)
            if task is not None:
                heapq.heappush(events, _start(routes, state, task, now, done, channels))
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
            stuck = {
                s.slot: [f"{t.kind.value}{t.microbatch}" for t in s.pending[:4]] for s in states.values() if s.pending
            }
            raise PlanningError(f"the re-routed schedule cannot be ordered; tasks left per (pipeline, stage): {stuck}")
    return {slot: state.order for slot, state in states.items()}


def _inputs(routes: Routes, slot: Slot, task: Task) -> tuple[tuple[OpKind, int, Slot] | None, Slot | None]:
    """The task this one waits for (kind, microbatch, slot) and the slot its message comes from."""
    route = routes.by_microbatch[task.microbatch]
    at = position(routes, slot, task.microbatch)
    last = len(route.hops) - 1
    if task.kind is F:
        if at == 0:
            return None, None
        before = route.hops[at - 1]
        return (F, task.microbatch, (before.pipeline, before.stage)), (before.pipeline, before.stage)
    if task.kind in (I, B):
        if at == last:
            return (F, task.microbatch, slot), None
        after = route.hops[at + 1]
        return (I, task.microbatch, (after.pipeline, after.stage)), (after.pipeline, after.stage)
    return (I, task.microbatch, slot), None


def _ready(routes: Routes, state: _SlotState, task: Task, now: float, done: dict, channels: dict) -> float | None:
    """When ``task`` may start (None: not yet known, or not at the head of its channel)."""
    needs, source = _inputs(routes, state.slot, task)
    if needs is not None and (needs not in done or done[needs] > now):
        return None
    if source is not None:
        queue = channels.get((source, state.slot, F if task.kind is F else I), [])
        if not queue or queue[0] != task.microbatch:
            return None
    return done[needs] if needs is not None else 0.0


def _pick(routes: Routes, state: _SlotState, now: float, done: dict, channels: dict, relaxed: bool) -> Task | None:
    ready: dict[OpKind, list[tuple[float, int, Task]]] = {F: [], I: [], W: []}
    for task in state.pending:
        at = _ready(routes, state, task, now, done, channels)
        if at is not None:
            ready[I if task.kind is B else task.kind].append((at, task.microbatch, task))
    limit = math.inf if relaxed else state.limit
    may_forward = ready[F] and state.in_flight < limit
    if ready[I]:
        return min(ready[I])[2]
    if ready[W] and (state.deferred >= state.limit or not may_forward):
        return min(ready[W])[2]
    if may_forward:
        return min(ready[F])[2]
    return None


def _start(routes: Routes, state: _SlotState, task: Task, now: float, done: dict, channels: dict) -> float:
    """Start ``task`` at ``now``; returns when it ends."""
    state.pending.remove(task)
    state.order.append(task)
    end = now + state.seconds[task.kind]
    state.free_at = end
    done[(I if task.kind is B else task.kind, task.microbatch, state.slot)] = end  # a B gives the input gradient
    _, source = _inputs(routes, state.slot, task)
    if source is not None:
        channels[(source, state.slot, F if task.kind is F else I)].pop(0)
    route = routes.by_microbatch[task.microbatch]
    at = position(routes, state.slot, task.microbatch)
    if task.kind is F:
        state.in_flight += 1
        if at < len(route.hops) - 1:
            after = route.hops[at + 1]
            channels.setdefault((state.slot, (after.pipeline, after.stage), F), []).append(task.microbatch)
    elif task.kind in (I, B):
        state.in_flight -= 1
        state.deferred += task.kind is I
        if at > 0:
            before = route.hops[at - 1]
            channels.setdefault((state.slot, (before.pipeline, before.stage), I), []).append(task.microbatch)
    else:
        state.deferred -= 1
    return end
