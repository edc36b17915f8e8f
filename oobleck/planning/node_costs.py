"""Lower bounds of every node's cost at one threshold W, by side of the marker (``NodeCosts``).

Every node [x, s) gets a lower bound of its cost left of the marker, right of it and holding it
(the bullets of ``node_bounds``' module docstring): exact for one stage on all G GPUs, at least
the compute floor (``_spread``), links and per-stage terms for two or more stages. They are kept
as bands (a node at threshold W holds at most ``width`` layers) for the in-flight counts the chains
ask for, built once for all counts between which no memory limit changes (``key``); with at most
``LEVELS_CACHED`` values of the most compute a stage may hold, the split-node bounds once per
value. ``root_bounds`` (``node_bounds``) and ``PrefixBounds`` (``prefix_bounds``) chain them over
positions.
"""

from __future__ import annotations

import numpy as np

from oobleck.planning.node_geometry import BOUND_SLACK, INF, NodeGeometry

# Where the most compute a stage may hold takes at most this many values over the in-flight counts
# of one threshold (memory limits change at few counts, or W caps them all), the chains take split
# nodes' bounds from the whole band computed once per value; with more, each step computes its own.
LEVELS_CACHED = 4


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
