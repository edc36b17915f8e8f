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

The list scheduler runs once per re-routed plan the simulator costs (tens of thousands of tasks
for a large plan), so its inner loop works on flat per-slot lists, integer task codes and tuples;
``rerouted_pairs`` gives its orders as (kind, microbatch) pairs for the operation-level cost
(``oobleck.schedules.cost.orders_cost``), ``rerouted_orders`` as ``Task`` lists for lowering.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict, deque

from oobleck.errors import PlanningError
from oobleck.planning.inputs import DEFAULT_BACKWARD_INPUT_FRACTION
from oobleck.planning.pipeline_cost import DEFAULT_FORWARD_FRACTION
from oobleck.schedules.lower import Slot, Task
from oobleck.schedules.ops import OpKind
from oobleck.schedules.routes import Routes

F, I, W, B = OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT, OpKind.BACKWARD

# Task codes inside the scheduler (an enum member hashes through Python code; an int does not),
# and the kind of each code.
_F, _I, _W, _B = 0, 1, 2, 3
_KINDS = (F, I, W, B)

# An eligible task: (ready at, microbatch, code, the channel its input arrives on, the channel its
# output leaves on, the key of its end: None for a W, whose end nobody waits for). A slot sees a
# microbatch's task of one kind once, so (ready at, microbatch) orders a slot's entries of one kind
# totally and the rest is never compared.
_Entry = tuple[float, int, int, "deque[int] | None", "deque[int] | None", "int | None"]
# A task waiting for another's end: (its slot, the eligible list it joins, then its entry's fields
# after the ready time).
_Waiter = tuple[int, list[_Entry], int, int, "deque[int] | None", "deque[int] | None", "int | None"]


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
    return {slot: [Task(kind, mb) for kind, mb in pairs] for slot, pairs in rerouted_pairs(routes, split).items()}


class _Tasks:
    """Every slot's tasks before scheduling: those ready at the start, those waiting for another
    task's end, and each slot's in-flight limit and task count.

    A task's end has an integer key: ``(microbatch * slots + slot) * 2``, plus one for the input
    gradient (an I or B) rather than the forward output (unique for any integer microbatch). A
    channel between slots is keyed alike: ``(sender * slots + receiver) * 2``, plus one for input
    gradients rather than forward outputs."""

    def __init__(self, routes: Routes, slots: list[Slot], split: bool) -> None:
        n = len(slots)
        index = {slot: i for i, slot in enumerate(slots)}
        self.eligible: tuple[list[list[_Entry]], ...] = tuple([[] for _ in slots] for _ in range(3))  # F, I, W
        self.waiting: dict[int | None, list[_Waiter]] = {}
        self.limit = [0] * n
        self.remaining = [0] * n
        queues: defaultdict[int, deque[int]] = defaultdict(deque)  # sent, not yet consumed, in order
        backward = _I if split else _B
        per_hop = 3 if split else 2
        forwards, inputs, weights = self.eligible
        waiting, limit, remaining = self.waiting, self.limit, self.remaining
        sends: deque[int] | None
        reads: deque[int] | None
        back: deque[int] | None
        for route in routes.routes:
            mb = route.microbatch
            path = [index[(hop.pipeline, hop.stage)] for hop in route.hops]
            hops = len(path)
            mine = mb * n
            for at, i in enumerate(path):
                limit[i] = max(limit[i], hops - at)
                remaining[i] += per_hop
                output = (mine + i) * 2
                gradient = output + 1
                if at + 1 < hops:
                    after = path[at + 1]
                    sends = queues[(i * n + after) * 2]
                    reads = queues[(after * n + i) * 2 + 1]
                    after_key = (mine + after) * 2 + 1
                else:
                    sends = reads = None
                    after_key = output
                if at:
                    before = path[at - 1]
                    waiter = (i, forwards[i], mb, _F, queues[(before * n + i) * 2], sends, output)
                    waiting.setdefault((mine + before) * 2, []).append(waiter)
                    back = queues[(i * n + before) * 2 + 1]
                else:
                    bisect.insort(forwards[i], (0.0, mb, _F, None, sends, output))
                    back = None
                waiting.setdefault(after_key, []).append((i, inputs[i], mb, backward, reads, back, gradient))
                if split:
                    waiting.setdefault(gradient, []).append((i, weights[i], mb, _W, None, None, None))


