"""What node bounds know before a threshold is chosen: a stage table's node geometry and slowest-stage floors.

``NodeGeometry`` holds the threshold-independent arrays of a stage table that the node bounds
read (one stage on all G GPUs over every layer range, the links, the most compute a stage may
keep in memory) and the compute floor of a node of two or more stages (``split_floor``).
``bottleneck_floor`` and ``split_node_floors`` chain them into floors under the slowest stage of
every layout on n nodes (with at most e split nodes): no threshold below the floor can be a
bottleneck. The node bounds at one threshold are ``node_costs``; the overview is ``node_bounds``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE, link_seconds

if TYPE_CHECKING:
    from oobleck.planning.inputs import ClusterSpec
    from oobleck.planning.stage_table import _StageTable

INF = math.inf
# Bounds are compared with sums the DP adds in another order: keep them below by this much.
BOUND_SLACK = 1e-9
# Ties. Equal layers give many layouts of the same T (the same stage times in another order or
# place, equal up to the order their sums add in), and a search looks only for layouts strictly
# better than its budget: without a margin, proving that none of the ties beats the one found
# costs as much as the search that found it. A bound (already rounded down by BOUND_SLACK) at or
# above the budget times TIE_FACTOR rules a search out, so a template's T is the least to within
# TIE_SLACK (relative), far below what the cost model resolves.
TIE_SLACK = 1e-12
TIE_FACTOR = (1 - BOUND_SLACK) * (1 - TIE_SLACK)


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
        self.whole_cap = table.cap_matrix(G)
        out = table.arrays.output_bytes
        bandwidths = (cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
        # The cross-node link of a node ending at s (none for the pipeline's last node, s = L).
        self.cross = np.array(
            [link_seconds(out[s - 1], LINK_INTER, *bandwidths) if 0 < s < L else 0.0 for s in positions]
        )
        boundaries = out[:-1]
        self.cheapest_intra = link_seconds(float(boundaries.min()), LINK_INTRA, *bandwidths) if boundaries.size else 0.0
        # _most[u]: the most compute of any layer range a stage on as many GPUs as a stage may have
        # keeps in memory with u microbatches in flight (a stage on fewer GPUs keeps less).
        self.stages_per_node = table.stages_per_node
        self.stage_gpu_limit = table.stage_gpu_limit
        self.layer_compute = np.diff(self.compute)
        widest = table.cap_matrix(table.stage_gpu_limit)
        limit = np.minimum(widest, L + 1).astype(np.int64)[valid]
        most = np.zeros(L + 3)
        np.maximum.at(most, limit, self.span_compute[valid])
        self._most = np.maximum.accumulate(most[::-1])[::-1]
        self._split_floors: tuple[np.ndarray, np.ndarray] | None = None

    def most_compute(self, in_flight: int) -> float:
        return float(self._most[min(in_flight, len(self._most) - 1)])

    def most_compute_of(self, in_flight: np.ndarray) -> np.ndarray:
        return self._most[np.minimum(in_flight, len(self._most) - 1).astype(np.int64)]

    def split_floors(self) -> tuple[np.ndarray, np.ndarray]:
        """``split_floor`` of nodes ending in a cross-node link ([x, s]) and of the pipeline's last
        node ([x], s = L: no link), made once (``bottleneck_floor`` and ``split_node_floors``)."""
        if self._split_floors is None:
            L, G, compute = self.num_layers, self.gpus, self.compute
            last = np.full(L + 1, INF)
            for g in range(1, G):
                # split_floor(zeros)[:, L], the same operations on its one column.
                rest = (compute[None, :] - compute[:, None]) / (G - g) + self.cheapest_intra  # [x, b]
                tail = (compute[L] - compute) / g + 0.0  # [b]
                both = np.where(self.span[:, :L] > 0, np.maximum(rest[:, :L], tail[None, :L]), INF)
                both[:, 0] = INF  # b >= 1
                last = np.minimum(last, both.min(axis=1))
            self._split_floors = (self.split_floor(self.cross), last)
        return self._split_floors

    def split_floor(self, link: np.ndarray) -> np.ndarray:
        """``[x, s]``: no node of two or more stages over [x, s) (last link ``link[s]``) has all its
        stages under this: its last stage [b, s) on g < G GPUs takes C(b, s) / g + link, the others
        share G - g GPUs, so one of them takes at least C(x, b) / (G - g) + y (memory not counted)."""
        G, L = self.gpus, self.num_layers
        floor = np.full((L + 1, L + 1), INF)
        compute = self.compute
        for b in range(1, L):
            before = compute[b] - compute[:b]  # C(x, b) for x < b
            after = compute[b + 1 :] - compute[b]  # C(b, s) for s > b
            for g in range(1, G):
                rest = before / (G - g) + self.cheapest_intra
                last = after / g + link[b + 1 :]
                both = np.maximum(rest[:, None], last[None, :])
                floor[:b, b + 1 :] = np.minimum(floor[:b, b + 1 :], both)
        return floor


def bottleneck_floor(geometry: NodeGeometry, max_nodes: int) -> np.ndarray:
    """``floor[n]`` (n = 0 .. max_nodes): every layout on n nodes has a stage at least this slow
    (INF: no layout fits): the slowest-stage DP over whole nodes, each node at least as slow as
    its one-stage time or ``split_floor``; a one-stage node keeps >= u microbatches in flight when
    u - 1 nodes follow it."""
    L = geometry.num_layers
    floor = np.full(max_nodes + 1, INF)
    if max_nodes < 1:
        return floor
    split_inter, split_last = geometry.split_floors()
    last = np.minimum(np.where(geometry.whole_cap[:, L] >= 1, geometry.whole_last, INF), split_last)
    slowest = last  # [x]: the least slowest stage covering [x, L) with u nodes
    floor[1] = slowest[0]
    for u in range(2, max_nodes + 1):
        node = np.minimum(np.where(geometry.whole_cap >= u, geometry.whole_inter, INF), split_inter)
        slowest = np.min(np.maximum(node, slowest[None, :]), axis=1)
        floor[u] = slowest[0]
    return floor


def split_node_floors(geometry: NodeGeometry, max_nodes: int, most_splits: int) -> np.ndarray:
    """``floor[n, e]`` (n = 0 .. max_nodes, e = 0 .. ``most_splits``): every layout on n nodes
    with at most e nodes of two or more stages has a stage at least this slow (INF: none fits),
    so a layout with a stage under it has more than n + e stages. The slowest-stage DP of
    ``bottleneck_floor`` with the split nodes counted: a whole node exact (memory at one more in
    flight than the nodes and split nodes to its right), a split node at least ``split_floor``."""
    L = geometry.num_layers
    floor = np.full((max_nodes + 1, most_splits + 1), INF)
    if max_nodes < 1:
        return floor
    split_inter, split_last = geometry.split_floors()
    # [e, x]: the least slowest stage covering [x, L) with the nodes so far, e of them split.
    slowest = np.full((most_splits + 1, L + 1), INF)
    fits_last = geometry.whole_cap[:, L][None, :] >= np.arange(1, most_splits + 2)[:, None]
    slowest[0] = np.where(fits_last[0], geometry.whole_last, INF)
    if most_splits:
        slowest[1] = split_last
    floor[1] = np.minimum.accumulate(slowest[:, 0])
    splits = np.arange(most_splits + 1)
    for u in range(2, min(max_nodes, L) + 1):
        # u nodes of a layer or more cover [x, L) only for x <= L - u, from ends s <= L - u + 1:
        # the other entries stay INF without being computed. All e at once: [e, x, s].
        rows, ends = slice(0, L - u + 1), slice(0, L - u + 2)
        following = slowest[:, ends]
        fits = geometry.whole_cap[rows, ends][None] >= (u + splits)[:, None, None]
        whole = np.where(fits, geometry.whole_inter[rows, ends][None], INF)
        slowest = np.full_like(slowest, INF)
        slowest[:, rows] = np.maximum(whole, following[:, None, :]).min(axis=2)
        if most_splits:
            split = np.maximum(split_inter[rows, ends][None], following[:-1, None, :]).min(axis=2)
            np.minimum(slowest[1:, rows], split, out=slowest[1:, rows])
        floor[u] = np.minimum.accumulate(slowest[:, 0])
    return floor
