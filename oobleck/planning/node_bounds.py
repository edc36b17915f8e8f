"""Node-level lower bounds for template search: Eq. 1-4 relaxed to whole nodes, for one threshold W.

The template DP (``threshold_search``) places one stage at a time; these bounds look at
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
    from oobleck.planning.stage_table import _StageTable

INF = math.inf
# Bounds are compared with sums the DP adds in another order: keep them below by this much.
BOUND_SLACK = 1e-9
# Where the most compute a stage may hold takes at most this many values over the in-flight counts
# of one threshold (memory limits change at few counts, or W caps them all), the chains take split
# nodes' bounds from the whole band computed once per value; with more, each step computes its own.
LEVELS_CACHED = 4


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


class NodeCosts:
    """Lower bounds of every node's cost at threshold W (see the module docstring), as bands:
    ``[x, d]`` is the node [x, x + d + 1) (a node at threshold W holds at most ``width`` layers,
    so the chains only look that far); ``last_vectors`` are the pipeline's last node [x, L).
    Sides, in that order everywhere: left of the marker, right of it, holding it."""

    def __init__(
        self,
        geometry: NodeGeometry,
        W: float,
        r: int,
        marker_starts: np.ndarray,
        marker_ends: np.ndarray,
        marker_gpus: np.ndarray,
    ):
        self.geometry = geometry
        self.W, self.r = W, r
        # For every width g < G of a marker stage, the most compute such a marker holds.
        self.marker_widths: dict[int, float] = {}
        narrow = np.asarray(marker_gpus) < geometry.gpus
        if narrow.any():
            widths = np.asarray(marker_gpus)[narrow]
            held = (
                geometry.compute[np.asarray(marker_ends)[narrow]] - geometry.compute[np.asarray(marker_starts)[narrow]]
            )
            for g in np.unique(widths):
                self.marker_widths[int(g)] = max(0.0, float(held[widths == g].max()))
        L = geometry.num_layers
        positions = geometry.positions
        # For every end s, the largest start of a marker stage ending at or before s.
        latest_marker = np.full(L + 1, -1)
        if len(marker_starts):
            np.maximum.at(latest_marker, np.asarray(marker_ends), np.asarray(marker_starts))
            latest_marker = np.maximum.accumulate(latest_marker)
        y = geometry.cheapest_intra
        starts = positions[:, None]
        first_inter = self._first_split_start(geometry, W, geometry.cross, positions, y)
        first_last = self._first_split_start(geometry, W, np.zeros(1), positions[L:], y)
        splittable = (starts >= first_inter[None, :]) & (geometry.span >= 2)
        whole = self._whole_sides(geometry.whole_inter)
        reach = np.isfinite(np.minimum.reduce(whole)) | splittable
        self.width = width = max(int(np.where(reach, geometry.span, 0).max()), 1)
        ends = starts + np.arange(1, width + 1)[None, :]  # [x, d]
        inside = ends <= L
        ends = np.minimum(ends, L)
        self.after = np.where(inside, ends, L + 1)  # [x, d] -> node end, or L + 1 (an INF slot)
        self.whole_band = [np.where(inside, m[starts, ends], INF) for m in whole]
        self.cap_band = np.where(inside, geometry.whole_cap[starts, ends], 0.0)
        band_compute, band_link = geometry.span_compute[starts, ends], geometry.cross[ends]
        self._split_band = (
            inside & splittable[starts, ends],
            band_compute,
            band_link,
            starts <= latest_marker[ends],
            self._last_stage_floor(band_compute, band_link, geometry.layer_compute[np.maximum(ends - 1, 0)]),
        )
        fits_last = geometry.whole_cap[:, L] >= 1
        self._last = (
            [np.where(fits_last, m, INF) for m in self._whole_sides(geometry.whole_last)],
            (
                (positions >= first_last[0]) & (L - positions >= 2),
                geometry.span_compute[:, L],
                0.0,
                positions <= latest_marker[L],
                self._last_stage_floor(geometry.span_compute[:, L], np.zeros(1), geometry.layer_compute[L - 1]),
            ),
        )
        usable = np.isfinite(np.minimum.reduce(self.whole_band))
        self._whole_usable = usable
        self._limits = np.unique(self.cap_band[usable])  # in-flight counts where a whole stage stops fitting
        self._banded: dict[tuple, list[np.ndarray]] = {}
        self._keys: dict[int, tuple[int, float]] = {}
        # ``_most`` of every in-flight count takes few distinct values (memory limits change at
        # few counts, and W caps them all when it is low): each in-flight count's level, and the
        # split bounds of the whole band at each level once computed (``_split_entries``).
        flight_most = self._most_of(np.arange(len(geometry._most)))
        self._level_most, self._flight_level = np.unique(flight_most, return_inverse=True)
        self._level_split: dict[int, np.ndarray] = {}
        self._whole_stack = np.stack(self.whole_band)
        # The bands indexed by node end, [s, d] -> node [s - d - 1, s), in flight >= 1 (prefixes).
        node_starts = positions[:, None] - np.arange(1, width + 1)[None, :]
        exists = node_starts >= 0
        self.before = np.where(exists, node_starts, L + 1)
        self._by_end_index = (exists, np.maximum(node_starts, 0), np.broadcast_to(np.arange(width), node_starts.shape))
        self._by_end: dict[tuple, list[np.ndarray]] = {}

    def _whole_sides(self, w: np.ndarray) -> list[np.ndarray]:
        W, r = self.W, self.r
        return [
            np.where(w <= W, w + r * W, INF),
            np.where(w < W, 2 * w + (r - 1) * W, INF),
            np.where(w == W, r * W, INF),
        ]

    def _split_sides(self, parts: tuple, most: float | np.ndarray) -> list[np.ndarray]:
        """Bounds of nodes of two or more stages, each keeping >= ``in_flight`` in flight. A stage
        holds at most ``most`` compute (what fits its memory on as many GPUs as a stage may have,
        and w <= W), so t >= C / most and sum_i C_i / g_i >= (sum_i sqrt C_i)^2 / G, least at a
        vertex of that concave relaxation (``_spread``); and the node's last stage carries its
        link (``_last_stage_floor``)."""
        exists, compute, link, holds_marker, last_stage = parts
        geometry, W, r = self.geometry, self.W, self.r
        G, y = geometry.gpus, geometry.cheapest_intra
        exists = exists & (most > 0)
        most = np.maximum(most, BOUND_SLACK)  # (where it was 0, nothing exists)
        stages = np.maximum(max(2, geometry.stages_per_node), np.ceil(compute / most - BOUND_SLACK))
        least = np.maximum(_spread(compute, most, G), last_stage)
        least = least + (stages - 1) * y + link
        left = least + stages * r * W
        right = 2 * least + stages * (r - 1) * W
        # Holding the marker (a stage of g < G GPUs and compute at most ``held``, costing rW): each
        # other stage costs at least 2w + (r-1)W (w + rW >= that left of the marker, as w <= W);
        # they hold the rest of the compute on G - g GPUs, with all links but one in-node.
        marked = np.full(np.shape(compute), INF)
        for g, held in self.marker_widths.items():
            rest = np.maximum(compute - held, 0.0)
            others = np.maximum(1.0, np.ceil(rest / most - BOUND_SLACK))
            spent = _spread(rest, most, G - g) + (others - 1) * y + np.minimum(link, y)
            marked = np.minimum(marked, 2 * spent + others * (r - 1) * W)
        return [
            np.where(exists, left, INF),
            np.where(exists, right, INF),
            np.where(exists & holds_marker, marked + r * W, INF),
        ]

    def _most_of(self, in_flight: np.ndarray) -> np.ndarray:
        """``_most`` of every entry of ``in_flight``."""
        geometry = self.geometry
        held = geometry.most_compute_of(in_flight)
        return np.maximum(np.minimum(held, self.W * geometry.stage_gpu_limit), 0.0) * (1 + BOUND_SLACK)

    def _most(self, in_flight: int) -> float:
        """The most compute one stage holds: what fits its memory on as many GPUs as a stage may
        have (more GPUs spread the activations), and w <= W."""
        geometry = self.geometry
        most = min(geometry.most_compute(in_flight), self.W * geometry.stage_gpu_limit)
        return max(most, 0.0) * (1 + BOUND_SLACK)

    def _last_stage_floor(self, compute: np.ndarray, link: np.ndarray, last_layer: np.ndarray) -> np.ndarray:
        """The node's last stage carries its link: on g GPUs it holds at least the node's last
        layer and at most (W - link) g; the others hold the rest on G - g GPUs (at most (W - y)
        each), so sum_i C_i / g_i >= C_last / g + (C - C_last) / (G - g), linear in C_last: least
        at one end of its range."""
        geometry, W = self.geometry, self.W
        G, y = geometry.gpus, geometry.cheapest_intra
        slack = 1 + BOUND_SLACK
        floor = np.full(np.shape(compute), INF)
        for g in range(1, min(G - 1, geometry.stage_gpu_limit) + 1):
            rest_gpus = G - g
            high = np.minimum(compute, (W - link) * g * slack)
            low = np.maximum(last_layer, compute - (W - y) * rest_gpus * slack)
            held = high if g >= rest_gpus else low
            value = held / g + np.maximum(compute - held, 0.0) / rest_gpus
            floor = np.minimum(floor, np.where(low <= high, value, INF))
        return floor

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

    def key(self, in_flight: int) -> tuple[int, float]:
        """Equal for in-flight counts between which no memory limit of these bounds changes."""
        found = self._keys.get(in_flight)
        if found is None:  # (a search asks for the same few counts thousands of times)
            found = int(np.searchsorted(self._limits, in_flight, side="left")), self._most(in_flight)
            self._keys[in_flight] = found
        return found

    def by_end(self, in_flight: int) -> list[np.ndarray]:
        """``bands`` indexed by node end: ``[s, d]`` -> node [s - d - 1, s)."""
        key = self.key(in_flight)
        if key not in self._by_end:
            exists, rows, offsets = self._by_end_index
            self._by_end[key] = [np.where(exists, band[rows, offsets], INF) for band in self.bands(in_flight)]
        return self._by_end[key]

    def bands(self, in_flight: int) -> list[np.ndarray]:
        """Banded node bounds (left, right, marker) for nodes keeping >= ``in_flight`` in flight
        (the same arrays between two in-flight counts where no memory limit changes)."""
        key = self.key(in_flight)
        if key not in self._banded:
            fits = self.cap_band >= in_flight
            split = self._split_sides(self._split_band, self._most(in_flight))
            self._banded[key] = [np.minimum(np.where(fits, w, INF), s) for w, s in zip(self.whole_band, split)]
        return self._banded[key]

    def _split_at_level(self, level: int) -> np.ndarray:
        """The split-node bounds (``_split_sides``: left, right, marker) and fewest stages of
        every band entry, stacked, with ``_most`` at ``level``."""
        if level not in self._level_split:
            most = self._level_most[level]
            counts = self._split_stage_counts(self._split_band[0], self._split_band[1], most)
            self._level_split[level] = np.stack([*self._split_sides(self._split_band, most), counts])
        return self._level_split[level]

    def _split_stage_counts(self, exists: np.ndarray, compute: np.ndarray, most: float | np.ndarray) -> np.ndarray:
        """The fewest stages a split node holding ``compute`` needs when no stage may hold more
        than ``most`` (at least two, and the node's own minimum); INF where no such node exists."""
        return np.where(
            exists & (most > 0),
            np.maximum(
                max(2, self.geometry.stages_per_node),
                np.ceil(compute / np.maximum(most, BOUND_SLACK) - BOUND_SLACK),
            ),
            INF,
        )

    def _split_entries(
        self, in_flight: np.ndarray, band_in_flight: np.ndarray, ends: np.ndarray, rows: slice
    ) -> np.ndarray:
        """``_split_at_level`` of the nodes starting at ``rows``, each entry at its own in-flight
        count (``band_in_flight``, read from ``in_flight`` at ``ends``). Every entry is computed
        on its own (elementwise), so the whole band's arrays at an entry's level have its bits:
        with few levels they are computed once and each entry is taken from its level's; with
        many (a level then rarely serves two steps of a chain) the entries are computed here,
        each with its own ``_most``. Entries past the last layer are INF at every level (no node
        there fits or splits), so they take any: the levels that matter are those of the ends
        the rows reach, first + 1 .. last + width (at most L)."""
        if len(self._level_most) <= LEVELS_CACHED:
            L = self.geometry.num_layers
            level_of_end = self._flight_level[np.minimum(in_flight, len(self._flight_level) - 1)]
            first, stop, _ = rows.indices(L + 1)
            reached = level_of_end[first + 1 : min(stop - 1 + self.width, L) + 1]
            low, high = (int(reached.min()), int(reached.max())) if reached.size else (0, 0)
            split = self._split_at_level(low)[:, rows]
            if high > low:
                levels = level_of_end[ends]
                for level in range(low + 1, high + 1):
                    split = np.where(levels == level, self._split_at_level(level)[:, rows], split)
            return split
        most = self._most_of(band_in_flight)
        counts = self._split_stage_counts(self._split_band[0][rows], self._split_band[1][rows], most)
        return np.stack([*self._split_sides(tuple(part[rows] for part in self._split_band), most), counts])

    def chain_steps(self, in_flight: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
        """Stacked: ``bands`` (left, right, marker) with its own in-flight count for every node
        end, ``in_flight[s]``, and the fewest stages of every node: ``[k, x, d]`` -> node
        [x, x + d + 1) with all stages under W keeping >= ``in_flight[x + d + 1]`` in flight
        (INF: none); only the nodes starting at ``rows`` (every entry is computed on its own, so
        a slice of rows is that slice of all of them)."""
        ends = self.after[rows]
        if len(in_flight) < self.geometry.num_layers + 2:
            ends = np.minimum(ends, len(in_flight) - 1)
        band_in_flight = in_flight[ends]
        fits = self.cap_band[rows] >= band_in_flight
        split = self._split_entries(in_flight, band_in_flight, ends, rows)  # (may view a cached level)
        steps = np.empty_like(split)
        np.minimum(np.where(fits, self._whole_stack[:, rows], INF), split[:3], out=steps[:3])
        steps[3] = np.where(self._whole_usable[rows] & fits, 1.0, split[3])
        return steps

    def last_vectors(self) -> list[np.ndarray]:
        whole, parts = self._last
        return [np.minimum(w, s) for w, s in zip(whole, self._split_sides(parts, self._most(1)))]

    def last_stage_counts(self) -> np.ndarray:
        whole, parts = self._last
        most = self._most(1)
        split = np.where(
            parts[0] & (most > 0),
            np.maximum(max(2, self.geometry.stages_per_node), np.ceil(parts[1] / max(most, BOUND_SLACK) - BOUND_SLACK)),
            INF,
        )
        return np.where(np.isfinite(np.minimum.reduce(whole)), 1.0, split)


def _spread(compute: np.ndarray, most: float | np.ndarray, gpus: int) -> np.ndarray:
    """The least sum_i C_i / g_i of stages splitting ``compute`` with C_i <= ``most`` on ``gpus``
    GPUs in all (``NodeCosts._split_sides``)."""
    full = np.floor(compute / most)
    roots = full * np.sqrt(most) + np.sqrt(np.maximum(compute - full * most, 0.0))
    return np.maximum(compute, roots * roots) / gpus


def root_bounds(costs: NodeCosts, max_nodes: int) -> np.ndarray:
    """``bound[n]`` (n = 0 .. max_nodes): T of any layout on n nodes whose bottleneck is W is at
    least this (INF: there is none). Built right to left, with the fewest stages any cover of
    what lies to the right of a node can have: its stages keep at least one more in flight."""
    bound = np.full(max_nodes + 1, INF)
    if max_nodes < 1:
        return bound
    L = costs.geometry.num_layers
    after = costs.after  # [x, d] -> x + d + 1, or L + 1 (an INF slot) past the end
    _, last_right, last_marker = costs.last_vectors()
    # Stacked by row: [0, x] covering [x, L) right of the marker, [1, x] the same holding the
    # marker, [2, x] the fewest stages covering [x, L) with the same nodes (slot L + 1: nothing).
    state = np.full((3, L + 2), INF)
    state[0, : L + 1], state[1, : L + 1], state[2, : L + 1] = last_right, last_marker, costs.last_stage_counts()
    bound[1] = state[1, 0]
    width = costs.width
    reached = np.isfinite(state).any(axis=0)
    first = int(np.argmax(reached)) if reached.any() else L + 1  # rows before it are INF
    # The state row each of ``chain_steps``' rows (left, right, marker, stage counts) adds to.
    follows = [1, 0, 0, 2]
    for u in range(2, max_nodes + 1):
        # Row x reads rows x + 1 .. x + width of the step before (a node of at most ``width``
        # layers before the cover of the rest), so rows more than ``width`` before that step's
        # first are INF; a row past L - u leaves fewer layers than nodes; and a row past
        # (max_nodes - u) width cannot be reached from layer 0 by the nodes still to come, so it
        # is never read again. Only the rows between are computed.
        first, last = max(0, first - width), min(L - u, (max_nodes - u) * width)
        if first > last:
            break  # every later bound is INF
        rows = slice(first, last + 1)
        fewest = state[2]
        in_flight = np.where(np.isfinite(fewest), fewest + 1, L + 2).astype(np.int64)
        steps = costs.chain_steps(np.maximum(in_flight, u), rows)
        best = (steps + state[follows][:, after[rows]]).min(axis=2)  # [k, x]
        state = np.full((3, L + 2), INF)
        state[0, rows] = best[1]
        state[1, rows] = np.minimum(best[2], best[0])
        state[2, rows] = best[3]
        bound[u] = state[1, 0]
    return bound * (1 - BOUND_SLACK)


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
