"""The stage table: every candidate stage's time and memory limit, as the template searches read them.

``_StageTable`` holds, for every stage (layers [start, end) on g GPUs with its outgoing link), its
time w and the most microbatches it may keep in flight within memory, as lists indexed for the
DPs' inner loops and as arrays for the vectorised bounds; the bottleneck candidates W (every
distinct stage time) with their "marker" stages; and what memory alone forces (the fewest stages
covering a range at given in-flight counts, on the widest stages or on the GPUs left).
``_StageBands`` is the same table banded by stage length, for ``gpu_relaxation``.

Equal layers, equal times. A stage's compute is summed by its signature (``ProfileArrays.
span_compute``: so many layers of this run, the full runs between, so many of that run), not as a
difference of prefix sums, so equal ranges of identical layers (every decoder block of a GPT) take
bit-identical times wherever they sit. Each distinct stage time is then one candidate W with every
such stage among its markers, where prefix sums split it into several W a few ulps apart and ran
the search once for each (1,315 candidates for 100 layers on nodes of 8 GPUs instead of 766).
"""

from __future__ import annotations

import math

import numpy as np

from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.node_geometry import NodeGeometry
from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE, ProfileArrays, link_seconds

INF = math.inf
# Stage counts forced by memory on the GPUs left (``_StageTable.gpu_stage_counts``) are kept for
# up to this many nodes' GPUs (the table grows with it): memory forces narrow stages of few layers
# where few nodes hold a large model, the searches that find nothing there are what they prune,
# and with more GPUs left the count on the widest stages (``memory_stage_counts``) is as good.
STAGE_COUNT_NODES = 4


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
        # ``bottleneck_search._seed_layouts``: (node counts covered, layouts by node count).
        self.seed_layouts: tuple[int, dict[int, list[tuple[int, int, int]]]] | None = None
        self._cap_matrices: dict[int, np.ndarray] = {}
        self._cap_stack: np.ndarray | None = None
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

    def cap_stack(self) -> np.ndarray:
        """``cap_matrix`` of every GPU count as one array ``[gpus, start, end]`` (made on first use)."""
        if self._cap_stack is None:
            self._cap_stack = np.stack(
                [np.zeros((self.num_layers + 1,) * 2)] + [self.cap_matrix(g) for g in range(1, self.max_gpus + 1)]
            )
        return self._cap_stack

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
        caps = table.cap_stack()[: widest + 1]
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