def rerouted_pairs(routes: Routes, split: bool = True) -> dict[Slot, list[tuple[OpKind, int]]]:
    """``rerouted_orders`` as (kind, microbatch) pairs.

    The schedule is made in passes at one time ``now``: each pass offers every free slot, in slot
    order, one task by the priorities; when a pass starts nothing, ``now`` moves to the next end of
    a started task (or, once, the in-flight limits are relaxed). A slot's pick depends only on
    ``now``, its own state, its eligible tasks and the heads of the channels they read, so a pass
    offers only the slots where one of those changed since the slot was last offered (a slot whose
    pick came out empty stays empty until then). The orders are those of offering every slot in
    every pass, which the tests check against a copy of that simpler loop."""
    slots = sorted(routes.slots)
    n = len(slots)
    tasks = _Tasks(routes, slots, split)
    forwards, inputs, weights = tasks.eligible
    waiting, limit, remaining = tasks.waiting, tasks.limit, tasks.remaining
    seconds = []
    for slot in slots:
        of = task_seconds(routes, slot)
        seconds.append(tuple(of[kind] for kind in _KINDS))
    orders: list[list[tuple[OpKind, int]]] = [[] for _ in slots]
    free_at = [0.0] * n
    in_flight = [0] * n  # microbatches whose forward ran and input gradient not
    deferred = [0] * n  # W tasks whose I ran
    left = sum(remaining)
    # Slots whose pick may change when ``now`` reaches a time (a task ends there: its slot becomes
    # free and the tasks it unblocks become ready), and those times (a heap).
    wake: dict[float, list[int]] = {}
    times: list[float] = []
    pending = list(range(n))  # slots to offer in the next pass (repeats allowed)
    relaxed = False
    now = 0.0
    heappop, heappush, insort = heapq.heappop, heapq.heappush, bisect.insort  # (the loop runs per task)
    while left:
        offer = pending  # a heap: slot order
        heapq.heapify(offer)
        pending = []
        started = False
        last = -1
        while offer:
            i = heappop(offer)
            if i == last:
                continue  # offered already in this pass
            last = i
            if free_at[i] > now or not remaining[i]:
                continue
            # The pick (module docstring): an input gradient, else a forward within the in-flight
            # limit unless as many W's wait as may be in flight, else the oldest deferred W.
            entries = inputs[i]
            at = _first_ready(entries, now) if entries else -1
            if at < 0:
                entries = forwards[i]
                at = _first_ready(entries, now) if entries and (relaxed or in_flight[i] < limit[i]) else -1
                if at < 0 or deferred[i] >= limit[i]:
                    weight = _first_ready(weights[i], now) if weights[i] else -1
                    if weight >= 0:
                        entries, at = weights[i], weight
                    elif at < 0:
                        continue
            _, mb, code, reads, sends, key = entries.pop(at)
            # Start it at ``now``.
            remaining[i] -= 1
            orders[i].append((_KINDS[code], mb))
            end = now + seconds[i][code]
            free_at[i] = end
            if reads is not None:
                reads.popleft()
            if sends is not None:
                sends.append(mb)
            if code == _F:
                in_flight[i] += 1
            elif code == _W:
                deferred[i] -= 1
            else:
                in_flight[i] -= 1
                deferred[i] += code == _I
            left -= 1
            started = True
            # Who may pick differently now: this slot (at once if the task took no time) and the
            # slots of the tasks it unblocks (at once if they are ready now). A message it sends is
            # read only by a task it unblocks, so a new channel head is among these. "At once": a
            # slot after this one in this pass, one before it (or this one) in the next.
            unblocked = waiting.pop(key, ())
            if end > now:
                woken = wake.get(end)
                if woken is None:
                    woken = wake[end] = []
                    heappush(times, end)
                woken.append(i)
                for j, joins, their_mb, their_code, their_reads, their_sends, their_key in unblocked:
                    insort(joins, (end, their_mb, their_code, their_reads, their_sends, their_key))
                    if j != i:
                        woken.append(j)
            else:
                pending.append(i)
                for j, joins, their_mb, their_code, their_reads, their_sends, their_key in unblocked:
                    insort(joins, (end, their_mb, their_code, their_reads, their_sends, their_key))
                    if j > i:
                        heappush(offer, j)
                    else:
                        pending.append(j)
        if started and pending:
            continue  # (a pass offering no slot would start nothing: move on at once)
        if times:
            now = heappop(times)
            pending = wake.pop(now)
        elif not relaxed:
            relaxed = True  # in-flight limits held every slot: let forwards run past them
            pending = list(range(n))
        else:
            stuck = {slots[i]: remaining[i] for i in range(n) if remaining[i]}
            raise PlanningError(f"the re-routed schedule cannot be ordered; tasks left per (pipeline, stage): {stuck}")
    return dict(zip(slots, orders))


def _first_ready(entries: list[_Entry], now: float) -> int:
    """Where in ``entries`` the earliest-ready, then lowest-microbatch task that can start at
    ``now`` is (sorted: the first that can start is the best), or -1."""
    for at, entry in enumerate(entries):
        if entry[0] > now:
            return -1
        reads = entry[3]
        if reads is not None and (not reads or reads[0] != entry[1]):
            continue  # not the oldest message on its channel
        return at
    return -1
