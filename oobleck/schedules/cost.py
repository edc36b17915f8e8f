"""Operation-level cost: a schedule's step time by list scheduling the lists the runtime executes.

Every rank runs its ops in order (``oobleck.schedules.simulate``). A compute op takes the profile's
seconds for its layers (``forward_s``; ``backward_s`` for a full backward; the two halves of
``LayerProfile.backward_split`` for I and W, except on the first stage, whose input is token ids:
there the interpreter, as torch's ``PipelineStage`` does, runs the whole backward as W and I does
nothing), scaled by its share of the microbatch's rows (a stage on g devices takes ``1/g`` each,
as the planner's cost model's ``(F + B) / g``). A redundant forward takes the forward seconds of
the shadow's layers. A send leaves at once and arrives after its bytes (the boundary layer's
``output_bytes``, scaled by rows) over the in-node bandwidth when both ranks share a node, the
cross-node one otherwise; a receive waits for it. The gradient reduction and the optimizer are
not in it (they follow the schedule: ``oobleck.planning.pipeline_cost``).

On plain 1F1B with one device per stage and free transfers this is exactly
``exact_1f1b_makespan`` (the same longest path), and so Eq. 1-4 where those agree (equal stages,
m >= S); the planner's cost model instead adds each boundary transfer to the stage's time.

``orders_cost`` gives the same numbers from the slots' compute orders without making the ops: a
rank's op list is, task by task, the receives of the task's input, the compute op and the sends of
its output (``oobleck.schedules.lower``), so it runs those groups with the same float operations
in the same order as ``run_lists`` runs the ops (a task's receives are taken together once all
have arrived: each takes its channel's next message whenever it is taken, and the clock is their
maximum). ``plan_cost`` uses it for every plan whose lists are lowered orders (1F1B, re-routed),
the simulator's ReCycle costing among them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules import build_schedule, compute_pairs, plan_routes
from oobleck.schedules.lower import Slot
from oobleck.schedules.ops import Op, OpKind, Schedule
from oobleck.schedules.routes import Hop, Routes, rows
from oobleck.schedules.simulate import run_lists

F, B, I, W = OpKind.FORWARD, OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class ScheduleCost:
    """When each rank finished its list, and its compute seconds in it."""

    rank_end_s: tuple[float, ...]
    rank_busy_s: tuple[float, ...]

    @property
    def makespan_s(self) -> float:
        return max(self.rank_end_s, default=0.0)

    @property
    def idle_fraction(self) -> float:
        """Share of the ranks' time up to the makespan spent waiting (the bubbles)."""
        total = self.makespan_s * len(self.rank_end_s)
        return 1.0 - sum(self.rank_busy_s) / total if total > 0 else 0.0


