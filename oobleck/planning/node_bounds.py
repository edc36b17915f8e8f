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

Where the parts live (each module's docstring explains its part):

- this module: ``root_bounds``, the chain over whole nodes from the last layer;
- ``node_geometry``: the threshold-independent arrays (``NodeGeometry``) and the floors under the
  slowest stage of any layout on n nodes (``bottleneck_floor``, ``split_node_floors``);
- ``node_costs``: every node's bounds at W, by side of the marker (``NodeCosts``);
- ``prefix_bounds``: the chain from the first layer, the DP's estimate (``PrefixBounds``).
"""

from __future__ import annotations

import numpy as np

from oobleck.planning.node_costs import (
    LEVELS_CACHED,  # noqa: F401 (callers import it from here)
    NodeCosts,
)
from oobleck.planning.node_geometry import (
    BOUND_SLACK,
    INF,
    NodeGeometry,  # noqa: F401 (callers import it from here)
    bottleneck_floor,  # noqa: F401 (callers import it from here)
    split_node_floors,  # noqa: F401 (callers import it from here)
)
from oobleck.planning.prefix_bounds import (
    LazyRows,  # noqa: F401 (callers import it from here)
    PrefixBounds,  # noqa: F401 (callers import it from here)
)


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
