"""The GPU-level relaxation: a lower bound of T at one threshold W for every node count at once.

The additive form of Eq. 1-4 (``templates``' module docstring) over stages, with exact stage
times, GPU counts, node boundaries and marker, and only the microbatches in flight relaxed (to
what the nodes to the right and memory on the layers after force), one numpy pass for every node
count; it is the exact best T wherever memory does not bind and, on memory-tight profiles, almost
always (85 of 86 seeded checks), so it decides most searches there that would find nothing
(gpt128: 98 of 130). For node counts where memory forces more stages than nodes, a threshold the
compute and per-marker bounds (``marker_bounds``) leave meets it before the chain bound of
``node_bounds`` (``threshold_sweep``).
"""

from __future__ import annotations

import math

import numpy as np

from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE
from oobleck.planning.stage_table import _StageTable

INF = math.inf


class _GpuRelaxation:
    """Lower bounds of T at one threshold W for every node count up to ``max_nodes`` at once, from
    the additive form of Eq. 1-4 (module docstring of ``templates``) with exact stage times, GPU
    counts, node boundaries and the marker, and only the microbatches in flight relaxed.

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

    def __init__(
        self,
        table: _StageTable,
        gpus: int,
        W: float,
        r: int,
        markers: set[tuple[int, int, int]] | None,
        top: float | None = None,
    ):
        bands = table.stage_bands()
        self.gpus, self.rW = gpus, r * W
        top = W if top is None else top
        # Only stages with w <= top are placed: no longer ones than the longest such.
        at_most = bands.w <= top
        length = int(np.flatnonzero(at_most.any(axis=(0, 1, 3)))[-1]) + 1 if at_most.any() else 1
        w, at_most = bands.w[:, :, :length], at_most[:, :, :length]
        self.ends, self.length = bands.ends[:length], length
        # The most each stage keeps in flight where that covers what follows it, else 0.
        self.room = np.where(bands.cap[:, :length] >= bands.need[:length][None], bands.cap[:, :length], 0.0)
        # Cost of a stage left of the marker and right of it.
        self.left = np.where(at_most, w + self.rW, INF)
        self.right = np.where(w < top, 2 * w + (r - 1) * W, INF)
        # The markers (stages of time exactly W the DP may take as the bottleneck), as arrays.
        exact = (w >= W) & (w <= top)
        if markers is not None:
            allowed = np.zeros(exact.shape, dtype=bool)
            listed = np.array(sorted(markers), dtype=np.int64).reshape(-1, 3)
            listed = listed[listed[:, 1] - listed[:, 0] <= length]
            allowed[listed[:, 2], :, listed[:, 1] - listed[:, 0] - 1, listed[:, 0]] = True
            exact &= allowed
        gpus_, links, lengths, starts = np.nonzero(exact)
        self.markers = (gpus_, lengths, starts, links)
        self.marker_room = self.room[gpus_, lengths, starts]
        self.marker_by_link = {link: np.flatnonzero(links == link) for link in (LINK_NONE, LINK_INTRA, LINK_INTER)}
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
            on_node = used % G
            link = LINK_NONE if used == 0 else (LINK_INTRA if on_node else LINK_INTER)
            in_flight = used // G + (2 if on_node else 1)
            most = min(widest, G - on_node, most_gpus - used)
            rows = slice(used + 1, used + most + 1)
            costs = None
            # Stages left of the marker extend ``marked`` states, those right of it ``open_``
            # ones; each only from the positions where a state of its kind was reached.
            for states, kind in ((marked, 0), (open_, 1)):
                here = states[used]
                reached = np.flatnonzero(here < INF)
                if not reached.size:
                    continue
                if costs is None:
                    costs = self._costs(link, in_flight)
                # Only stages ending where a state was reached: starts from ``first`` to ``last``.
                span = slice(max(int(reached[0]) - length, 0), int(reached[-1]))
                found = (here[ends[:, span]] + costs[kind][1 : most + 1, :, span]).min(axis=1)
                np.minimum(states[rows, span], found, out=states[rows, span])
            # The marker: rW, where it fits in flight (a few stages, placed one by one).
            before = open_[used]
            chosen = self.marker_by_link[link]
            chosen = chosen[(m_gpus[chosen] <= most) & (self.marker_room[chosen] >= in_flight)]
            chosen = chosen[before[m_end[chosen]] < INF]
            if chosen.size:
                np.minimum.at(marked, (used + m_gpus[chosen], m_start[chosen]), before[m_end[chosen]] + self.rW)
        result = np.full(max_nodes + 1, INF)
        result[1:] = marked[G::G, 0][:max_nodes]
        return result
