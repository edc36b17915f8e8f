"""The admissible estimate of the template DP's unexplored part: covering layers [0, s) costs at least this.

``PrefixBounds`` chains ``NodeCosts``' bands from the first layer: ``at`` bounds covering [0, s)
with u whole nodes (left of the marker, or with the marker among them), ``partial`` the same when
the rest of the current node covers part of it; both for the power of two at or below the stages'
in-flight count, since fewer in flight only loosens memory. The DP (``threshold_search``) reads
a few rows of each table as lists (``LazyRows``).
"""

from __future__ import annotations

import numpy as np

from oobleck.planning.node_costs import NodeCosts
from oobleck.planning.node_geometry import BOUND_SLACK, INF


class LazyRows(dict):
    """The rows of a table as lists (the search's inner loop reads lists fastest), by row index,
    each made on first read (``__missing__``; a hit is a plain dict lookup): a search reads a
    few rows of each table, of as many as there are node counts."""

    __slots__ = ("table",)

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.table = table

    def __missing__(self, index: int) -> list[float]:
        found = self[index] = self.table[index].tolist()
        return found

    def tolist(self) -> list[list[float]]:
        return [self[index] for index in range(len(self.table))]


class PrefixBounds:
    """``at(f)``: tables ``(left, marked)``; ``left[u][s]``: covering layers [0, s) with u whole
    nodes left of the marker, every stage keeping >= f microbatches in flight, costs at least
    this; ``marked[u][s]``: the same with the marker among them (stages after it right of it).
    ``partial(f, g)``: the same, when [0, s) is covered by the rest of a node whose last g GPUs
    are still free (its stages lie left of s, on those GPUs, with in-node links) and u whole
    nodes before it."""

    def __init__(self, costs: NodeCosts, max_nodes: int):
        self.costs = costs
        self.max_nodes = max_nodes
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._lists: dict[tuple, tuple[LazyRows, LazyRows]] = {}
        self._partial: dict[tuple, tuple[LazyRows, LazyRows]] = {}

    def _arrays(self, in_flight: int) -> tuple[np.ndarray, np.ndarray]:
        costs = self.costs
        key = costs.key(in_flight)
        if key not in self._tables:
            L, max_nodes = costs.geometry.num_layers, self.max_nodes
            before = costs.before  # [s, d] -> s - d - 1, or L + 1 (an INF slot) before the start
            left_b, right_b, marker_b = costs.by_end(in_flight)
            left = np.full((max_nodes + 1, L + 2), INF)
            marked = np.full((max_nodes + 1, L + 2), INF)
            left[0, 0] = 0.0
            width = costs.width
            for u in range(1, min(max_nodes, L) + 1):
                # u nodes of 1 .. width layers each cover [0, s) only for u <= s <= u width: the
                # other entries stay INF without being computed.
                ends = slice(u, min(L, u * width) + 1)
                step_before = before[ends]
                previous_left = left[u - 1][step_before]
                left[u, ends] = (previous_left + left_b[ends]).min(axis=1)
                marked[u, ends] = np.minimum(
                    (previous_left + marker_b[ends]).min(axis=1),
                    (marked[u - 1][step_before] + right_b[ends]).min(axis=1),
                )
            scale = 1 - BOUND_SLACK
            self._tables[key] = (left[:, : L + 1] * scale, marked[:, : L + 1] * scale)
        return self._tables[key]

    def at(self, in_flight: int) -> tuple[LazyRows, LazyRows]:
        """``(left, marked)`` as rows of lists, for stages keeping at least the power of two at or below
        ``in_flight``: fewer in flight only loosens memory, so these bound the tables at
        ``in_flight`` from below, and a search needs a handful of tables instead of one per
        in-flight count where memory binds at many (few nodes for a large model). The search
        stays exact with looser bounds and returns the same layouts: pruning only ever drops
        sub-searches that cannot go below the budget, whatever the bound."""
        in_flight = 1 << (max(in_flight, 1).bit_length() - 1)
        key = self.costs.key(in_flight)
        if key not in self._lists:
            left, marked = self._arrays(in_flight)
            self._lists[key] = (LazyRows(left), LazyRows(marked))
        return self._lists[key]

    def partial(self, in_flight: int, free_gpus: int) -> tuple[LazyRows, LazyRows]:
        """The node's remaining stages cover [x, s) on ``free_gpus`` GPUs: their w sum to at least
        C(x, s) / free_gpus plus an in-node link, and they hold at most (W - y) per GPU. Left of
        the marker each costs w + rW; with the marker still to come, either they are right of it
        (2w + (r-1)W each, the marker among the whole nodes) or one of them is it (rW)."""
        # Fewer in flight only loosens memory: the tables of the power of two below serve.
        in_flight = 1 << (max(in_flight, 1).bit_length() - 1)
        key = (self.costs.key(in_flight), free_gpus)
        if key not in self._partial:
            costs = self.costs
            geometry, W, r = costs.geometry, costs.W, costs.r
            y, compute = geometry.cheapest_intra, geometry.compute
            left, marked = self._arrays(in_flight)
            positions = geometry.positions
            room = (W - y) * free_gpus * (1 + BOUND_SLACK)
            first = np.searchsorted(compute, compute - room, side="left")  # the first x the node may start at
            last = positions - 1  # it holds at least one layer
            share = compute / free_gpus
            # The three window minima in one call (one sparse table over the stacked rows).
            rows = left.shape[0]
            windows = _window_min(
                np.concatenate((left - share[None, :], marked - 2 * share[None, :], left)), first, last
            )
            left_part = windows[:rows] + share[None, :] + y + r * W
            right_part = windows[rows : 2 * rows] + 2 * (share[None, :] + y)
            right_part = right_part + (r - 1) * W
            holding = windows[2 * rows :] + r * W
            scale = 1 - BOUND_SLACK
            self._partial[key] = (LazyRows(left_part * scale), LazyRows(np.minimum(right_part, holding) * scale))
        return self._partial[key]


def _window_min(values: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """``out[:, s] = values[:, first[s] .. last[s]].min()`` (INF where the window is empty), by a
    sparse table over the columns."""
    rows, columns = values.shape
    levels = [values]
    width = 1
    while 2 * width <= columns:
        previous = levels[-1]
        levels.append(np.minimum(previous[:, : columns - 2 * width + 1], previous[:, width : columns - width + 1]))
        width *= 2
    length = last - first + 1
    valid = length >= 1
    level = np.where(valid, np.floor(np.log2(np.maximum(length, 1))).astype(np.int64), 0)
    out = np.full((rows, len(first)), INF)
    for k, table in enumerate(levels):
        pick = np.flatnonzero(valid & (level == k))
        if pick.size:
            span = 1 << k
            out[:, pick] = np.minimum(table[:, first[pick]], table[:, last[pick] - span + 1])
    return out
