"""The planner's cost model: stage times, pipeline iteration time, memory and gradient sync.

Assumptions (each is used by template generation, instantiation and reconfiguration alike):

- A stage holds layers ``[start, end)`` on ``g`` devices of one node. Each device holds the whole
  stage and takes ``1/g`` of every microbatch, so its compute per microbatch is ``(F + B) / g``.
- A stage's per-microbatch time ``w_i`` adds the transfer of its output boundary tensor to the next
  stage and of the gradient of that tensor back: ``2 * output_bytes / bandwidth``, where the
  bandwidth is the in-node one when the next stage sits on the same node and the cross-node one
  otherwise. The whole tensor crosses the link (conservative: shards are not assumed to overlap).
- A pipeline of S stages running m microbatches with 1F1B is predicted by the paper's Eq. 1-4
  (Oobleck, SOSP'23) with k* the rightmost slowest stage (counted from 0):
  ``T = sum_i w_i + (m - S + k* - 1) * w_k* + sum_{i >= k*} w_i`` (equal stages: ``(m + S - 1) w``).
  What is true of it (checked in tests/planning/test_pipeline_cost.py against ``exact_1f1b_makespan``, the
  longest path through the schedule's 2*m*S operations): it is never above the exact makespan;
  it equals it for equal stages; with unequal stages it is often below (stage times (2, 1),
  m = 2: 4.0 against 4.33; a bottleneck early in the pipeline is undercounted most), by a gap that
  does not grow with m (both grow by max(w) per extra microbatch, since the exact makespan is at
  most ``(m + S - 1) max(w)``). Below m = S it can even go negative.
- The planner's prediction ``pipeline_time`` is Eq. 1-4 for m >= S and, below S, the exact
  makespan capped at Eq. 1-4's value at m = S, so it is nondecreasing in m (the batch
  distribution relies on that) and never above the exact makespan. Template ranking, batch
  distribution, instantiation, reconfiguration and every reported ``predicted_iteration_s`` use
  this one function, evaluated by the same float operations (``eq14_line``), so what the planner
  chooses by is what it reports; it is a model, comparable with the paper, not a measurement.
- Memory of one device of stage i of S: 16 bytes per parameter (fp32 Adam: parameters, gradients
  and two moments) plus the activations of the ``S - i`` microbatches 1F1B keeps in flight there,
  divided by g (each device keeps only its share of every microbatch).
- Copying layers to new holders (reconfiguration) moves parameters and Adam's two moments, fp32
  (3 bytes per parameter byte; gradients are recomputed, not moved: conf/strategy/oobleck.yaml's
  ``moved_bytes_per_param: 12``). Nodes send and receive in parallel over their own links, so a
  set of copies takes its busiest node's cross-node bytes (in or out) over the cross-node
  bandwidth; a copy inside a node is local and not counted (as the simulator counts it). When
  several workers need a layer, the runtime relays each chunk down a chain through them
  (``LayerTransfer.hop``) in pieces, each forwarded once it has arrived: the chain's last node
  has it (crossings - 1) pieces after a direct copy would, which ``copy_seconds`` adds (the
  longest chain's).
- Gradient synchronisation once per iteration: a ring all-reduce of ``bytes`` over k participants
  costs ``2 (k - 1) / k * bytes / bandwidth``; inside a stage over its g devices (in-node), and of
  every layer across the k pipelines (cross-node). The two run one after the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from oobleck.planning.inputs import ModelProfile
from oobleck.planning.outputs import LayerTransfer

# fp32 parameters, fp32 gradients and Adam's two fp32 moments: 4 * 4 bytes per parameter.
OPTIMIZER_BYTES_PER_PARAM = 16
# Adam state is 4 bytes per parameter copy in LayerProfile.param_bytes (fp32), hence the factor.
STATE_BYTES_PER_PARAM_BYTE = OPTIMIZER_BYTES_PER_PARAM // 4
# Bytes a reconfiguration copies per fp32 parameter byte: the parameter and Adam's two moments.
MOVED_BYTES_PER_PARAM_BYTE = 3
# Backward of a transformer layer costs about twice its forward (Narayanan et al., SC'21).
DEFAULT_FORWARD_FRACTION = 1.0 / 3.0


def bottleneck_index(stage_seconds: Sequence[float]) -> int:
    """k*: the rightmost stage with the largest time."""
    best = 0
    for index, value in enumerate(stage_seconds):
        if value >= stage_seconds[best]:
            best = index
    return best


def eq14_line(stage_seconds: Sequence[float]) -> tuple[float, float]:
    """Eq. 1-4 as ``intercept + slope * m``: every evaluation of it goes through this one line, so
    a time and the capacity derived from it can never disagree by a rounding."""
    stages = len(stage_seconds)
    if stages == 0:
        raise ValueError("a pipeline needs at least one stage")
    k = bottleneck_index(stage_seconds)
    slope = float(stage_seconds[k])
    intercept = float(sum(stage_seconds)) + float(sum(stage_seconds[k:])) + (k - stages - 1) * slope
    return intercept, slope


def pipeline_iteration_time(stage_seconds: Sequence[float], microbatches: int) -> float:
    """Eq. 1-4 of the paper: ``T1 + T2 + T3`` with k* the rightmost slowest stage (any m)."""
    intercept, slope = eq14_line(stage_seconds)
    return intercept + slope * microbatches


def exact_1f1b_makespan(
    stage_seconds: Sequence[float], microbatches: int, forward_fraction: float = DEFAULT_FORWARD_FRACTION
) -> float:
    """Longest path through the 2*m*S operations of a 1F1B schedule (forward = fraction of w).

    Stage i runs ``min(S - i - 1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. F(i, j) waits for F(i-1, j); B(i, j) waits for
    B(i+1, j) and, through the stage's own order, for F(i, j).
    """
    stages = len(stage_seconds)
    m = microbatches
    if m <= 0:
        return 0.0
    fwd = [w * forward_fraction for w in stage_seconds]
    bwd = [w - f for w, f in zip(stage_seconds, fwd)]
    if m == 1 and min(fwd) >= 0 and min(bwd) >= 0:
        # One microbatch goes down and back up with nothing to wait for: each operation starts
        # when its dependency ends (a stage's clock is its own forward, never later than the
        # backward it waits on, as no duration is negative), so the loop below would add the
        # forwards, then the backwards last stage first, one at a time from 0.0. The same
        # additions in the same order give its result to the last bit (instantiation asks every
        # template for m = 1 when it tests whether a pipeline can take one microbatch).
        end = 0.0
        for duration in fwd:
            end = end + duration
        for duration in reversed(bwd):
            end = end + duration
        return end
    # Every operation ends at max(its stage's clock, its dependency's end) + its duration, so the
    # ends do not depend on the order stages are advanced in: a stage runs until it waits on a
    # neighbour, and a stage that made progress wakes its neighbours (one pass over the 2 m S
    # operations, where sweeping every stage until none progresses costs a sweep per step).
    # Operations are ints: forward j is j, backward j is -(j + 1).
    orders = []
    for i in range(stages):
        warmup = min(stages - i - 1, m)
        order = list(range(warmup))
        next_f = warmup
        for j in range(m):
            if next_f < m:
                order.append(next_f)
                next_f += 1
            order.append(-(j + 1))
        orders.append(order)
    f_end = [[-1.0] * m for _ in range(stages)]
    b_end = [[-1.0] * m for _ in range(stages)]
    position = [0] * stages
    clock = [0.0] * stages
    remaining = 2 * m * stages
    last = stages - 1
    awake = list(range(stages - 1, -1, -1))
    while awake:
        i = awake.pop()
        order, at, now = orders[i], position[i], clock[i]
        mine_f, mine_b = f_end[i], b_end[i]
        before = f_end[i - 1] if i else None
        after = b_end[i + 1] if i < last else mine_f
        while at < len(order):
            op = order[at]
            if op >= 0:
                ready = 0.0 if before is None else before[op]
                if ready < 0:
                    break
                now = (now if now > ready else ready) + fwd[i]
                mine_f[op] = now
            else:
                j = -op - 1
                ready = after[j]
                if ready < 0:
                    break
                now = (now if now > ready else ready) + bwd[i]
                mine_b[j] = now
            at += 1
        if at > position[i]:
            remaining -= at - position[i]
            position[i], clock[i] = at, now
            if i < last:
                awake.append(i + 1)
            if i:
                awake.append(i - 1)
    if remaining:  # cannot happen for a well-formed 1F1B order; guard against a silent hang
        raise RuntimeError("1F1B schedule deadlocked")
    return max(clock)


@lru_cache(maxsize=4096)
def _exact_cached(stage_seconds: tuple[float, ...], microbatches: int) -> float:
    return exact_1f1b_makespan(stage_seconds, microbatches)


def pipeline_time(stage_seconds: Sequence[float], microbatches: int) -> float:
    """The planner's prediction: Eq. 1-4 for m >= S, the exact makespan capped by Eq. 1-4(S) below.

    Nondecreasing in m, never above ``exact_1f1b_makespan``, and 0 for m = 0 (no work).
    """
    stages = len(stage_seconds)
    if microbatches <= 0:
        return 0.0
    intercept, slope = eq14_line(stage_seconds)
    if microbatches >= stages:
        return intercept + slope * microbatches
    cap = intercept + slope * stages
    return min(_exact_cached(tuple(float(w) for w in stage_seconds), microbatches), cap)


def ring_allreduce_seconds(nbytes: float, participants: int, bandwidth: float) -> float:
    """Ring all-reduce: each participant sends and receives 2 (k-1)/k of the buffer."""
    if participants <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (participants - 1) / participants * nbytes / bandwidth


def copy_seconds(copies: Iterable[LayerTransfer | tuple[int, int, float]], inter_bandwidth: float) -> float:
    """Seconds the runtime takes to carry out a reconfiguration's copies (see the module docstring):
    ``LayerTransfer``s, or ``(source node, target node, parameter bytes)`` copies made directly.

    The busiest node's cross-node bytes, in or out, over the cross-node bandwidth; a chunk relayed
    down a chain (``LayerTransfer.hop``) crossing d nodes in p pieces arrives d - 1 pieces after
    its first piece could have (each relay forwards a piece once it has it), the longest such
    wait added."""
    rows = (
        (c.layer, c.source[0], c.target[0], c.chunk, c.nbytes, c.hop, c.pieces)
        if isinstance(c, LayerTransfer)
        else (-1, c[0], c[1], 0, c[2], 0, 1)
        for c in copies
    )
    return chain_copy_seconds(rows, inter_bandwidth)


def chain_copy_seconds(rows: Iterable[tuple[int, int, int, int, float, int, int]], inter_bandwidth: float) -> float:
    """``copy_seconds`` of ``(layer, source node, target node, chunk, parameter bytes, hop, pieces)``
    rows (the planner's own form, before it builds ``LayerTransfer``s)."""
    into: dict[int, float] = {}
    out: dict[int, float] = {}
    crossings: dict[tuple[int, int], int] = {}
    piece: dict[tuple[int, int], float] = {}
    for layer, source, target, chunk, nbytes, hop, pieces in rows:
        if pieces > 1 or hop > 0:
            chain = (layer, chunk)
            crossings[chain] = crossings.get(chain, 0) + (source != target)
            piece[chain] = nbytes / pieces
        if source != target:
            into[target] = into.get(target, 0.0) + nbytes
            out[source] = out.get(source, 0.0) + nbytes
    busiest = max([*into.values(), *out.values()], default=0.0)
    fill = max((max(count - 1, 0) * piece[chain] for chain, count in crossings.items()), default=0.0)
    return MOVED_BYTES_PER_PARAM_BYTE * (busiest + fill) / inter_bandwidth


def stage_param_bytes(profile: ModelProfile, start: int, end: int) -> int:
    return sum(layer.param_bytes for layer in profile.layers[start:end])


def stage_memory_bytes(
    profile: ModelProfile, start: int, end: int, gpus: int, stage_index: int, num_stages: int
) -> float:
    """Peak bytes on one device of stage ``stage_index`` (of ``num_stages``) holding ``[start, end)``."""
    layers = profile.layers[start:end]
    state = STATE_BYTES_PER_PARAM_BYTE * sum(layer.param_bytes for layer in layers)
    in_flight = num_stages - stage_index
    activations = sum(layer.activation_bytes for layer in layers) * in_flight / gpus
    return float(state + activations)


class ProfileArrays:
    """Prefix sums of a profile, so any stage's cost and memory is O(1) (and vectorisable)."""

    def __init__(self, profile: ModelProfile):
        layers = profile.layers
        self.num_layers = len(layers)
        self.layer_compute = np.array([l.forward_s + l.backward_s for l in layers], dtype=np.float64)
        self.compute = np.concatenate(([0.0], np.cumsum(self.layer_compute)))
        self._runs()
        self.params = np.concatenate(([0], np.cumsum([l.param_bytes for l in layers]))).astype(np.float64)
        self.activations = np.concatenate(([0], np.cumsum([l.activation_bytes for l in layers]))).astype(np.float64)
        self.output_bytes = np.array([l.output_bytes for l in layers], dtype=np.float64)

    def _runs(self) -> None:
        """Consecutive layers of equal compute form a run (``span_compute``)."""
        per_layer, L = self.layer_compute, self.num_layers
        starts_run = np.ones(L, dtype=bool)
        if L > 1:
            starts_run[1:] = per_layer[1:] != per_layer[:-1]
        self.run_of = np.cumsum(starts_run) - 1  # run index of every layer
        self.run_start = np.flatnonzero(starts_run)
        self.run_end = np.append(self.run_start[1:], L)
        self.run_value = per_layer[self.run_start]
        # Full runs [0, q): their compute, summed run by run (one fixed order per pair of runs).
        self.run_total = np.concatenate(([0.0], np.cumsum((self.run_end - self.run_start) * self.run_value)))

    def span_compute(self) -> np.ndarray:
        """``[start, end]``: the compute of layers ``[start, end)`` (0 where start >= end), as a
        function of the range's *signature* only: consecutive layers of equal compute form a run,
        and a range is summed as (layers it takes of its first run) * their compute + the full
        runs between + (layers of its last run) * theirs. Equal ranges at different positions of
        a run of identical layers (every decoder block of a GPT) then take bit-identical times,
        so the template search meets each distinct stage time once, with every such stage as a
        candidate bottleneck, instead of once per rounding of a prefix-sum difference.
        ``compute_s`` is the same sum for one range, by the same float operations."""
        L = self.num_layers
        span = np.zeros((L + 1, L + 1))
        if L == 0:
            return span
        s, e = np.triu_indices(L + 1, 1)
        first, last = self.run_of[s], self.run_of[e - 1]
        same = first == last
        head = (np.minimum(self.run_end[first], e) - s) * self.run_value[first]
        total = self.run_total
        middle = total[np.maximum(last, first + 1)] - total[np.minimum(first + 1, last)]
        tail = (e - self.run_start[last]) * self.run_value[last]
        span[s, e] = np.where(same, head, (head + middle) + tail)
        return span

    def compute_s(self, start: int, end: int) -> float:
        """The compute of layers ``[start, end)``, exactly as ``span_compute`` sums it."""
        if end <= start:
            return 0.0
        first, last = int(self.run_of[start]), int(self.run_of[end - 1])
        head = float((min(int(self.run_end[first]), end) - start) * self.run_value[first])
        if first == last:
            return head
        middle = float(self.run_total[last] - self.run_total[first + 1])
        return (head + middle) + float((end - int(self.run_start[last])) * self.run_value[last])

    def state_bytes(self, start: int, end: int) -> float:
        return STATE_BYTES_PER_PARAM_BYTE * float(self.params[end] - self.params[start])

    def activation_bytes(self, start: int, end: int) -> float:
        return float(self.activations[end] - self.activations[start])


def link_seconds(output_bytes: float, link: int, intra_bandwidth: float, inter_bandwidth: float) -> float:
    """Boundary transfer of one microbatch (activation forward + its gradient backward).

    ``link``: 0 = last stage (no boundary), 1 = next stage on the same node, 2 = on another node.
    """
    if link == 0:
        return 0.0
    bandwidth = intra_bandwidth if link == 1 else inter_bandwidth
    return 2.0 * output_bytes / bandwidth


LINK_NONE, LINK_INTRA, LINK_INTER = 0, 1, 2
