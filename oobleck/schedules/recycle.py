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

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from oobleck.errors import PlanningError
from oobleck.planning.inputs import DEFAULT_BACKWARD_INPUT_FRACTION
from oobleck.planning.pipeline_cost import DEFAULT_FORWARD_FRACTION
from oobleck.schedules.lower import Slot, Task
from oobleck.schedules.ops import OpKind
from oobleck.schedules.routes import Routes

F, I, W, B = OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT, OpKind.BACKWARD


@dataclass(slots=True)
class _Need:
    """What a task of a slot waits for: the task (kind, microbatch, slot) whose end makes its input
    (None: none, a first stage's forward), and the queue of the channel its message arrives on."""

    after: tuple[OpKind, int, Slot] | None
    channel: deque[int] | None
    sends: deque[int] | None  # the queue of the channel this task's own output leaves on


# An eligible task: (ready at, microbatch, task, what it needs). A slot sees a microbatch's task of
# one kind once, so (ready at, microbatch) orders the entries totally and the rest is never compared.
_Entry = tuple[float, int, Task, _Need]


@dataclass
class _SlotState:
    slot: Slot
    limit: int  # microbatches that may be in flight (forward done, input gradient not)
    seconds: dict[OpKind, float]
    remaining: int = 0
    # Tasks whose input is (or will be) there: kind -> entries, each list sorted.
    eligible: dict[OpKind, list[_Entry]] = field(default_factory=lambda: {F: [], I: [], W: []})
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
    to measure what the split buys).

    The schedule is made in passes at one time ``now``: each pass offers every free slot, in slot
    order, one task by the priorities; when a pass starts nothing, ``now`` moves to the next end of
    a started task (or, once, the in-flight limits are relaxed). A slot's pick depends only on
    ``now``, its own state, its eligible tasks and the heads of the channels they read, so a pass
    offers only the slots where one of those changed since the slot was last offered (a slot whose
    pick came out empty stays empty until then). The orders are those of offering every slot in
    every pass, which the tests check against a copy of that simpler loop."""
    slots = sorted(routes.slots)
    states = [_SlotState(slot, 0, task_seconds(routes, slot)) for slot in slots]
    index = {slot: i for i, slot in enumerate(slots)}
    backward = I if split else B
    queues: dict[tuple[Slot, Slot, OpKind], deque[int]] = {}  # sent, not yet consumed, in order

    def queue(channel: tuple[Slot, Slot, OpKind] | None) -> deque[int] | None:
        return None if channel is None else queues.setdefault(channel, deque())

    # a task's end -> the tasks it unblocks (slot index, task, need)
    waiting: dict[tuple[OpKind, int, Slot], list[tuple[int, Task, _Need]]] = {}
    for route in routes.routes:
        mb, hops = route.microbatch, route.hops
        path = [(hop.pipeline, hop.stage) for hop in hops]
        for at, slot in enumerate(path):
            i = index[slot]
            state = states[i]
            state.limit = max(state.limit, len(hops) - at)
            before = path[at - 1] if at > 0 else None
            after = path[at + 1] if at < len(hops) - 1 else None
            kinds = {
                F: _Need(
                    (F, mb, before) if before else None,
                    queue((before, slot, F) if before else None),
                    queue((slot, after, F) if after else None),
                ),
                backward: _Need(
                    (I, mb, after) if after else (F, mb, slot),
                    queue((after, slot, I) if after else None),
                    queue((slot, before, I) if before else None),
                ),
            }
            if split:
                kinds[W] = _Need((I, mb, slot), None, None)
            for kind, need in kinds.items():
                task = Task(kind, mb)
                state.remaining += 1
                if need.after is None:
                    bisect.insort(state.eligible[F], (0.0, mb, task, need))
                else:
                    waiting.setdefault(need.after, []).append((i, task, need))
    left = sum(state.remaining for state in states)
    # Slots whose pick may change when ``now`` reaches a time (a task ends there: its slot becomes
    # free and the tasks it unblocks become ready), and those times (a heap).
    wake: dict[float, list[int]] = {}
    times: list[float] = []
    pending = list(range(len(states)))  # slots to offer in the next pass (repeats allowed)
    relaxed = False
    now = 0.0
    while left:
        offer = pending  # a heap: slot order
        heapq.heapify(offer)
        pending = []
        started = False
        last = -1
        while offer:
            i = heapq.heappop(offer)
            if i == last:
                continue  # offered already in this pass
            last = i
            state = states[i]
            if state.free_at > now or not state.remaining:
                continue
            picked = _pick(state, now, relaxed)
            if picked is None:
                continue
            task, need = picked
            end = _start(state, task, now, need)
            left -= 1
            started = True
            # Who may pick differently now: this slot (at once if the task took no time) and the
            # slots of the tasks it unblocks (at once if they are ready now). A message it sends is
            # read only by a task it unblocks, so a new channel head is among these. "At once": a
            # slot after this one in this pass, one before it (or this one) in the next.
            if end > now:
                _wake_at(wake, times, end, i)
            else:
                pending.append(i)
            # a B gives the input gradient
            produced = (I if task.kind is B else task.kind, task.microbatch, state.slot)
            for j, unblocked, needed in waiting.pop(produced, ()):
                kind = I if unblocked.kind is B else unblocked.kind
                bisect.insort(states[j].eligible[kind], (end, unblocked.microbatch, unblocked, needed))
                if end > now:
                    _wake_at(wake, times, end, j)
                elif j > i:
                    heapq.heappush(offer, j)
                else:
                    pending.append(j)
        if started and pending:
            continue  # (a pass offering no slot would start nothing: move on at once)
        if times:
            now = heapq.heappop(times)
            pending = wake.pop(now)
        elif not relaxed:
            relaxed = True  # in-flight limits held every slot: let forwards run past them
            pending = list(range(len(states)))
        else:
            stuck = {s.slot: s.remaining for s in states if s.remaining}
            raise PlanningError(f"the re-routed schedule cannot be ordered; tasks left per (pipeline, stage): {stuck}")
    return {state.slot: state.order for state in states}


def _wake_at(wake: dict[float, list[int]], times: list[float], at: float, slot: int) -> None:
    woken = wake.get(at)
    if woken is None:
        wake[at] = [slot]
        heapq.heappush(times, at)
    else:
        woken.append(slot)


def _best(entries: list[_Entry], now: float) -> int:
    """Where in ``entries`` the earliest-ready, then lowest-microbatch task that can start at
    ``now`` is (sorted: the first that can start is the best), or -1."""
    for at, entry in enumerate(entries):
        if entry[0] > now:
            return -1
        channel = entry[3].channel
        if channel is not None and (not channel or channel[0] != entry[1]):
            continue  # not the oldest message on its channel
        return at
    return -1


def _pick(state: _SlotState, now: float, relaxed: bool) -> tuple[Task, _Need] | None:
    """The slot's next task at ``now`` by the priorities of the module docstring, or None."""
    eligible = state.eligible
    inputs = _best(eligible[I], now)
    if inputs >= 0:
        return _take(eligible[I], inputs)
    limit = math.inf if relaxed else state.limit
    forward = _best(eligible[F], now) if state.in_flight < limit else -1
    weights = _best(eligible[W], now)
    if weights >= 0 and (state.deferred >= state.limit or forward < 0):
        return _take(eligible[W], weights)
    if forward >= 0:
        return _take(eligible[F], forward)
    return None


def _take(entries: list[_Entry], at: int) -> tuple[Task, _Need]:
    entry = entries.pop(at)
    return entry[2], entry[3]


def _start(state: _SlotState, task: Task, now: float, need: _Need) -> float:
    """Start ``task`` at ``now``; returns when it ends."""
    state.remaining -= 1
    state.order.append(task)
    end = now + state.seconds[task.kind]
    state.free_at = end
    if need.channel is not None:
        need.channel.popleft()
    if need.sends is not None:
        need.sends.append(task.microbatch)
    if task.kind is F:
        state.in_flight += 1
    elif task.kind in (I, B):
        state.in_flight -= 1
        state.deferred += task.kind is I
    else:
        state.deferred -= 1
    return end