def _prefix(values: list[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


class _Timing:
    """An op's seconds (see the module docstring), from its kind, layers, rows and ranks: the one
    definition both the op path and the order path use, so their floats are the same."""

    def __init__(self, plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterSpec | None) -> None:
        layers = profile.layers
        if len(layers) != plan.num_layers:
            raise ValueError(f"the profile has {len(layers)} layers but the plan {plan.num_layers}")
        self.layers, self.cluster = layers, cluster
        self.forward = _prefix([layer.forward_s for layer in layers])
        self.backward = _prefix([layer.backward_s for layer in layers])
        self.inputs = _prefix([layer.backward_split[0] for layer in layers])
        self.weights = _prefix([layer.backward_split[1] for layer in layers])
        self.node = [a.worker[0] for a in plan.assignments()]
        self.b = plan.microbatch_size

    def compute_s(self, kind: OpKind, a: int, c: int, lo: int, hi: int) -> float:
        """A compute op of layers ``[a, c)`` on rows ``[lo, hi)``; 0 for any other op."""
        share = (hi - lo) / self.b
        if kind in (OpKind.FORWARD, OpKind.REDUNDANT_FORWARD):
            seconds = self.forward[c] - self.forward[a]
        elif kind is OpKind.BACKWARD or (kind is OpKind.BACKWARD_WEIGHT and a == 0):
            seconds = self.backward[c] - self.backward[a]
        elif kind is OpKind.BACKWARD_INPUT:
            seconds = 0.0 if a == 0 else self.inputs[c] - self.inputs[a]
        elif kind is OpKind.BACKWARD_WEIGHT:
            seconds = self.weights[c] - self.weights[a]
        else:
            seconds = 0.0
        return seconds * share

    def delivery_s(self, kind: OpKind, a: int, c: int, lo: int, hi: int, rank: int, peer: int) -> float:
        """A send of ``rank`` (of the compute op of layers ``[a, c)``) of rows ``[lo, hi)`` to ``peer``."""
        if self.cluster is None:
            return 0.0
        boundary = c - 1 if kind is OpKind.SEND_F else a - 1
        nbytes = self.layers[boundary].output_bytes * (hi - lo) / self.b
        same_node = self.node[rank] == self.node[peer]
        return nbytes / (self.cluster.intra_node_bandwidth if same_node else self.cluster.inter_node_bandwidth)


def schedule_cost(
    plan: ExecutionPlan, schedule: Schedule, profile: ModelProfile, cluster: ClusterSpec | None = None
) -> ScheduleCost:
    """Time ``schedule`` (see the module docstring); ``cluster`` None: transfers take no time."""
    timing = _Timing(plan, profile, cluster)

    def duration(rank: int, op: Op) -> float:
        return timing.compute_s(op.kind, op.start, op.end, op.lo, op.hi)

    def delivery(rank: int, op: Op) -> float:
        return timing.delivery_s(op.kind, op.start, op.end, op.lo, op.hi, rank, op.peer)

    timeline = run_lists(schedule, duration, delivery)
    if not timeline.finished:
        raise ValueError(_DEADLOCK)
    return ScheduleCost(timeline.end, timeline.busy)


_DEADLOCK = "the schedule deadlocks; check it with oobleck.schedules.check_schedule first"


def plan_cost(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterSpec | None = None) -> ScheduleCost:
    """``schedule_cost`` of ``build_schedule(plan)``, the same numbers; a plan without shadows (1F1B
    or re-routed) is costed from its compute orders (``orders_cost``), its ops never made."""
    if plan.shadows:
        return schedule_cost(plan, build_schedule(plan), profile, cluster)
    with _collector_paused():
        routes = plan_routes(plan)
        return orders_cost(routes, compute_pairs(plan, routes), profile, cluster)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector. A large plan's costing makes some 10^5 tuples and lists,
    nearly all alive until it returns and none in a cycle (reference counting frees them); the
    collections their number triggers would scan them, and in a simulation every other object of
    the process, over and over: they took half of a simulation's time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# A task of a rank: (the channels of its receives, its compute seconds, (channel, delivery
# seconds) of its sends), receives and sends in the order the lowered ops have them.
_Step = tuple[tuple[int, ...], float, tuple[tuple[int, float], ...]]


def orders_cost(
    routes: Routes,
    orders: Mapping[Slot, Sequence[tuple[OpKind, int]]],
    profile: ModelProfile,
    cluster: ClusterSpec | None = None,
) -> ScheduleCost:
    """``schedule_cost`` of the lists ``lower(routes, orders)`` makes (``orders``: each slot's
    (kind, microbatch) tasks), without making them (see the module docstring)."""
    timing = _Timing(routes.plan, profile, cluster)
    steps = _RankSteps(routes, timing)
    lists: list[list[_Step]] = [[] for _ in routes.plan.assignments()]
    for slot, hop in routes.slots.items():
        for shard, rank in enumerate(hop.ranks):
            lo, hi = rows(routes.microbatch_size, len(hop.ranks), shard)
            if hi > lo:
                lists[rank] = steps.of(slot, hop, rank, (lo, hi), orders.get(slot, ()))
    end, busy, finished = _run_steps(lists, len(steps.channels))
    if not finished:
        raise ValueError(_DEADLOCK)
    return ScheduleCost(tuple(end), tuple(busy))


class _RankSteps:
    """Each rank's tasks as ``_Step`` s; channels numbered as they are first met (one per sender,
    receiver and direction, as ``run_lists`` keys them).

    A task's step depends only on its kind and the hops before and after the slot on its route (at
    the slot's first place there, as ``lower`` takes it), so each rank works out the four steps
    (F, I, B, W) of each such pair of hops once and looks a task's up by its microbatch."""

    def __init__(self, routes: Routes, timing: _Timing) -> None:
        self.routes, self.timing = routes, timing
        self.channels: dict[tuple[int, int, bool], int] = {}
        # slot -> microbatch -> (the hop before, the hop after) the slot on its route
        self.around: dict[Slot, dict[int, tuple[Hop | None, Hop | None]]] = {slot: {} for slot in routes.slots}
        for mb, route in routes.by_microbatch.items():
            hops = route.hops
            for at, hop in enumerate(hops):
                passing = self.around.setdefault((hop.pipeline, hop.stage), {})
                if mb not in passing:
                    passing[mb] = (hops[at - 1] if at else None, hops[at + 1] if at + 1 < len(hops) else None)

    def of(
        self, slot: Slot, hop: Hop, rank: int, mine: tuple[int, int], tasks: Sequence[tuple[OpKind, int]]
    ) -> list[_Step]:
        """The steps of ``rank`` (rows ``mine`` of ``hop``) for the tasks of its slot."""
        by_hops: dict[tuple[int, int], tuple[_Step, _Step, _Step, _Step]] = {}  # ids of the hops around
        by_microbatch: dict[int, tuple[_Step, _Step, _Step, _Step]] = {}
        for mb, (before, after) in self.around[slot].items():
            key = (id(before), id(after))  # the hops live in ``routes``, so ids are stable
            four = by_hops.get(key)
            if four is None:
                four = by_hops[key] = self._four(hop, rank, mine, before, after)
            by_microbatch[mb] = four
        result: list[_Step] = []
        append = result.append
        for kind, mb in tasks:
            four = by_microbatch.get(mb)
            if four is None:
                if mb not in self.routes.by_microbatch:
                    raise KeyError(mb)  # as lowering fails on a microbatch of no route
                raise ValueError(f"microbatch {mb} does not pass stage {slot[1]} of pipeline {slot[0]}")
            if kind is F:
                append(four[0])
            elif kind is I:
                append(four[1])
            elif kind is B:
                append(four[2])
            elif kind is W:
                append(four[3])
            else:  # (no generator orders other kinds; lowered, they are a compute op alone)
                append(((), self.timing.compute_s(kind, hop.start, hop.end, *mine), ()))
        return result

    def _four(
        self, hop: Hop, rank: int, mine: tuple[int, int], before: Hop | None, after: Hop | None
    ) -> tuple[_Step, _Step, _Step, _Step]:
        """The F, I, B and W steps of ``rank`` (rows ``mine`` of ``hop``) between ``before`` and
        ``after``: a forward receives from the hop before and sends to the one after, a backward
        the other way, a W neither."""
        timing, a, c = self.timing, hop.start, hop.end
        forward_in = self._receives(hop, rank, before, True) if before is not None else ()
        forward_out = self._sends(hop, rank, after, True) if after is not None else ()
        backward_in = self._receives(hop, rank, after, False) if after is not None else ()
        backward_out = self._sends(hop, rank, before, False) if before is not None else ()
        return (
            (forward_in, timing.compute_s(F, a, c, *mine), forward_out),
            (backward_in, timing.compute_s(I, a, c, *mine), backward_out),
            (backward_in, timing.compute_s(B, a, c, *mine), backward_out),
            ((), timing.compute_s(W, a, c, *mine), ()),
        )

    def _channel(self, sender: int, receiver: int, activations: bool) -> int:
        key = (sender, receiver, activations)
        number = self.channels.get(key)
        if number is None:
            number = self.channels[key] = len(self.channels)
        return number

    def _receives(self, hop: Hop, rank: int, other: Hop, activations: bool) -> tuple[int, ...]:
        """The channels ``rank`` receives on from the shards of ``other``, in shard order."""
        return tuple(self._channel(peer, rank, activations) for peer, _ in self.routes.overlapping(hop, rank, other))

    def _sends(self, hop: Hop, rank: int, other: Hop, activations: bool) -> tuple[tuple[int, float], ...]:
        """(channel, delivery seconds) of each send of ``rank`` to the shards of ``other``."""
        kind = OpKind.SEND_F if activations else OpKind.SEND_B
        return tuple(
            (self._channel(rank, peer, activations), self.timing.delivery_s(kind, hop.start, hop.end, x, y, rank, peer))
            for peer, (x, y) in self.routes.overlapping(hop, rank, other)
        )


def _run_steps(lists: list[list[_Step]], channels: int) -> tuple[list[float], list[float], bool]:
    """``run_lists`` on steps: each rank runs its steps in order, a step once every message it
    receives has arrived; (each rank's end, its compute seconds, whether every list finished)."""
    sent: list[list[float]] = [[] for _ in range(channels)]  # arrival times, in sending order
    taken = [0] * channels
    position = [0] * len(lists)
    clock = [0.0] * len(lists)
    busy = [0.0] * len(lists)
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(lists):
            at, count = position[rank], len(steps)
            if at == count:
                continue
            now, spent = clock[rank], busy[rank]
            while at < count:
                receives, seconds, sends = steps[at]
                if receives:
                    waiting = False
                    for c in receives:
                        if taken[c] == len(sent[c]):
                            waiting = True
                            break
                    if waiting:
                        break
                    for c in receives:
                        k = taken[c]
                        taken[c] = k + 1
                        now = max(now, sent[c][k])
                now += seconds
                spent += seconds
                for c, delivery in sends:
                    sent[c].append(now + delivery)
                at += 1
            if at != position[rank]:
                position[rank], clock[rank], busy[rank] = at, now, spent
                progress = True
    finished = all(position[r] == len(steps) for r, steps in enumerate(lists))
    return clock, busy, finished
