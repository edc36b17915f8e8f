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
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules.ops import Op, OpKind, Schedule
from oobleck.schedules.simulate import run_lists


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


def schedule_cost(
    plan: ExecutionPlan, schedule: Schedule, profile: ModelProfile, cluster: ClusterSpec | None = None
) -> ScheduleCost:
    """Time ``schedule`` (see the module docstring); ``cluster`` None: transfers take no time."""
    layers = profile.layers
    if len(layers) != plan.num_layers:
        raise ValueError(f"the profile has {len(layers)} layers but the plan {plan.num_layers}")
    forward = _prefix([layer.forward_s for layer in layers])
    backward = _prefix([layer.backward_s for layer in layers])
    inputs = _prefix([layer.backward_split[0] for layer in layers])
    weights = _prefix([layer.backward_split[1] for layer in layers])
    node = [a.worker[0] for a in plan.assignments()]
    b = plan.microbatch_size

    def duration(rank: int, op: Op) -> float:
        share = (op.hi - op.lo) / b
        a, c = op.start, op.end
        if op.kind in (OpKind.FORWARD, OpKind.REDUNDANT_FORWARD):
            seconds = forward[c] - forward[a]
        elif op.kind is OpKind.BACKWARD or (op.kind is OpKind.BACKWARD_WEIGHT and a == 0):
            seconds = backward[c] - backward[a]
        elif op.kind is OpKind.BACKWARD_INPUT:
            seconds = 0.0 if a == 0 else inputs[c] - inputs[a]
        elif op.kind is OpKind.BACKWARD_WEIGHT:
            seconds = weights[c] - weights[a]
        else:
            seconds = 0.0
        return seconds * share

    def delivery(rank: int, op: Op) -> float:
        if cluster is None:
            return 0.0
        boundary = op.end - 1 if op.kind is OpKind.SEND_F else op.start - 1
        nbytes = layers[boundary].output_bytes * (op.hi - op.lo) / b
        same_node = node[rank] == node[op.peer]
        return nbytes / (cluster.intra_node_bandwidth if same_node else cluster.inter_node_bandwidth)

    timeline = run_lists(schedule, duration, delivery)
    if not timeline.finished:
        raise ValueError("the schedule deadlocks; check it with oobleck.schedules.check_schedule first")
    return ScheduleCost(timeline.end, timeline.busy)
