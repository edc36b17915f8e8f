"""Node-level lower bounds for template search: Eq. 1-4 relaxed to whole nodes, for one threshold W.

The template DP (``oobleck.planning.templates``) places one stage at a time; these bounds look at
whole nodes instead. With W the bottleneck (the rightmost slowest stage, the "marker"), Eq. 1-4 at
m = r S adds up per stage (module docstring of ``templates``): a stage left of the marker costs
``w + rW``, the marker ``rW``, a stage right of it ``2w + (r-1)W``. Summing over the stages of one
node gives that node's cost, and a layout's T is the sum over its nodes. Here every node covering
layers ``[x, s)`` gets a *lower bound* of its cost, for each side of the marker:

- one stage on all G GPUs: its exact cost (w from the stage table; w <= W left of the marker,
  w < W right of it, w == W for the marker); memory is checked for the microbatches it keeps in
  flight, at least one per node to its right (each node holds at least one stage);
- two or more stages (a split node): at least ``C/G + y + l`` for the sum of its w (sum_i C_i/g_i
  >= C/G with sum_i g_i = G; at least one in-node boundary y, the cheapest; its last stage's
  link l) and the per-stage terms of two stages; it exists only if its last stage can hold the
  node's last layer within W on some g < G GPUs and the other G - g GPUs can hold the rest at
  ``(W - y)`` per GPU. A split node holding the marker costs at least ``rW + (r-1)W``.

Chaining these node bounds over positions is a shortest-path DP over (position, nodes), which
numpy runs for every node count at once: ``root_bounds`` bounds T of every layout on n nodes whose
bottleneck is W (the sweep skips a W when it cannot beat the best T known), and ``PrefixBounds``
bounds what covering layers ``[0, s)`` with u whole nodes costs, the admissible estimate of the
DP's unexplored part. For layouts with one stage per node the bound is exact (memory aside), so
on profiles where that shape wins it leaves one threshold per node count to the DP.

The bounds are rounded down by ``BOUND_SLACK`` (relative): they add in another order than the
DP does and must never exceed the value they bound.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE, link_seconds

if TYPE_CHECKING:
    from oobleck.planning.inputs import ClusterSpec
    from oobleck.planning.templates import _StageTable

INF = math.inf
# Bounds are compared with sums the DP adds in another order: keep them below by this much.
BOUND_SLACK = 1e-9


class NodeGeometry:
    """The threshold-independent arrays of a stage table that node bounds need."""

    def __init__(self, table: _StageTable, cluster: ClusterSpec):
        G, L = table.max_gpus, table.num_layers
        self.gpus, self.num_layers = G, L
        self.compute = table.arrays.compute  # compute of layers [0, i)
        self.span_compute = self.compute[None, :] - self.compute[:, None]  # [x, s]: compute of [x, s)
        positions = np.arange(L + 1)
        self.positions = positions
        self.span = positions[None, :] - positions[:, None]  # [x, s]: layers in [x, s)
        valid = self.span > 0
        # One stage on all G GPUs over [x, s): w, and the microbatches it may keep in flight.
        self.whole_inter = np.where(valid, table.cost_stack[G, LINK_INTER], INF)
        self.whole_last = np.where(valid[:, L], table.cost_stack[G, LINK_NONE][:, L], INF)
        caps = np.zeros((L + 1, L + 1))
        for end in range(1, L + 1):
            caps[:end, end] = table.cap[G][end]
        self.whole_cap = caps
        out = table.arrays.output_bytes
        bandwidths = (cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
        # The cross-node link of a node ending at s (none for the pipeline's last node, s = L).
        self.cross = np.array(
            [link_seconds(out[s - 1], LINK_INTER, *bandwidths) if 0 < s < L else 0.0 for s in positions]
        )
        boundaries = out[:-1]
        self.cheapest_intra = link_seconds(float(boundaries.min()), LINK_INTRA, *bandwidths) if boundaries.size else 0.0


class NodeCosts:
    """Lower bounds of every node's cost at threshold W (see the module docstring).

    ``whole[side]`` / ``split[side]``: ``[x, s]`` matrices for nodes that are not the pipeline's
    last, ``whole_last[side]`` / ``split_last[side]``: vectors over x for the last node [x, L).
    Sides: 0 left of the marker, 1 right of it, 2 holding it.
    """

    def __init__(self, geometry: NodeGeometry, W: float, r: int, marker_starts: np.ndarray, marker_ends: np.ndarray):
        self.geometry = geometry
        G, L = geometry.gpus, geometry.num_layers
        rW, r1W = r * W, (r - 1) * W
        positions = geometry.positions
        # For every end s, the largest start of a marker stage ending at or before s.
        latest_marker = np.full(L + 1, -1)
        if len(marker_starts):
            np.maximum.at(latest_marker, np.asarray(marker_ends), np.asarray(marker_starts))
            latest_marker = np.maximum.accumulate(latest_marker)
        y = geometry.cheapest_intra
        self.whole, self.split = [], []
        for last in (False, True):
            if last:
                w = geometry.whole_last[:, None]
                compute = geometry.span_compute[:, L:]
                link = np.zeros(1)
                ends = positions[L:]
            else:
                w = geometry.whole_inter
                compute = geometry.span_compute
                link = geometry.cross
                ends = positions
            first_split = self._first_split_start(geometry, W, link, ends, y)
            starts = positions[:, None]
            split = (starts >= first_split[None, :]) & (ends[None, :] - starts >= 2)
            least = compute / G + y + link[None, :]  # sum of w over a split node's stages, at least
            whole = (
                np.where(w <= W, w + rW, INF),
                np.where(w < W, 2 * w + r1W, INF),
                np.where(w == W, rW, INF),
            )
            parts = (
                np.where(split, least + 2 * rW, INF),
                np.where(split, 2 * least + 2 * r1W, INF),
                np.where(split & (starts <= latest_marker[ends][None, :]), rW + r1W, INF),
            )
            if last:
                self.whole_last = tuple(m[:, 0] for m in whole)
                self.split_last = tuple(m[:, 0] for m in parts)
            else:
                self.whole, self.split = whole, parts
        self._bands()

    @staticmethod
    def _first_split_start(
        geometry: NodeGeometry, W: float, link: np.ndarray, ends: np.ndarray, y: float
    ) -> np.ndarray:
        """For every node end s, the smallest start x of a node of two or more stages that might
        fit W (L + 1 where none does): the last stage holds [b, s) on g < G GPUs, the rest [x, b)."""
        G, L = geometry.gpus, geometry.num_layers
        compute = geometry.compute
        first = np.full(len(ends), L + 1)
        rest_room = (W - y) * (1 + BOUND_SLACK)
        if rest_room <= 0:
            return first
        for g in range(1, G):
            room = (W - link) * g * (1 + BOUND_SLACK)
            fits = room > 0
            b = np.searchsorted(compute, compute[ends] - np.where(fits, room, 0.0), side="left")
            fits &= b <= ends - 1  # the last stage holds at least the node's last layer
            x = np.searchsorted(compute, compute[np.minimum(b, L)] - rest_room * (G - g), side="left")
            first = np.where(fits, np.minimum(first, x), first)
        return first

    def _bands(self) -> None:
        """The matrices as bands ``[x, d]`` -> node [x, x + d + 1): a node at threshold W holds at
        most ``width`` layers, so the chains below only look that far."""
        geometry = self.geometry
        L = geometry.num_layers
        finite = np.isfinite(np.minimum.reduce([np.minimum(w, s) for w, s in zip(self.whole, self.split)]))
        spans = np.where(finite, geometry.span, 0)
        self.width = width = max(int(spans.max()), 1)
        x = geometry.positions[:, None]
        ends = x + np.arange(1, width + 1)[None, :]  # [x, d]
        inside = ends <= L
        ends = np.minimum(ends, L)

        def band(matrix: np.ndarray) -> np.ndarray:
            return np.where(inside, matrix[x, ends], INF)

        self.whole_band = [band(m) for m in self.whole]
        self.split_band = [band(m) for m in self.split]
        self.combined_band = [np.minimum(w, s) for w, s in zip(self.whole_band, self.split_band)]
        self.cap_band = np.where(inside, geometry.whole_cap[x, ends], 0.0)
        usable = np.isfinite(np.minimum.reduce(self.whole_band))
        self._limits = np.unique(self.cap_band[usable])  # in-flight counts where a whole stage stops fitting
        self._banded: dict[int, list[np.ndarray]] = {}
        self.after = np.where(inside, ends, L + 1)
        # The same bands indexed by node end: [s, d] -> node [s - d - 1, s).
        starts = geometry.positions[:, None] - np.arange(1, width + 1)[None, :]
        exists = starts >= 0
        self.before = np.where(exists, starts, L + 1)
        starts = np.maximum(starts, 0)
        self.by_end = [np.where(exists, m[starts, geometry.positions[:, None]], INF) for m in self.combined_by_cap(1)]

    def combined_by_cap(self, in_flight: int) -> list[np.ndarray]:
        """Full matrices (left, right, marker) for nodes keeping >= ``in_flight`` in flight."""
        fits = self.geometry.whole_cap >= in_flight
        return [np.minimum(np.where(fits, w, INF), s) for w, s in zip(self.whole, self.split)]

    def bands(self, in_flight: int) -> list[np.ndarray]:
        """Banded node bounds (left, right, marker) for nodes keeping >= ``in_flight`` in flight
        (the same arrays for every count between two memory limits of whole-node stages)."""
        key = int(np.searchsorted(self._limits, in_flight, side="left"))
        if key not in self._banded:
            fits = self.cap_band >= in_flight
            self._banded[key] = [np.where(fits, c, s) for c, s in zip(self.combined_band, self.split_band)]
        return self._banded[key]

    def last_vectors(self) -> list[np.ndarray]:
        fits = self.geometry.whole_cap[:, self.geometry.num_layers] >= 1
        return [np.minimum(np.where(fits, w, INF), s) for w, s in zip(self.whole_last, self.split_last)]


def root_bounds(costs: NodeCosts, max_nodes: int) -> np.ndarray:
    """``bound[n]`` (n = 0 .. max_nodes): T of any layout on n nodes whose bottleneck is W is at
    least this (INF: there is none). Built right to left: the u-th node from the right keeps at
    least u microbatches in flight."""
    bound = np.full(max_nodes + 1, INF)
    if max_nodes < 1:
        return bound
    L = costs.geometry.num_layers
    after = costs.after  # [x, d] -> x + d + 1, or L + 1 (an INF slot) past the end
    _, last_right, last_marker = costs.last_vectors()
    right = np.full(L + 2, INF)  # [x]: covering [x, L) right of the marker (slot L + 1: nothing)
    full = np.full(L + 2, INF)  # [x]: the same, holding the marker
    right[: L + 1], full[: L + 1] = last_right, last_marker
    bound[1] = full[0]
    for u in range(2, max_nodes + 1):
        left_b, right_b, marker_b = costs.bands(u)
        next_right, next_full = right[after], full[after]
        right[: L + 1] = (right_b + next_right).min(axis=1)
        full[: L + 1] = np.minimum((marker_b + next_right).min(axis=1), (left_b + next_full).min(axis=1))
        bound[u] = full[0]
    return bound * (1 - BOUND_SLACK)


class PrefixBounds:
    """``left[u][s]``: covering layers [0, s) with u whole nodes left of the marker costs at least
    this; ``marked[u][s]``: the same with the marker among them (stages after it right of it).
    Memory is not counted (the DP checks it)."""

    def __init__(self, costs: NodeCosts, max_nodes: int):
        L = costs.geometry.num_layers
        before = costs.before  # [s, d] -> s - d - 1, or L + 1 (an INF slot) before the start
        left_b, right_b, marker_b = costs.by_end
        left = np.full((max_nodes + 1, L + 2), INF)
        marked = np.full((max_nodes + 1, L + 2), INF)
        left[0, 0] = 0.0
        for u in range(1, max_nodes + 1):
            previous_left = left[u - 1][before]
            left[u, : L + 1] = (previous_left + left_b).min(axis=1)
            marked[u, : L + 1] = np.minimum(
                (previous_left + marker_b).min(axis=1), (marked[u - 1][before] + right_b).min(axis=1)
            )
        left, marked = left[:, : L + 1], marked[:, : L + 1]
        scale = 1 - BOUND_SLACK
        self.left: list[list[float]] = (left * scale).tolist()
        self.marked: list[list[float]] = (marked * scale).tolist()
