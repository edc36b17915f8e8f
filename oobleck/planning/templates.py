"""Pipeline templates: the best stage layout for every node count, found by an exact DP.

A template for ``n`` nodes splits the layers into contiguous stages; each stage runs on ``g`` GPUs
of one node (1 <= g <= G, never spanning nodes); a node may host several consecutive stages and
every GPU of every node is used. Templates are ranked by Eq. 1-4 at ``m = r * S`` microbatches
(``r = reference_microbatches_per_stage``, the paper's 4), subject to per-device memory.

Why the DP enumerates the bottleneck. With W the slowest stage time and k its (rightmost) index,
Eq. 1-4 at m = r*S rewrites as a sum over stages:

    T = sum_{i<k} (w_i + r W) + r W + sum_{i>k} (2 w_i + (r - 1) W)

Whether a sub-layout is best therefore depends on W and on which side of k it falls, not only on
its own time (keeping the locally best sub-plan, as the original divide-and-conquer did, is wrong).
For a fixed W the sum is additive, so the DP fixes W (ascending over the distinct stage times)
and places exactly one "marker" stage whose time equals W, stages to its right strictly faster
(k is the rightmost maximum) and stages to its left at most W. Every layout is counted exactly
once, at its own W, with its exact T; the minimum over W is the optimum. The sweep over W stops
for a node count once a lower bound, ``max(2 D + ((r-1) S - 1) W, ((r-1) S + 1) W)``, reaches the
best T found. Both follow from Eq. 1-4, T = sum w + ((r-1)S - 1) W + k W + sum_{i>=k} w_i, with S
at least n and at least the stages memory forces (``_fewest_stages``), and D <= sum w: the total
compute C over G, or spread over the n G GPUs with no stage holding more than memory lets it
(``node_bounds._spread``), plus the cheapest cross-node boundary per node boundary.

The DP runs right to left over layers; its state is (layers left, stages placed, nodes still to
open, GPUs used on the current node, marker placed). Stages placed is needed because memory
depends on it (stage i of S keeps S - i microbatches in flight); it is compressed to the
largest in-flight count at which the memory limit of any stage the DP may place binds. For one
W only stages with w <= W are placed, and those are short, so at most thresholds the count
drops out of the state altogether (``_StageTable.compressions_within``).

Equal layers, equal times. A stage's compute is summed by its signature (``ProfileArrays.
span_compute``: so many layers of this run, the full runs between, so many of that run), not as a
difference of prefix sums, so equal ranges of identical layers (every decoder block of a GPT) take
bit-identical times wherever they sit. Each distinct stage time is then one candidate W with every
such stage among its markers, where prefix sums split it into several W a few ulps apart and ran
the search once for each (1,315 candidates for 100 layers on nodes of 8 GPUs instead of 766).

Speed without giving up exactness (branch and bound): both searches start from the best layout with
one full-node stage per node (a cheap min-max partition) as an upper bound and look only for
strictly better layouts; a sub-search that cannot beat its budget stops and is memoised as a lower
bound. The template search first improves that seed's T by a short descent over its boundaries
(``_descend``): the min-max layout is often a few tenths of a percent above the optimum in T, and
only a budget within about 0.1% of it rules out most thresholds before any search (on the
realistic profile that halves the time). Node counts for which memory rules that seed out are
first searched at the few thresholds the node-level bound below rates best
(``PROBE_THRESHOLDS``), so the ascending sweep meets most thresholds with a budget near the
optimum. Most thresholds never reach the DP: a W is skipped when
no stage of time W can be the bottleneck of a better layout, first by a compute bound
(``_promising_markers``), then, for the few markers of distinct layers, by a per-marker node
relaxation (``_marker_bounds``), then by the node-level chain bound of
``oobleck.planning.node_bounds`` for every node count at once (``root_bounds``: whole nodes,
one-stage nodes exact, split nodes bounded by their compute, links and the stages memory forces; the
one bound that scales when equal layers put a marker at every position). Where memory forces more
stages than nodes, the sweep also counts the stages a threshold forces: feasibility is monotone in
the bottleneck, so the least slowest stage of layouts with at most s stages (one bottleneck DP with
a stage cap, reused by every threshold) tells which thresholds need more than s, and ``lower_bound``
with that many stages rules them out. Where memory allows one stage per node, the seed's slowest
stage is that least value for n stages on n nodes (one stage of all G GPUs per node), so a threshold
below it forces n + 1 stages, without a DP; and below the floor under the slowest stage of layouts
with at most e nodes of two or more stages (``node_bounds.split_node_floors``: whole nodes exact,
split nodes at their compute floor, one DP for every node count and e), more than n + e (on gpt128
that rules out half the thresholds that reached the chain bound). For node counts where memory forces more stages than
nodes, a threshold the compute and per-marker bounds leave meets ``_GpuRelaxation`` before the chain
bound: the additive form above over stages, with exact stage times, GPU counts, node boundaries and
marker, and only the microbatches in flight relaxed (to what the nodes to the right and memory on
the layers after force), one numpy pass for every node count; it is the exact best T wherever memory
does not bind and, on memory-tight profiles, almost always (85 of 86 seeded checks), so it decides
most searches there that would find nothing (gpt128: 98 of 130). Inside the DP, the unexplored
prefix [0, a) is bounded by the same node-level tables (``PrefixBounds``: whole nodes, or the rest
of the current node then whole nodes; built for the power of two at or below the stages' in-flight
count, since fewer in flight only loosens memory and a looser admissible bound changes no search's
result, so a search builds a handful where memory binds at many counts), and a state that has not
placed the marker yet is bounded through the markers still ahead of it. The exactness tests compare
against brute force over every layout (the bounds themselves too:
``tests/planning/test_node_bounds.py``), and medium cases against slower searches of earlier
versions; benchmarks/bench_planner.py measures the speed. Where memory forces several narrow stages
per node (few nodes for a large model), the node-level bounds are loosest and most of the time goes
there; what memory forces at the stages' in-flight counts narrows it
(``_StageTable.memory_stage_counts`` and, where few GPUs are left, ``gpu_stage_counts``: narrow
stages keep few layers): the rest of a state needs at least that many stages, each costing (r-1)W or
more, and the marker keeps at most its own memory limit in flight, so it lies within that many
stages of the pipeline's end. With r = 1 extra stages cost nothing in Eq. 1-4 (the (r-1) W per stage
vanishes), the bounds lose most of their grip and the search takes seconds where r = 4 takes a
fraction of one.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oobleck.errors import PlanningError
from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.node_bounds import (
    BOUND_SLACK,
    NodeCosts,
    NodeGeometry,
    PrefixBounds,
    _spread,
    bottleneck_floor,
    root_bounds,
    split_node_floors,
)
from oobleck.planning.outputs import PipelineTemplate, StageSpec
from oobleck.planning.pipeline_cost import (
    LINK_INTER,
    LINK_INTRA,
    LINK_NONE,
    ProfileArrays,
    link_seconds,
    pipeline_iteration_time,
)

INF = math.inf
# Above this many candidate bottleneck stages at one threshold, the per-marker node bound
# (``_marker_bounds``, Python per marker) costs more than the chain bound it precedes.
MARKER_BOUND_LIMIT = 4
# Node counts without a seed layout are first searched at the thresholds, of PROBE_THRESHOLDS
# spread over the candidates, that the node-level bound rates best, until one has a layout (at
# most PROBE_ATTEMPTS).
PROBE_THRESHOLDS = 64
PROBE_ATTEMPTS = 8
# Stage counts forced by memory on the GPUs left (``_StageTable.gpu_stage_counts``) are kept for
# up to this many nodes' GPUs (the table grows with it): memory forces narrow stages of few layers
# where few nodes hold a large model, the searches that find nothing there are what they prune,
# and with more GPUs left the count on the widest stages (``memory_stage_counts``) is as good.
STAGE_COUNT_NODES = 4
# Where memory allows one stage per node, the sweep tells thresholds that force more than
# n + e stages on n nodes for e up to this (``node_bounds.split_node_floors``; one DP whose cost
# grows with it): past it the chain bound decides (on gpt128, gpt100 and the realistic profile
# no threshold needed more).
MOST_SPLITS = 8
# The seeds (one stage per node, least slowest stage) are improved by moving the boundaries of at
# most this many consecutive stages one layer at a time (``_descend``): the searches look only
# for layouts strictly better than their budget, so a budget near the optimum skips most of them
# (realistic 64 x 8: a budget within 0.1% of the optimum halves the time; block moves longer than
# one boundary gain little more on the profiles measured and cost more).
DESCENT_BLOCK = 1


@dataclass(frozen=True)
class TemplateProgress:
    """How far template generation has come: ``settled`` of ``node_counts`` node counts can no
    longer improve, and the sweep is at candidate bottleneck ``threshold`` of ``thresholds``
    (ascending; most node counts settle long before the last)."""

    settled: int
    node_counts: int
    threshold: int
    thresholds: int


@dataclass(frozen=True)
class TemplateSet:
    """Templates by node count, for node counts ``min_nodes .. max_nodes`` that have one."""

    min_nodes: int  # n0
    max_nodes: int  # N - f * n0 at generation time
    templates: dict[int, PipelineTemplate] = field(default_factory=dict)
    num_layers: int = 0
    gpus_per_node: int = 1
    # Parameter bytes of every layer: what reconfiguration moves when a layer changes holder.
    layer_param_bytes: tuple[int, ...] = ()
    # The cluster's links (bytes/s), for the gradient-sync terms of a plan's predicted time.
    intra_node_bandwidth: float = 1e10
    inter_node_bandwidth: float = 1e9
    # Results of pure planner functions of this (immutable) set, e.g. the best template sizes per
    # node count (``instantiate._best_multiset``): a simulation asks the same few questions at
    # every membership change. Not part of the set's value: excluded from eq, repr and to_dict.
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.templates))

    def __getitem__(self, nodes: int) -> PipelineTemplate:
        try:
            return self.templates[nodes]
        except KeyError:
            raise PlanningError(
                f"no pipeline template for {nodes} nodes; templates exist for {list(self.sizes)}"
            ) from None

    def __contains__(self, nodes: int) -> bool:
        return nodes in self.templates

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "num_layers": self.num_layers,
            "gpus_per_node": self.gpus_per_node,
            "layer_param_bytes": list(self.layer_param_bytes),
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "templates": {str(n): asdict(t) for n, t in sorted(self.templates.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TemplateSet:
        templates = {int(key): PipelineTemplate.from_dict(t) for key, t in data["templates"].items()}
        return cls(
            min_nodes=data["min_nodes"],
            max_nodes=data["max_nodes"],
            templates=templates,
            num_layers=data.get("num_layers", 0),
            gpus_per_node=data.get("gpus_per_node", 1),
            layer_param_bytes=tuple(data.get("layer_param_bytes", ())),
            intra_node_bandwidth=float(data.get("intra_node_bandwidth", 1e10)),
            inter_node_bandwidth=float(data.get("inter_node_bandwidth", 1e9)),
        )


class _StageTable:
    """Every candidate stage's time and memory limit, as lists indexed for the DP's inner loop.

    For a stage ending at layer ``end`` on ``g`` GPUs with outgoing link ``link``:
    ``cost[g][link][end][start]`` is w (decreasing as start grows smaller), and
    ``cap[g][end][start]`` the most microbatches it may keep in flight within memory.
    """

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, stage_gpu_limit: int):
        # Every node runs at least this many stages (planner.max_gpus_per_stage below G).
        self.stages_per_node = -(-cluster.gpus_per_node // stage_gpu_limit)
        self.stage_gpu_limit = min(stage_gpu_limit, cluster.gpus_per_node)
        self.arrays = arrays = ProfileArrays(profile)
        max_gpus = cluster.gpus_per_node
        self.cluster = cluster
        L = arrays.num_layers
        self.num_layers = L
        self.max_gpus = max_gpus
        ends = np.arange(L + 1)
        compute = arrays.span_compute()  # [start, end]: equal for equal ranges of identical layers
        state = 4.0 * (arrays.params[None, :] - arrays.params[:, None])
        acts = arrays.activations[None, :] - arrays.activations[:, None]
        out = np.concatenate(([0.0], arrays.output_bytes))  # output bytes of the layer before `end`
        self.cost: list[list[list[list[float]]]] = [[] for _ in range(max_gpus + 1)]
        self.cap: list[list[list[float]]] = [[] for _ in range(max_gpus + 1)]
        memory = cluster.device_memory_bytes
        values, starts, stage_ends, widths, links, limits = [], [], [], [], [], []
        # cost_stack[g, link, start, end]: the same w for vectorised threshold counts; -inf where
        # start >= end (no stage), so it never counts as slower than a threshold.
        self.cost_stack = np.full((max_gpus + 1, 3, L + 1, L + 1), -INF)
        below = np.tril(np.ones((L + 1, L + 1), dtype=bool))
        upper = np.triu_indices(L + 1, 1)  # every stage [start, end)
        binding_costs: list[np.ndarray] = [np.zeros(0)]
        binding_caps: list[np.ndarray] = [np.zeros(0)]
        for g in range(1, max_gpus + 1):
            with np.errstate(divide="ignore", invalid="ignore"):
                cap = np.where(acts > 0, np.floor((memory - state) * g / np.where(acts > 0, acts, 1.0)), INF)
            cap = np.where(state > memory, 0.0, cap)
            cap = np.maximum(cap, 0.0)
            if g > stage_gpu_limit:  # planner.max_gpus_per_stage: such a stage never fits
                cap = np.zeros_like(cap)
            self.cap[g] = [cap[:end, end].tolist() for end in ends]
            finite = cap[upper]
            binds = (finite < L) & (finite >= 1)
            if binds.any():
                # Keyed by the stage's fastest time (no outgoing link): no search below it places it.
                binding_costs.append((compute / g)[upper][binds])
                binding_caps.append(finite[binds])
            for link in (LINK_NONE, LINK_INTRA, LINK_INTER):
                comm = np.array(
                    [
                        link_seconds(out[end], link, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
                        for end in ends
                    ]
                )
                table = compute / g + comm[None, :]
                self.cost_stack[g, link] = np.where(below, -INF, table)
                per_end = [table[:end, end].tolist() for end in ends]
                self.cost[g].append(per_end)
                # Only real stages are bottleneck candidates: the last stage has no link, others have one.
                real = (upper[1] == L) if link == LINK_NONE else (upper[1] < L)
                keep = (cap[upper] >= 1) & real
                values.append(table[upper][keep])
                starts.append(upper[0][keep])
                stage_ends.append(upper[1][keep])
                widths.append(np.full(int(keep.sum()), g))
                links.append(np.full(int(keep.sum()), link))
                limits.append(cap[upper][keep])
        # Stages whose memory limit binds (1 <= limit < L in-flight microbatches), sorted by
        # their fastest time, with a running maximum of their limits: ``compressions_within``.
        costs, caps = np.concatenate(binding_costs), np.concatenate(binding_caps)
        order = np.argsort(costs, kind="stable")
        self._binding_costs = costs[order]
        self._binding_running_max = np.maximum.accumulate(caps[order]) if caps.size else caps
        # Every real stage sorted by time: the bottleneck candidates W, and for each W the stages
        # ("markers") whose time is exactly W.
        all_costs = np.concatenate(values)
        order = np.argsort(all_costs, kind="stable")
        self.marker_costs = all_costs[order]
        self.marker_starts = np.concatenate(starts)[order]
        self.marker_ends = np.concatenate(stage_ends)[order]
        self.marker_gpus = np.concatenate(widths)[order]
        self.marker_links = np.concatenate(links)[order]
        self.marker_caps = np.concatenate(limits)[order]  # the most in flight each keeps
        self.candidates = np.unique(self.marker_costs)
        self._memory_counts: tuple[np.ndarray, np.ndarray, list[list[float]]] | None = None
        self._gpu_counts: list[list[list[float]]] | None = None
        self._marker_counts: tuple[np.ndarray, np.ndarray] | None = None
        self._stage_bands: _StageBands | None = None
        self._node_geometry: NodeGeometry | None = None
        self._cap_matrices: dict[int, np.ndarray] = {}
        self.total_compute = float(arrays.compute[-1])
        self.compute_prefix: list[float] = arrays.compute.tolist()  # compute of layers [0, i)
        # Every node boundary costs at least this much (the cheapest boundary tensor, cross-node).
        boundaries = arrays.output_bytes[:-1]
        self.min_cross_link = (
            link_seconds(
                float(boundaries.min()), LINK_INTER, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth
            )
            if boundaries.size
            else 0.0
        )

    def memory_stage_counts(self) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
        """How many stages memory alone forces, on as many GPUs as a stage may have (stage i of S
        keeps S - i microbatches in flight; a stage of fewer layers needs less memory, so the
        longest stage that fits at each step covers with fewest, as in ``_fewest_stages``):

        - ``after[e]``: the fewest stages covering layers [e, L) as the last stages of a layout
          (the j-th from the right keeps j in flight); INF where none fits;
        - ``before[j, s]`` (j = 0 .. L + 1): the fewest stages covering [0, s) when the first of
          them from the right keeps j + 1 in flight; INF where none fits; and the same as lists.

        Exact where j + s <= L, the only states a layout reaches (j stages hold j layers or
        more); beyond, a count may be INF where very many stages would fit.
        """
        if self._memory_counts is None:
            L = self.num_layers
            first = self._first_starts_keeping(self.stage_gpu_limit)
            positions = np.arange(L + 1)
            before = np.full((L + 3, L + 1), INF)  # row L + 2: past any layout (INF but at 0)
            before[:, 0] = 0.0
            for j in range(L + 1, -1, -1):
                reach = first[j]
                fits = reach < positions
                before[j, 1:] = np.where(fits, 1 + before[j + 1][np.where(fits, reach, 0)], INF)[1:]
            after = np.full(L + 1, INF)
            after[L] = 0.0
            end, count = L, 0
            while end > 0:
                start = int(first[count, end])
                if start >= end:
                    break
                count += 1
                after[start:end] = count
                end = start
            self._memory_counts = (after, before[: L + 2], before[: L + 2].tolist())
        return self._memory_counts

    def marker_stage_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """For every marker (in the order of ``marker_costs``), what memory forces around it as
        the bottleneck: ``after``, the fewest stages following it (``memory_stage_counts``); it
        keeps one more in flight than those, and the stage before it one more again, so
        ``before``, the fewest stages before it; INF where its memory cannot keep that many in
        flight or nothing can cover what lies before it."""
        if self._marker_counts is None:
            after, before, _ = self.memory_stage_counts()
            following = after[self.marker_ends]
            fits = self.marker_caps >= following + 1
            rows = np.where(fits, following + 1, 0).astype(np.int64)
            preceding = np.where(fits, before[rows, self.marker_starts], INF)
            self._marker_counts = (following, preceding)
        return self._marker_counts

    def gpu_stage_counts(self, most_gpus: int) -> list[list[list[float]]]:
        """``[j][u][s]`` (u = 0 .. ``most_gpus``): the fewest stages covering layers [0, s) on at
        most u GPUs in all when the first of them from the right keeps j + 1 microbatches in
        flight, each within memory (node boundaries and time ignored); INF where none fits.
        Where GPUs are few, memory forces narrow stages of few layers: many more stages than on
        the widest GPUs (``memory_stage_counts``). Fewer layers to cover never need more
        stages, so for each width of the next stage its longest that fits is best. Computed,
        and exact, where j + s <= L (``memory_stage_counts``); INF beyond."""
        if self._gpu_counts is None or len(self._gpu_counts[0]) <= most_gpus:
            L, U = self.num_layers, most_gpus
            positions = np.arange(L + 1)
            counts = np.full((L + 3, U + 1, L + 1), INF)  # row L + 2: past any layout
            counts[:, :, 0] = 0.0
            widths = range(1, min(self.stage_gpu_limit, U) + 1)
            firsts = {g: self._first_starts_keeping(g) for g in widths}
            for j in range(L - 1, -1, -1):
                # Only s <= L - j: the entries those read lie in the same triangle.
                row, following, most = counts[j], counts[j + 1], L - j
                for g in widths:
                    reach = firsts[g][j, : most + 1]
                    fits = reach < positions[: most + 1]
                    taken = 1 + following[: U + 1 - g][:, reach[fits]]
                    part = row[g:, : most + 1]
                    part[:, fits] = np.minimum(part[:, fits], taken)
            self._gpu_counts = counts[: L + 2].tolist()
        return self._gpu_counts

    def cap_matrix(self, gpus: int) -> np.ndarray:
        """``cap`` of stages on ``gpus`` GPUs as an array ``[start, end]`` (0 where start >= end;
        made on first use)."""
        if gpus not in self._cap_matrices:
            L = self.num_layers
            matrix = np.zeros((L + 1, L + 1))
            for end in range(1, L + 1):
                matrix[:end, end] = self.cap[gpus][end]
            self._cap_matrices[gpus] = matrix
        return self._cap_matrices[gpus]

    def node_geometry(self) -> NodeGeometry:
        """The node bounds' threshold-independent arrays (made on first use, shared by the
        feasibility floors and the sweep)."""
        if self._node_geometry is None:
            self._node_geometry = NodeGeometry(self, self.cluster)
        return self._node_geometry

    def stage_bands(self) -> _StageBands:
        """The stage table as bands for ``_GpuRelaxation`` (made on first use)."""
        if self._stage_bands is None:
            self._stage_bands = _StageBands(self)
        return self._stage_bands

    def _first_starts_keeping(self, gpus: int) -> np.ndarray:
        """``[j, end]`` (j = 0 .. L + 1): the first start of a stage ending at ``end`` on ``gpus``
        GPUs that keeps j + 1 microbatches in flight within memory (``end`` where none does)."""
        L = self.num_layers
        first = np.zeros((L + 2, L + 1), dtype=np.int64)
        wanted = np.arange(1, L + 3)
        for end in range(1, L + 1):
            first[:, end] = np.searchsorted(np.asarray(self.cap[gpus][end], dtype=float), wanted, side="left")
        return first

    def first_starts_within(self, limit: float) -> list[list[list[int]]]:
        """``[g][link][end]``: the smallest start with w(start, end) <= limit, for every stage end
        at once (costs grow as start shrinks: it is the count of starts with w > limit)."""
        return (self.cost_stack > limit).sum(axis=2).tolist()

    def compressions_within(self, limit: float) -> list[int]:
        """``compress`` for DPs that only place stages with w <= limit: only those stages' memory
        limits can bind, so far fewer in-flight counts need telling apart (often none)."""
        count = int(np.searchsorted(self._binding_costs, limit, side="right"))
        binding = int(self._binding_running_max[count - 1]) if count else 0
        return [min(placed, max(binding, 1)) for placed in range(self.num_layers + 2)]


class _StageBands:
    """Every stage that fits memory with one microbatch in flight, indexed by length and start:
    ``[d, s]`` is the stage [s, s + d + 1) (``ends``; L + 1, an INF slot, past the last layer).
    ``w[g, link, d, s]`` is its time, ``cap[g, d, s]`` the most it keeps in flight, and
    ``need[d, s]`` the fewest microbatches it keeps whatever the layout: one more than the fewest
    stages that cover what follows it (``_StageTable.memory_stage_counts``)."""

    def __init__(self, table: _StageTable):
        L, widest = table.num_layers, table.stage_gpu_limit
        positions = np.arange(L + 1)
        caps = np.zeros((widest + 1, L + 1, L + 1))
        for g in range(1, widest + 1):
            caps[g] = table.cap_matrix(g)
        fits = (caps >= 1) & (positions[None, :, None] < positions[None, None, :])
        longest = max(int(np.where(fits, positions[None, None, :] - positions[None, :, None], 0).max()), 1)
        ends = np.arange(1, longest + 1)[:, None] + positions[None, :]
        inside = ends <= L
        clipped = np.minimum(ends, L)
        starts = np.broadcast_to(positions[None, :], ends.shape)
        self.ends = np.where(inside, ends, L + 1)
        self.cap = np.where(inside[None], caps[:, starts, clipped], 0.0)
        self.w = np.where(inside[None, None], table.cost_stack[: widest + 1, :, starts, clipped], INF)
        after = table.memory_stage_counts()[0]
        self.need = np.where(inside, after[clipped] + 1, INF)
        self.longest = longest


class _GpuRelaxation:
    """Lower bounds of T at one threshold W for every node count up to ``max_nodes`` at once, from
    the additive form of Eq. 1-4 (module docstring) with exact stage times, GPU counts, node
    boundaries and the marker, and only the microbatches in flight relaxed.

    The state is (layers [0, a) still to cover, GPUs used so far from the right, marker placed):
    GPUs used decide whether the next stage opens a node (its link cross-node, or none for the
    pipeline's last stage) or shares the current one (intra-node, on at most the GPUs left), so
    the node structure is exact and one pass serves every node count (n nodes: all n G GPUs
    used). What it drops is the exact count of stages placed (the template DP keeps it, for
    memory): a stage keeps in flight at least one more than the nodes wholly right of it (one
    more again if its node already holds a stage right of it) and one more than the fewest stages
    that cover the layers after it (``_StageBands.need``), and only those counts are checked.
    Every layout the DP may find at W is a path here with its own T (summed in another order), so
    a node count whose bound reaches its budget needs no search. Where memory puts several stages
    on a node (few nodes for a large model) the node-level bounds know only the compute of a
    split node; this pass knows its stages, which is what decides the searches there that find
    nothing.
    """

    def __init__(self, table: _StageTable, gpus: int, W: float, r: int, markers: set[tuple[int, int, int]] | None):
        bands = table.stage_bands()
        self.gpus, self.rW = gpus, r * W
        # Only stages with w <= W are placed: no longer ones than the longest such.
        at_most = bands.w <= W
        length = int(np.flatnonzero(at_most.any(axis=(0, 1, 3)))[-1]) + 1 if at_most.any() else 1
        w, at_most = bands.w[:, :, :length], at_most[:, :, :length]
        self.ends, self.length = bands.ends[:length], length
        # The most each stage keeps in flight where that covers what follows it, else 0.
        self.room = np.where(bands.cap[:, :length] >= bands.need[:length][None], bands.cap[:, :length], 0.0)
        # Cost of a stage left of the marker and right of it.
        self.left = np.where(at_most, w + self.rW, INF)
        self.right = np.where(w < W, 2 * w + (r - 1) * W, INF)
        # The markers (stages of time exactly W the DP may take as the bottleneck), as arrays.
        exact = w == W
        if markers is not None:
            allowed = np.zeros(exact.shape, dtype=bool)
            listed = np.array(sorted(markers), dtype=np.int64).reshape(-1, 3)
            listed = listed[listed[:, 1] - listed[:, 0] <= length]
            allowed[listed[:, 2], :, listed[:, 1] - listed[:, 0] - 1, listed[:, 0]] = True
            exact &= allowed
        gpus_, links, lengths, starts = np.nonzero(exact)
        self.markers = (gpus_, lengths, starts, links)
        self._by_flight: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _costs(self, link: int, in_flight: int) -> tuple[np.ndarray, np.ndarray]:
        key = (link, in_flight)
        found = self._by_flight.get(key)
        if found is None:
            fits = self.room >= in_flight
            found = (np.where(fits, self.left[:, link], INF), np.where(fits, self.right[:, link], INF))
            self._by_flight[key] = found
        return found

    def bounds(self, max_nodes: int) -> np.ndarray:
        """``[n]`` (n = 0 .. max_nodes): no layout on n nodes with bottleneck W has a smaller T
        (INF: none exists)."""
        G, ends, length = self.gpus, self.ends, self.length
        L, widest = ends.shape[1] - 1, self.room.shape[0] - 1
        most_gpus = max_nodes * G
        m_gpus, m_length, m_start, m_link = self.markers
        m_end = m_start + m_length + 1
        # [used GPUs, a]: least cost of the stages placed over [a, L), marker not yet / already placed.
        open_ = np.full((most_gpus + 1, L + 2), INF)
        marked = np.full((most_gpus + 1, L + 2), INF)
        open_[0, L] = 0.0
        for used in range(most_gpus):
            before, after = open_[used], marked[used]
            reached = np.flatnonzero((before < INF) | (after < INF))
            if not reached.size:
                continue
            # Only stages ending where a state was reached: starts from ``first`` to ``last``.
            first, last = max(int(reached[0]) - length, 0), int(reached[-1])
            on_node = used % G
            link = LINK_NONE if used == 0 else (LINK_INTRA if on_node else LINK_INTER)
            in_flight = used // G + (2 if on_node else 1)
            most = min(widest, G - on_node, most_gpus - used)
            left, right = self._costs(link, in_flight)
            span = slice(first, last)
            near = ends[:, span]
            rows = slice(used + 1, used + most + 1)
            if after[first : last + length + 1].min() < INF:
                placed = (after[near] + left[1 : most + 1, :, span]).min(axis=1)
                np.minimum(marked[rows, span], placed, out=marked[rows, span])
            if before[first : last + length + 1].min() < INF:
                still = (before[near] + right[1 : most + 1, :, span]).min(axis=1)
                np.minimum(open_[rows, span], still, out=open_[rows, span])
                # The marker: rW, where it fits in flight (a few stages, placed one by one).
                chosen = (m_gpus <= most) & (m_link == link) & (self.room[m_gpus, m_length, m_start] >= in_flight)
                if chosen.any():
                    values = before[m_end[chosen]] + self.rW
                    np.minimum.at(marked, (used + m_gpus[chosen], m_start[chosen]), values)
        result = np.full(max_nodes + 1, INF)
        result[1:] = marked[G::G, 0][:max_nodes]
        return result


def _stage_links(stages: Sequence[StageSpec]) -> list[int]:
    links = []
    for i, stage in enumerate(stages):
        if i == len(stages) - 1:
            links.append(LINK_NONE)
        elif stages[i + 1].node == stage.node:
            links.append(LINK_INTRA)
        else:
            links.append(LINK_INTER)
    return links


def stage_seconds_of(profile: ModelProfile, cluster: ClusterSpec, stages: Sequence[StageSpec]) -> list[float]:
    """w_i of every stage of a layout (compute / g + boundary transfer), per the cost model."""
    arrays = ProfileArrays(profile)
    result = []
    for stage, link in zip(stages, _stage_links(stages)):
        out = arrays.output_bytes[stage.end - 1]
        comm = link_seconds(out, link, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
        result.append(arrays.compute_s(stage.start, stage.end) / stage.gpus + comm)
    return result


def stage_memories_of(profile: ModelProfile, stages: Sequence[StageSpec]) -> list[float]:
    arrays = ProfileArrays(profile)
    S = len(stages)
    return [
        arrays.state_bytes(s.start, s.end) + arrays.activation_bytes(s.start, s.end) * (S - i) / s.gpus
        for i, s in enumerate(stages)
    ]


def make_template(
    profile: ModelProfile, cluster: ClusterSpec, stages: Sequence[StageSpec], reference_microbatches_per_stage: int
) -> PipelineTemplate:
    """A template from a layout, with its cost-model figures computed from scratch."""
    stages = tuple(stages)
    seconds = stage_seconds_of(profile, cluster, stages)
    m = reference_microbatches_per_stage * len(stages)
    return PipelineTemplate(
        num_nodes=stages[-1].node + 1,
        stages=stages,
        stage_seconds=tuple(seconds),
        stage_memory_bytes=tuple(stage_memories_of(profile, stages)),
        reference_microbatches=m,
        reference_iteration_s=pipeline_iteration_time(seconds, m),
    )


def _one_stage_per_node(table: _StageTable, gpus: int, max_nodes: int) -> dict[int, list[tuple[int, int, int]]]:
    """For every n, the layout with one stage of all G GPUs per node that minimises the slowest
    stage (memory-feasible), right to left as the DPs return them. A quick upper bound that
    seeds both searches' budgets; the searches then only look for strictly better layouts."""
    L, G = table.num_layers, gpus
    cost = np.full((L + 1, L + 1, 2), INF)  # [start, end, last?]
    for end in range(1, L + 1):
        cost[:end, end, 0] = table.cost[G][LINK_INTER][end]
        cost[:end, end, 1] = table.cost[G][LINK_NONE][end]
    cap = table.cap_matrix(G)
    # best[k][a]: min slowest stage of [a, L) split into k one-node stages; choice[k][a]: end.
    best = np.full(L + 1, INF)
    best[L] = 0.0
    layouts: dict[int, list[tuple[int, int, int]]] = {}
    choices = []
    for k in range(1, min(max_nodes, L) + 1):
        link = 1 if k == 1 else 0
        # Stage [a, b) is the k-th from the end: k microbatches in flight.
        stage = np.where(cap >= k, cost[:, :, link], INF)
        candidate = np.maximum(stage, best[None, :])
        candidate[np.tril_indices(L + 1)] = INF  # b > a only
        choice = np.argmin(candidate, axis=1)
        best = candidate[np.arange(L + 1), choice]
        choices.append(choice)
        if best[0] < INF:
            a, stages = 0, []
            for level in range(k - 1, -1, -1):
                b = int(choices[level][a])
                stages.append((a, b, G))
                a = b
            layouts[k] = list(reversed(stages))
    return layouts


def _descend(
    table: _StageTable, gpus: int, r: int, layout: list[tuple[int, int, int]]
) -> tuple[float, list[tuple[int, int, int]]]:
    """A one-stage-per-node layout (right to left, as the DPs return them) improved by steepest
    descent on its T (Eq. 1-4 at m = r S): each step shifts the boundaries of up to
    ``DESCENT_BLOCK`` consecutive stages by one layer, keeping every stage within memory, and
    takes the move that lowers T most, until none does. Returns (T, layout). A heuristic: it
    only makes the searches' starting budgets tighter, never decides a template."""
    G, n = gpus, len(layout)
    bounds = np.array([0] + [end for _, end, _ in reversed(layout)])
    value = pipeline_iteration_time(_layout_seconds(table, layout, G), r * n)
    if n < 2:
        return value, layout
    cost = table.cost_stack[G]
    cap = table.cap_matrix(G)
    links = np.full(n, LINK_INTER)
    links[-1] = LINK_NONE
    in_flight = n - np.arange(n)  # stage i of S keeps S - i microbatches in flight
    first, last = np.triu_indices(n - 1)  # shift the boundaries first + 1 .. last + 1
    shift = last - first < DESCENT_BLOCK
    positions = np.arange(n + 1)[None, :]
    block = ((positions > first[shift, None]) & (positions <= last[shift, None] + 1)).astype(np.int64)
    moves = np.concatenate([block, -block])
    while True:
        candidates = bounds[None, :] + moves
        starts, ends = candidates[:, :-1], candidates[:, 1:]
        valid = (ends > starts).all(axis=1)
        candidates, starts, ends = candidates[valid], starts[valid], ends[valid]
        valid = (cap[starts, ends] >= in_flight[None, :]).all(axis=1)
        candidates, starts, ends = candidates[valid], starts[valid], ends[valid]
        if not len(candidates):
            break
        seconds = cost[links[None, :], starts, ends]
        choice = candidates[int(np.argmin(_additive_times(seconds, r)))]
        moved = [(int(choice[i]), int(choice[i + 1]), G) for i in range(n - 1, -1, -1)]
        moved_value = pipeline_iteration_time(_layout_seconds(table, moved, G), r * n)
        if not moved_value < value:
            break
        bounds, layout, value = choice, moved, moved_value
    return value, layout


def _additive_times(seconds: np.ndarray, r: int) -> np.ndarray:
    """T of every row of stage times (left to right), by the additive form of Eq. 1-4 at m = r S
    (module docstring), k the rightmost slowest stage."""
    S = seconds.shape[1]
    slowest = seconds.max(axis=1)
    k = S - 1 - np.argmax((seconds == slowest[:, None])[:, ::-1], axis=1)
    index = np.arange(S)[None, :]
    left = np.where(index < k[:, None], seconds, 0.0).sum(axis=1)
    right = np.where(index > k[:, None], seconds, 0.0).sum(axis=1)
    return left + 2 * right + ((k + 1) * r + (S - 1 - k) * (r - 1)) * slowest


def _bottleneck_dp(
    table: _StageTable,
    gpus: int,
    max_nodes: int,
    only: int | None = None,
    stage_cap: int | None = None,
    below: float = INF,
    in_flight: bool = True,
) -> dict[int, float]:
    """Smallest achievable slowest-stage time for every node count up to ``max_nodes`` (INF where
    nothing fits), or for ``only`` that count; with ``stage_cap``, over layouts of at most that
    many stages. Only values under ``below`` are searched for: ``below`` itself means "at least
    ``below``".

    Branch and bound like the main DP: a sub-search only looks for values below its budget and
    is memoised as a lower bound otherwise. The slowest stage of [0, a) is at least its compute
    spread over the GPUs still free (a stage of g GPUs needs w >= compute / g), and a state whose
    rest memory cannot cover on the GPUs still free is ruled out (``in_flight=False``: only the
    stage cap uses that count, on any GPUs, as the search before it did).
    """
    G = gpus
    compute = table.compute_prefix
    cost, cap = table.cost, table.cap
    # A stage cap needs the exact count of stages placed in the memo key, not its compression.
    exact_count = list(range(table.num_layers + 2)) if stage_cap is not None else None
    most_stages = stage_cap if stage_cap is not None else table.num_layers + 1
    # One memo per in-flight compression: a search below budget B only places stages with
    # w < B, so only their memory limits bind (``compressions_within``).
    memos: dict[tuple[int, ...], dict[tuple[int, int, int, int], tuple[float, bool]]] = {}
    memo: dict[tuple[int, int, int, int], tuple[float, bool]] = {}
    compress: list[int] = []
    bisect_left = bisect.bisect_left
    # The fewest stages covering [0, a) when the first of them (from the right) keeps j + 1
    # microbatches in flight, by memory, on the GPUs left (``by_gpus[j][u][a]``, where at most
    # ``few_gpus`` are) or on any (``by_memory[j][a]``): INF rules a state out, and so does a
    # stage cap it would exceed.
    few_gpus = STAGE_COUNT_NODES * G if in_flight else -1  # (-1: every state counts by memory)
    by_gpus = table.gpu_stage_counts(few_gpus) if in_flight else []
    by_memory = table.memory_stage_counts()[2]

    def best(a: int, j: int, nl: int, h: int, budget: float) -> float:
        if a == 0:
            return 0.0 if nl == 0 and h == G else INF
        if nl + (1 if h < G else 0) > a or j + nl + (1 if h < G else 0) > most_stages:
            return INF
        free = nl * G + G - h  # GPUs for [0, a): the nodes still to open and the current one's rest
        needed = by_gpus[j][free][a] if free <= few_gpus else by_memory[j][a]
        if (needed == INF and in_flight) or (stage_cap is not None and j + needed > stage_cap):
            return INF
        key = (a, compress[j], nl, h)
        hit = memo.get(key)
        if hit is not None and (hit[1] or hit[0] >= budget):
            return hit[0]
        result = INF
        same_node = j > 0 and h < G
        for g in range(G, 0, -1):
            if same_node:
                if h + g > G:
                    continue
                link, nl2, h2 = LINK_INTRA, nl, h + g
            elif nl > 0:
                link, nl2, h2 = (LINK_NONE if j == 0 else LINK_INTER), nl - 1, g
            else:
                break
            lo = bisect_left(cap[g][a], j + 1)
            costs = cost[g][link][a]
            free = (nl2 + 1) * G - h2  # GPUs left for [0, start)
            for start in range(a - 1, lo - 1, -1):
                w = costs[start]
                limit = result if result < budget else budget
                if w >= limit:
                    break  # costs only grow as the stage takes more layers
                if start and compute[start] >= limit * free:
                    continue  # the rest cannot get below the limit
                rest = best(start, j + 1, nl2, h2, limit)
                value = w if w > rest else rest
                if value < result:
                    result = value
        exact = result < budget
        memo[key] = (result if exact else budget, exact)
        return result if exact else budget

    seeds = _one_stage_per_node(table, G, max_nodes)
    result = {}
    for n in range(1, max_nodes + 1) if only is None else (only,):
        bound = max(_layout_seconds(table, seeds[n], G)) if n in seeds and n <= most_stages else INF
        bound = min(bound, below)
        compress = exact_count or table.compressions_within(bound)
        memo = memos.setdefault(tuple(compress), {})
        # Search strictly below the seed; the seed itself is the answer if nothing beats it.
        found = best(table.num_layers, 0, n, G, bound)
        result[n] = found if found < bound else bound
    return result


def _layout_seconds(table: _StageTable, layout: list[tuple[int, int, int]], gpus: int) -> list[float]:
    """w of every stage of a right-to-left layout (node changes implied by GPU counts)."""
    stages = _to_stages(layout, gpus)
    links = _stage_links(stages)
    return [table.cost[s.gpus][link][s.end][s.start] for s, link in zip(stages, links)]


def _solve_for_threshold(
    table: _StageTable,
    gpus: int,
    W: float,
    r: int,
    budgets: dict[int, float],
    markers: set[tuple[int, int, int]] | None = None,
    prefix: PrefixBounds | None = None,
    in_flight: bool = True,
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Exact DP for one bottleneck value W: the best T among layouts whose slowest stage is W.

    Branch and bound: ``budgets[n]`` is the best T already known for n nodes, and only layouts
    strictly below it matter. A sub-search that cannot beat its budget (by the bound below)
    stops and is memoised as a lower bound, re-searched only if a larger budget asks again.
    ``markers`` (start, end, gpus), if given, are the only stages allowed as the bottleneck.
    Layouts are returned right to left as (start, end, gpus); node changes follow from the GPU
    counts (a node closes when its GPUs are used up). ``in_flight=False`` leaves out the bounds
    from what memory forces at the in-flight counts of the stages still to place (the search
    before them, for comparison).
    """
    G = gpus
    # key -> (value, exact, choice); inexact values are lower bounds.
    memo: dict[tuple[int, int, int, int, int], tuple[float, bool, Any]] = {}
    rW = r * W
    r1W = (r - 1) * W
    compute = table.compute_prefix
    per_stage_compute = W * G
    cross = table.min_cross_link

    compress = table.compressions_within(W)
    cost, cap = table.cost, table.cap
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    # Node-level bounds of a prefix whose stages keep >= j + 1 microbatches in flight, by j
    # (made on first use).
    prefix_tables: list[Any] = [None] * ((table.num_layers + 2) * (G + 1))

    # Lower bound on the cost of covering [0, start) (inlined in ``solve``; INF if impossible).
    # Once the marker is placed every stage costs w + rW; before it, every stage costs
    # >= 2w + (r-1)W (w + rW >= that when w <= W), except the marker itself, which costs
    # rW = 2W + (r-1)W - W. sum w >= compute / G plus one cross-node boundary per node still to
    # open; there are at least as many stages as nodes left to fill and as compute / (W G); and
    # a stage of g GPUs does at most W g of compute, so the GPUs left bound the compute that
    # still fits (with a relative slack of 1e-9 for float rounding).
    # The bound's per-start parts, hoisted out of the inner loop.
    compute_per_gpu = [c / G for c in compute]
    least_stages = [math.ceil(c / per_stage_compute - 1e-9) for c in compute]
    slack = 1 + 1e-9
    # ``bound`` is INF once [0, start) holds more compute than the GPUs left (nl nodes and the
    # current one's G - h) can take at w <= W; compute grows with start, so those starts form a
    # suffix, cut at ``fits_below[nl][h]``.
    most_nodes = max(budgets, default=0)
    fits_below = [
        [bisect_right(compute, (per_stage_compute * (nl + 1) - W * h) * slack) for h in range(G + 1)]
        for nl in range(most_nodes + 1)
    ]
    # Memory: a stage of g GPUs ending at a fits from its first start up when the widest range
    # (start 0) already keeps enough microbatches in flight; bisect only when it does not.
    within_table = table.first_starts_within(W)
    widest_cap = [[row[0] if row else INF for row in cap[g]] if g else [] for g in range(G + 1)]
    # Before the marker is placed, [0, start) must still hold one, ending at or before start:
    # stages right of it cost 2w + (r-1)W, the marker rW, and the k >= (fewest stages of
    # compute <= W G covering its left) stages left of it w + rW, so [0, start) costs at least
    # 2 C(e, start)/G + C(0, s)/G + (k + 1) W + stages (r-1)W over the markers [s, e) (the
    # marker's compute is dropped, and with it a cross-node link it may end in; the stage
    # count term moves stages to the cheaper side).
    # INF where no marker fits: the search stops as soon as it has passed every marker.
    before_marker = np.full(len(compute), INF)
    if markers is not None:
        cumulative = table.arrays.compute
        for m_start, m_end, _ in markers:
            k = _fewest_nodes(compute, 0, m_start, per_stage_compute * slack, per_stage_compute * slack)
            if k is None:
                continue
            rest = 2 * (cumulative[m_end:] - cumulative[m_end]) / G + cumulative[m_start] / G + (k + 1) * W
            before_marker[m_end:] = np.minimum(before_marker[m_end:], rest)
    else:
        before_marker[:] = -INF
    before_marker_list: list[float] = before_marker.tolist()
    # The marker is stage k of S and keeps S - k microbatches in flight, at most what its memory
    # allows: a state with j stages right of the marker still needs a marker ending at or before
    # its start that keeps j + 1 in flight. ``marker_room[start]``: the most any marker ending
    # at or before ``start`` keeps (0 where none ends there).
    marker_room = np.full(len(compute), INF)
    if markers is not None and in_flight:
        marker_room[:] = 0.0
        for m_start, m_end, m_gpus in markers:
            marker_room[m_end:] = np.maximum(marker_room[m_end:], cap[m_gpus][m_end][m_start])
    marker_room_list: list[float] = marker_room.tolist()
    # Memory forces at least so many stages on [0, start) (``_bottleneck_dp``), each costing at
    # least (r-1)W: ``by_gpus`` where few GPUs are left, ``by_memory`` otherwise.
    few_gpus = STAGE_COUNT_NODES * G
    by_gpus = table.gpu_stage_counts(few_gpus) if in_flight else []
    by_memory = table.memory_stage_counts()[2]
    no_count = [0.0] * (table.num_layers + 1)  # (in_flight=False)

    def prefix_at(j: int, h: int) -> Any:
        """(left, marked) bounds of [0, start) after a stage that is the j-th from the right and
        leaves h GPUs of its node used (the rest of the node still to fill when h < G)."""
        assert prefix is not None
        found = prefix.at(j + 1) if h == G else prefix.partial(j + 1, G - h)
        prefix_tables[j * (G + 1) + h] = found
        return found

    def solve(a: int, j: int, nl: int, h: int, p: int, budget: float) -> float:
        if a == 0:
            return 0.0 if (nl == 0 and h == G and p == 1) else INF
        if nl + (1 if h < G else 0) > a:
            return INF
        key = (a, compress[j], nl, h, p)
        hit = memo.get(key)
        if hit is not None and (hit[1] or hit[0] >= budget):
            return hit[0]
        result, choice = INF, None
        same_node = j > 0 and h < G
        j1 = j + 1
        # Widest stages and longest layer ranges first: good layouts early tighten the budget.
        for g in range(G - h if same_node else G, 0, -1):
            if same_node:
                link, nl2, h2 = LINK_INTRA, nl, h + g
            elif nl > 0:
                link, nl2, h2 = (LINK_NONE if j == 0 else LINK_INTER), nl - 1, g
            else:
                break
            # memory: the first start that fits; then the first start with w <= W
            lo = 0 if j1 <= widest_cap[g][a] else bisect_left(cap[g][a], j1)
            within = within_table[g][link][a]
            if within > lo:
                lo = within
            hi = fits_below[nl2][h2]
            if hi > a:
                hi = a
            if lo >= hi:
                continue
            costs = cost[g][link][a]
            min_stages = nl2 + (1 if h2 < G else 0)
            # The stages memory forces on [0, start), by start (0 at start 0).
            free = nl2 * G + G - h2
            if not in_flight:
                needs = no_count
            elif free <= few_gpus:
                needs = by_gpus[j1][free]
            else:
                needs = by_memory[j1]
            links_left = nl2 * cross
            links_but_one = links_left - cross if nl2 else 0.0  # one may be the marker's, inside W
            for start in range(lo, hi):
                w = costs[start]
                if p == 1:
                    here, p2 = w + rW, 1
                elif w < W:
                    here, p2 = 2 * w + r1W, 0
                elif w == W and (markers is None or (start, a, g) in markers):
                    here, p2 = rW, 1
                else:
                    continue
                limit = (result if result < budget else budget) - here
                stages = least_stages[start]
                if stages < min_stages:
                    stages = min_stages
                needed = needs[start]
                if needed > stages:
                    if needed == INF:
                        continue
                    stages = int(needed)
                if p2:
                    lower = compute_per_gpu[start] + links_left + stages * rW
                else:
                    lower = 2 * (compute_per_gpu[start] + links_left) + stages * r1W - W
                    if j1 >= marker_room_list[start]:
                        continue  # every marker left of here keeps fewer than j1 + 1 in flight
                    marked = before_marker_list[start] + links_but_one + stages * r1W
                    if marked > lower:
                        lower = marked
                if prefix is not None and start:
                    tables = prefix_tables[j1 * (G + 1) + h2] or prefix_at(j1, h2)
                    whole = tables[1 - p2][nl2][start]
                    if whole > lower:
                        lower = whole
                if lower >= limit:
                    continue
                # The memo lookup of ``solve``, inlined: most sub-searches are answered here.
                hit = memo.get((start, compress[j1], nl2, h2, p2)) if start else None
                if hit is not None and (hit[1] or hit[0] >= limit):
                    rest = hit[0]
                else:
                    rest = solve(start, j1, nl2, h2, p2, limit)
                if rest >= limit:
                    continue  # cannot beat what we have (rest may be only a lower bound)
                value = here + rest
                if value < result:
                    result, choice = value, (start, g, p2)
        if choice is None:
            memo[key] = (budget, False, None)  # nothing below the budget: the budget is a lower bound
            return budget
        memo[key] = (result, True, choice)
        return result

    def layout(n: int) -> list[tuple[int, int, int]]:
        a, j, nl, h, p = table.num_layers, 0, n, G, 0
        stages = []
        while a > 0:
            start, g, p2 = memo[(a, compress[j], nl, h, p)][2]
            stages.append((start, a, g))
            if j > 0 and h < G:
                h += g
            else:
                nl, h = nl - 1, g
            a, j, p = start, j + 1, p2
        return stages

    results = {}
    for n, budget in budgets.items():
        value = solve(table.num_layers, 0, n, G, 0, budget)
        if value < budget:
            results[n] = (value, layout(n))
    return results


def _to_stages(layout_right_to_left: list[tuple[int, int, int]], gpus: int) -> list[StageSpec]:
    stages = []
    node, offset = 0, 0
    for start, end, g in reversed(layout_right_to_left):
        if offset + g > gpus:
            node, offset = node + 1, 0
        stages.append(StageSpec(start=start, end=end, node=node, gpu_offset=offset, gpus=g))
        offset += g
    return stages


def _check_inputs(cluster: ClusterSpec, fault_tolerance: int, r: int, max_gpus: int | None) -> int:
    if cluster.nodes <= 0 or cluster.gpus_per_node <= 0:
        raise PlanningError(
            f"cluster.nodes={cluster.nodes} and cluster.gpus_per_node={cluster.gpus_per_node} must be > 0"
        )
    if fault_tolerance < 0:
        raise PlanningError(f"job.fault_tolerance={fault_tolerance} must be >= 0")
    if r <= 0:
        raise PlanningError(f"planner.reference_microbatches_per_stage={r} must be > 0")
    if max_gpus is not None and max_gpus <= 0:
        raise PlanningError(f"planner.max_gpus_per_stage={max_gpus} must be > 0 (or null for all GPUs of a node)")
    return min(cluster.gpus_per_node, max_gpus) if max_gpus else cluster.gpus_per_node


def _no_fit_message(profile: ModelProfile, cluster: ClusterSpec, up_to: int) -> str:
    largest = max(profile.layers, key=lambda layer: layer.param_bytes)
    return (
        f"no layout of {profile.model} ({profile.num_layers} layers, {profile.param_bytes / 1e9:.2f} GB of "
        f"parameters) fits on up to {up_to} nodes of {cluster.gpus_per_node} devices with "
        f"{cluster.device_memory_bytes / 1e9:.2f} GB each (16 bytes/parameter plus activations; the "
        f"largest layer, {largest.name}, has {largest.param_bytes / 1e9:.3f} GB of parameters); raise "
        "cluster.device_memory_gb or cluster.nodes, or lower job.microbatch_size"
    )


class _DeepRecursion:
    """The DPs recurse once per stage; allow as many stages as layers (restored on exit)."""

    def __init__(self, layers: int):
        self.needed = 20 * layers + 1000

    def __enter__(self) -> None:
        self.saved = sys.getrecursionlimit()
        sys.setrecursionlimit(max(self.saved, self.needed))

    def __exit__(self, *exc: object) -> None:
        sys.setrecursionlimit(self.saved)


def _feasibility(
    profile: ModelProfile, cluster: ClusterSpec, stage_gpus: int
) -> tuple[_StageTable, dict[int, float], int]:
    """The stage table, n0 (exact) and, for every n from n0 on, a floor under its least slowest
    stage (exact at n0; ``bottleneck_floor`` beyond, INF where no layout can fit)."""
    table = _StageTable(profile, cluster, stage_gpus)
    up_to = min(cluster.nodes, profile.num_layers)
    floors = bottleneck_floor(table.node_geometry(), up_to)
    with _DeepRecursion(profile.num_layers):
        # Exact from the first node count the floor allows, up to the first that fits.
        for n in range(1, up_to + 1):
            if floors[n] < INF:
                exact = _bottleneck_dp(table, cluster.gpus_per_node, n, only=n)[n]
                if exact < INF:
                    bottleneck = {m: float(floors[m]) for m in range(n + 1, up_to + 1) if floors[m] < INF}
                    return table, {n: exact, **bottleneck}, n
    raise PlanningError(_no_fit_message(profile, cluster, up_to))


def min_nodes(
    profile: ModelProfile, cluster: ClusterSpec, *, max_gpus_per_stage: int | None = None, fault_tolerance: int = 0
) -> int:
    """n0: the fewest nodes with a memory-feasible template (PlanningError if none fits)."""
    stage_gpus = _check_inputs(cluster, fault_tolerance, 1, max_gpus_per_stage)
    return _feasibility(profile, cluster, stage_gpus)[2]


def generate_templates(
    profile: ModelProfile,
    cluster: ClusterSpec,
    fault_tolerance: int,
    *,
    reference_microbatches_per_stage: int = 4,
    max_gpus_per_stage: int | None = None,
    progress: Callable[[TemplateProgress], None] | None = None,
) -> TemplateSet:
    """The best template for every node count in [n0, N - f*n0] (exact for the cost model).
    ``progress`` is called as the search goes (often: throttle what it prints)."""
    r = reference_microbatches_per_stage
    stage_gpus = _check_inputs(cluster, fault_tolerance, r, max_gpus_per_stage)
    G = cluster.gpus_per_node
    table, bottleneck, n0 = _feasibility(profile, cluster, stage_gpus)
    f = fault_tolerance
    max_nodes = cluster.nodes - f * n0
    if max_nodes < n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; "
            f"cluster.nodes={cluster.nodes}"
        )
    wanted = [n for n in bottleneck if n <= max_nodes and bottleneck[n] < INF]
    with _DeepRecursion(profile.num_layers):
        best = _sweep_thresholds(table, G, r, wanted, bottleneck, progress)
    templates = {}
    for n, (_value, layout) in sorted(best.items()):
        template = make_template(profile, cluster, _to_stages(layout, G), r)
        templates[n] = template
    return TemplateSet(
        min_nodes=n0,
        max_nodes=max_nodes,
        templates=templates,
        num_layers=profile.num_layers,
        gpus_per_node=G,
        layer_param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        intra_node_bandwidth=cluster.intra_node_bandwidth,
        inter_node_bandwidth=cluster.inter_node_bandwidth,
    )


def _sweep_thresholds(
    table: _StageTable,
    gpus: int,
    r: int,
    wanted: Sequence[int],
    bottleneck: dict[int, float],
    progress: Callable[[TemplateProgress], None] | None = None,
    stage_caps: bool = True,
    in_flight: bool = True,
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Try every distinct stage time W as the bottleneck, ascending, until the bound stops it.
    ``stage_caps=False`` skips the stage-count bound, ``in_flight=False`` the bounds from what
    memory forces at the stages' in-flight counts, ``_GpuRelaxation`` among them (the searches
    before them, for comparison)."""
    candidates = table.candidates
    geometry = table.node_geometry()
    total_per_gpu = table.total_compute / gpus
    cross = table.min_cross_link
    best: dict[int, tuple[float, list[tuple[int, int, int]]]] = {}
    one_stage_slowest: dict[int, float] = {}  # the least slowest stage of one-stage-per-node layouts
    for n, layout in _one_stage_per_node(table, gpus, max(wanted, default=0)).items():
        if n in wanted:
            one_stage_slowest[n] = max(_layout_seconds(table, layout, gpus))
            best[n] = _descend(table, gpus, r, layout)

    # The bound max(2 least_sum + ((r-1) S - 1) W, ((r-1) S + 1) W) per node count, with S the
    # fewest stages a layout on n nodes has and
    # least_sum = compute / G plus one cheapest cross-node boundary between consecutive nodes.
    # Both terms are linear in W: a rising term caps the W worth trying for n from above (at the
    # best T found so far), a falling one (possible for small r) from below. The window of n is
    # kept as a range of candidate indices and refreshed whenever its best T improves.
    nodes = sorted(wanted)
    # sum w >= sum_i C_i / g_i >= (sum_i sqrt C_i)^2 / (n G), least when stages hold all they
    # may (memory) and one the rest (``node_bounds._spread``); and >= C / G.
    most = geometry.most_compute(1) * (1 + 1e-9)
    spread = _spread(np.array([table.total_compute] * len(nodes)), most, 1) if most > 0 else None
    least_sum = {
        n: max(total_per_gpu, float(spread[i]) / (n * gpus) if spread is not None else 0.0) + (n - 1) * cross
        for i, n in enumerate(nodes)
    }
    # S >= n stages, and at least as many as memory forces (few nodes for a large model: several
    # stages per node, which is where, without this count, most thresholds reach the DP).
    fewest = _fewest_stages(table)
    stages = {n: max(n * table.stages_per_node, fewest) for n in nodes}
    terms = {n: (((r - 1) * stages[n] - 1, 2 * least_sum[n]), ((r - 1) * stages[n] + 1, 0.0)) for n in nodes}

    def lower_bound(n: int, W: float) -> float:
        return max(offset + slope * W for slope, offset in terms[n])

    def target(n: int) -> float:
        return best[n][0] if n in best else INF

    # Feasibility is monotone in the bottleneck: a layout with at most s stages, all at most W,
    # exists for every W at or above the least slowest stage of such layouts, ``capped[n][s]``
    # (``_bottleneck_dp`` with a stage cap), and for no W below it. So a threshold below
    # ``capped[n][s - 1]`` forces s or more stages on n nodes, and the bound above with s stages
    # rules it out without any per-threshold search. Each ``capped`` value is one DP, computed
    # when a threshold first asks for it and reused by every later threshold. Only node counts
    # on which memory forces more stages than nodes ask: there several stages share a node, the
    # count of stages a threshold needs varies with it, and without this most thresholds reach the DP;
    # with a stage per node the one-stage node bounds are exact already.
    capped: dict[int, dict[int, tuple[float, float]]] = {}  # n -> stages -> (low, high)
    split_floors: list[np.ndarray] = []  # ``split_node_floors``, once asked for

    def forces_too_many_stages(n: int, W: float, budget: float) -> bool:
        if not stage_caps or r == 1 or budget == INF:
            return False
        if stages[n] <= n * table.stages_per_node:
            # Memory allows one stage per node. n stages on n nodes are one stage of all G GPUs
            # per node, whose least slowest stage the seed has (``_one_stage_per_node`` is exact),
            # so below it a layout has a split node: n + 1 stages or more. With equal layers the
            # best layout is mostly one stage per node at exactly that bottleneck, the end of the
            # window, and without this the thresholds below it reach the chain bound one by one.
            if table.stages_per_node > 1 or n not in one_stage_slowest or W >= one_stage_slowest[n]:
                return False
            if stage_bound(n, W, n + 1) >= budget:
                return True
            # Below the floor under the slowest stage of layouts with at most e split nodes, a
            # layout has more than n + e stages (``split_node_floors``: one DP for every node
            # count, made on first use); the largest such e gives the strongest bound.
            if not split_floors:
                split_floors.append(split_node_floors(geometry, max(nodes), MOST_SPLITS))
            floors = split_floors[0][n]
            for splits in range(MOST_SPLITS, 0, -1):
                if W < floors[splits]:
                    return stage_bound(n, W, n + splits + 1) >= budget
            return False
        # The fewest stages at which the bound reaches the budget (solved for the count, then
        # corrected by the bound itself), and whether W forces one more than ``most``.
        estimate = min((budget - 2 * least_sum[n] + W) / ((r - 1) * W), (budget - W) / ((r - 1) * W))
        if estimate > table.num_layers:
            return False  # no layout has more stages than layers
        wanted = max(stages[n] + 1, math.ceil(estimate))
        while wanted > stages[n] + 1 and stage_bound(n, W, wanted - 1) >= budget:
            wanted -= 1
        while stage_bound(n, W, wanted) < budget:
            wanted += 1
        most = wanted - 1
        if most >= table.num_layers:
            return False
        # ``capped[n][s]`` is nonincreasing in s: an upper value known at fewer stages that W
        # reaches, or a lower value at more stages that W falls short of, answers without a DP.
        # With as many stages as layers the cap binds no layout: its value is at least the floor
        # under the least slowest stage of all (``bottleneck``).
        # A DP searches only up to the largest threshold the budget leaves in this node count's
        # window (cheaper than the exact value): a result under that is exact, the limit itself
        # means "above every threshold still to come" and is kept as a lower value.
        known = capped.setdefault(n, {})
        if not known:
            known[table.num_layers] = (bottleneck[n], INF)
        if any(count <= most and high <= W for count, (_, high) in known.items()):
            return False
        if any(count >= most and low > W for count, (low, _) in known.items()):
            return True
        last = min((budget - offset) / slope for slope, offset in terms[n] if slope > 0)
        above = math.nextafter(max(W, last), INF)
        found = _bottleneck_dp(table, gpus, n, only=n, stage_cap=most, below=above, in_flight=in_flight)[n]
        known[most] = (found, found) if found < above else (above, INF)
        return W < found

    def stage_bound(n: int, W: float, count: int) -> float:
        """``lower_bound`` for layouts of at least ``count`` stages."""
        return max(2 * least_sum[n] + ((r - 1) * count - 1) * W, ((r - 1) * count + 1) * W)

    def window(n: int) -> tuple[int, int]:
        lo, hi = bottleneck[n], INF
        if n in best:
            for slope, offset in terms[n]:
                if slope > 0:
                    hi = min(hi, (target(n) - offset) / slope)
                elif slope < 0:
                    lo = max(lo, (target(n) - offset) / slope)
                elif offset >= target(n):
                    return 0, 0
        # A hair wider than the division says: the exact test is lower_bound() < target().
        first = int(np.searchsorted(candidates, lo * (1 - 1e-12), side="left"))
        past = int(np.searchsorted(candidates, hi * (1 + 1e-12), side="right")) if hi < INF else len(candidates)
        return first, past

    def attempt(W: float, budgets: dict[int, float]) -> None:
        """Search the layouts whose bottleneck is W for every n in ``budgets`` (only those below
        its budget matter), after the bounds that may rule W out without the DP."""
        promising = _promising_markers(table, W, r, budgets, total_per_gpu * gpus, gpus, fewest, in_flight)
        if not promising:
            return
        if len(promising) <= MARKER_BOUND_LIMIT:
            # Few markers: the per-marker node bound also narrows which of them the DP may use.
            markers: set[tuple[int, int, int]] = set()
            still_open: set[int] = set()
            for marker in promising:
                bounds = _marker_bounds(table, gpus, W, r, marker, list(budgets))
                beaten = {n for n, bound in bounds.items() if bound < budgets[n]}
                if beaten:
                    markers.add(marker[:3])
                    still_open |= beaten
            if not markers:
                return
            budgets = {n: budgets[n] for n in sorted(still_open)}
        else:  # many (equal layers put a marker at every position): one chain bound for all of them
            markers = {marker[:3] for marker in promising}
        # Where memory puts several stages on a node, the chain bound knows only a split node's
        # compute; the GPU-level relaxation knows its stages and decides most searches there
        # that would find nothing (a bound from memory at in-flight counts: ``in_flight``), so
        # it goes first there and the chain bound's tables are made only for what it leaves.
        crowded = [n for n in budgets if stages[n] > n * table.stages_per_node] if in_flight else []
        if crowded:
            relaxed = _GpuRelaxation(table, gpus, W, r, markers).bounds(max(crowded))
            budgets = {n: b for n, b in budgets.items() if n not in crowded or relaxed[n] * (1 - BOUND_SLACK) < b}
            if not budgets:
                return
        starts, ends, widths = (np.array([m[i] for m in markers]) for i in range(3))
        costs = NodeCosts(geometry, W, r, starts, ends, widths)
        chain = root_bounds(costs, max(budgets))
        budgets = {n: b for n, b in budgets.items() if chain[n] < b}
        if not budgets:
            return
        prefix = PrefixBounds(costs, max(budgets))
        found = _solve_for_threshold(table, gpus, W, r, budgets, markers, prefix, in_flight)
        for n, (value, layout) in found.items():
            if n not in best or value < best[n][0]:
                best[n] = (value, layout)

    # Node counts without a seed (memory rules out one stage per node) start from the threshold
    # the node-level bound rates best on a coarse grid: the ascending sweep below then meets most
    # thresholds with a budget close to the optimum instead of none.
    unseeded = [n for n in nodes if n not in best]
    if unseeded:
        first = int(np.searchsorted(candidates, min(bottleneck[n] for n in unseeded) * (1 - 1e-12), side="left"))
        grid = np.unique(np.linspace(first, len(candidates) - 1, PROBE_THRESHOLDS).astype(np.int64))
        rated: dict[int, list[tuple[float, float]]] = {n: [] for n in unseeded}
        for index in grid:
            W = float(candidates[index])
            lo = int(np.searchsorted(table.marker_costs, W, side="left"))
            hi = int(np.searchsorted(table.marker_costs, W, side="right"))
            marker = (table.marker_starts[lo:hi], table.marker_ends[lo:hi], table.marker_gpus[lo:hi])
            bounds = root_bounds(NodeCosts(geometry, W, r, *marker), max(unseeded))
            for n in unseeded:
                if bounds[n] < INF:
                    rated[n].append((float(bounds[n]), W))
        for n in unseeded:
            for _, W in sorted(rated[n])[:PROBE_ATTEMPTS]:
                attempt(W, {n: target(n)})
                if n in best:
                    break

    windows = np.array([window(n) for n in nodes], dtype=np.int64).reshape(-1, 2)
    index = 0
    while len(nodes):
        # The next candidate W that some node count still needs.
        starts = np.maximum(windows[:, 0], index)
        still = starts < windows[:, 1]
        if not still.any():
            break
        next_index = int(starts[still].min())
        if progress is not None:
            settled = int(((windows[:, 1] <= next_index) | (windows[:, 0] >= windows[:, 1])).sum())
            progress(TemplateProgress(settled, len(nodes), next_index, len(candidates)))
        W = float(candidates[next_index])
        inside = np.flatnonzero((windows[:, 0] <= next_index) & (next_index < windows[:, 1]))
        budgets = {nodes[i]: target(nodes[i]) for i in inside if lower_bound(nodes[i], W) < target(nodes[i])}
        budgets = {n: b for n, b in budgets.items() if not forces_too_many_stages(n, W, b)}
        index = next_index + 1
        if not budgets:
            continue
        before = {n: target(n) for n in budgets}
        attempt(W, budgets)
        for n, value in before.items():
            if target(n) < value:
                windows[nodes.index(n)] = window(n)
    return best


def _promising_markers(
    table: _StageTable,
    W: float,
    r: int,
    budgets: dict[int, float],
    total_compute: float,
    gpus: int,
    fewest_stages: int = 0,
    in_flight: bool = True,
) -> list[tuple[int, int, int, int]]:
    """Stages (start, end, gpus, link) of time exactly W that could still be the bottleneck of a
    better layout.

    From T = ((r-1)S + 1) W + k W + sum_{i<k} w_i + 2 sum_{i>k} w_i with S >= n stages (n + 1 if
    the marker leaves GPUs of its node to another stage): the k stages left of a marker [s, e)
    each do at most W*G of compute, so k >= C(0, s) / (W G), and the sums are at least the
    compute on each side divided by G.
    """
    lo = int(np.searchsorted(table.marker_costs, W, side="left"))
    hi = int(np.searchsorted(table.marker_costs, W, side="right"))
    if not budgets or lo == hi:
        return []
    compute = table.arrays.compute
    starts = table.marker_starts[lo:hi]
    ends = table.marker_ends[lo:hi]
    left = compute[starts]
    right = total_compute - compute[ends]
    widths = table.marker_gpus[lo:hi]
    k_min = np.maximum(np.ceil(left / (W * gpus) - 1e-9), (starts > 0).astype(float))
    # A marker narrower than a node shares it with another stage: one stage more than nodes;
    # and there are at least as many stages as memory forces (``fewest_stages``), and, with
    # ``in_flight``, as the marker, the k before it and those after it
    # (``_StageTable.marker_stage_counts``; INF: it is never the bottleneck).
    least: float | np.ndarray = fewest_stages
    if in_flight:
        after, before = table.marker_stage_counts()
        k_min = np.maximum(k_min, before[lo:hi])
        least = np.maximum(fewest_stages, k_min + 1 + after[lo:hi])
    extra_stages = (widths < gpus).astype(float)
    base = (k_min + 1) * W + left / gpus + 2 * right / gpus
    keep = np.zeros(hi - lo, dtype=bool)
    for n, budget in budgets.items():
        stages = np.maximum(n + extra_stages, least)
        bottleneck = np.isfinite(stages)  # an INF marker is dropped also when r = 1 (no 0 * INF)
        keep |= bottleneck & (base + (r - 1) * np.where(bottleneck, stages, 0.0) * W < budget)
    links = table.marker_links[lo:hi]
    return [
        (int(a), int(b), int(g), int(link))
        for a, b, g, link in zip(starts[keep], ends[keep], widths[keep], links[keep])
    ]


def _fewest_stages(table: _StageTable) -> int:
    """The fewest stages any memory-feasible layout has (0 if none fits): stage i of S keeps
    S - i microbatches in flight, so covered from the right, the j-th stage must fit with j in
    flight on as many GPUs as a stage may have. Taking the longest such stage at each step
    leaves the shortest prefix (a stage of fewer layers needs less memory), so it uses fewest."""
    widest = table.cap[table.stage_gpu_limit]
    end, count = table.num_layers, 0
    while end > 0:
        count += 1
        fits = [start for start, cap in enumerate(widest[end]) if cap >= count]
        if not fits:
            return 0
        end = fits[0]
    return count


def _fewest_nodes(compute: list[float], start: int, end: int, most: float, last_most: float) -> int | None:
    """Fewest contiguous blocks covering layers [start, end) with at most ``most`` compute each
    (``last_most`` for the block ending at ``end``), or None if a single layer does not fit.
    Greedy from the right, longest block first (it stays ahead of any other cover)."""
    count, x, limit = 0, end, last_most
    while x > start:
        y = bisect.bisect_left(compute, compute[x] - limit, start, x + 1)
        if y >= x:  # (y > x: a negative capacity)
            return None
        x, count, limit = y, count + 1, most
    return count


def _marker_bounds(
    table: _StageTable, gpus: int, W: float, r: int, marker: tuple[int, int, int, int], nodes: Sequence[int]
) -> dict[int, float]:
    """A lower bound on T, for each n in ``nodes``, over layouts whose bottleneck is ``marker``.

    Node-level relaxation of Eq. 1-4 (the additive form in the module docstring). The marker's
    node covers layers [s, e) and sits between ``nl`` nodes to its left and ``nr`` to its right.
    A left node costs at least ``C/G + cross + rW`` and a right node ``2 (C/G + cross) + (r-1) W``
    (cross: the cheapest cross-node boundary; the last node has none), whatever its stages,
    because sum_i C_i/g_i >= C/G. A node whose stages all take <= W holds at most G W of compute,
    and at most G (W - cross) if it is one stage with an outgoing cross-node link; a node of
    several stages costs at least (r-1) W more. So ``nl`` and ``nr`` are at least greedy block
    counts at those capacities (two cases: no node split, or some node split) and at most the
    layer counts. A marker narrower than a node shares it with stages on the other G - g GPUs:
    each of their extents [s, e) is tried, those left of the marker costing at least
    C/(G - g) + rW and those right of it 2 C/(G - g) + (r-1) W. With planner.max_gpus_per_stage
    below G every node has at least ceil(G / limit) stages, each charged. Memory is ignored.
    For layouts with one stage per node and equal boundary tensors the bound is exact, which is
    what lets the sweep skip most thresholds without running the DP.
    """
    start, end, width, link = marker
    G, L = gpus, table.num_layers
    compute = table.compute_prefix
    cross = table.min_cross_link
    slack = 1 + 1e-9  # permissive rounding keeps it a lower bound
    rW, r1W = r * W, (r - 1) * W
    # The marker node's extents [s, e) and the least cost of its stages.
    extents: list[tuple[int, int, float]] = []
    if width == G:
        if link != LINK_INTRA:  # a whole-node stage is followed by another node's stage
            extents.append((start, end, rW))
    else:
        spare, other = W * (G - width) * slack, G - width
        lefts = range(bisect.bisect_left(compute, compute[start] - spare, 0, start + 1), start + 1)
        if link == LINK_INTRA:  # stages follow the marker on its node
            rights = range(end + 1, bisect.bisect_right(compute, compute[end] + spare, end, L + 1))
        else:
            rights = range(end, end + 1)
        for s in lefts:
            left_part = compute[start] - compute[s]
            for e in rights:
                right_part = compute[e] - compute[end]
                if left_part + right_part > spare or (s == start and e == end):
                    continue
                cost = rW + (left_part / other + rW if s < start else 0.0)
                cost += 2 * right_part / other + r1W if e > end else 0.0
                # Stages the other GPUs need beyond those counted (max_gpus_per_stage).
                cost += max(0, table.stages_per_node - 1 - (s < start) - (e > end)) * r1W
                extents.append((s, e, cost))
    # Per node beside the marker's: its stages (at least ``q``) and its outgoing link.
    q = table.stages_per_node
    per_left = cross + q * rW
    per_right = 2 * cross + q * r1W

    def side_costs(nl: int, n: int) -> float:
        nr = n - 1 - nl
        return nl * per_left + (nr * per_right - 2 * cross if nr else 0.0)

    whole, single = W * G * slack, (W - cross) * G * slack
    # No node split (capacity of one stage with its link), or some node split (at least one stage
    # more); when every node must split, ``q`` already counts its stages.
    cases = ((single, 0.0), (whole, r1W)) if q == 1 else ((whole, 0.0),)
    bounds = dict.fromkeys(nodes, INF)
    for s, e, node_cost in extents:
        base = compute[s] / G + 2 * (compute[L] - compute[e]) / G + node_cost
        for most, penalty in cases:
            fewest_left = _fewest_nodes(compute, 0, s, most, most)
            fewest_right = _fewest_nodes(compute, e, L, most, whole)
            if fewest_left is None or fewest_right is None:
                continue
            for n in nodes:
                lo = max(fewest_left, n - 1 - (L - e))
                hi = min(s, n - 1 - fewest_right)
                if lo > hi:
                    continue
                # Linear in nl except at nr = 0: the minimum is at an end or at nl = n - 2.
                candidates = (lo, hi, n - 2) if lo <= n - 2 <= hi else (lo, hi)
                value = base + penalty + min(side_costs(nl, n) for nl in candidates)
                if value < bounds[n]:
                    bounds[n] = value
    return bounds
