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
for a node count once a lower bound reaches the best T found (``threshold_sweep``).

Speed without giving up exactness (branch and bound): both searches start from the best layout with
one full-node stage per node (a cheap min-max partition, then improved) as an upper bound and look
only for layouts better than it by more than ``TIE_SLACK`` (1e-12 relative); a sub-search that cannot beat its budget stops and is memoised as a lower
bound. Most thresholds never reach the DP: bounds rule them out first (``threshold_sweep``). The
exactness tests compare against brute force over every layout (the bounds themselves too:
``tests/planning/test_node_bounds.py``), and medium cases against slower searches of earlier
versions; benchmarks/bench_planner.py measures the speed. With r = 1 extra stages cost nothing in
Eq. 1-4 (the (r-1) W per stage vanishes), the bounds lose most of their grip and the search takes
seconds where r = 4 takes a fraction of one.

Where the parts live (each module's docstring explains its mechanism):

- this module: the template set, n0, ``generate_templates`` and a layout's cost-model figures;
- ``stage_table``: every candidate stage's time and memory limit, as the searches read them;
- ``bottleneck_search``: the seeds (one stage per node), their descent, and the DP for the least
  slowest stage (n0, and the stage counts a threshold forces);
- ``threshold_search``: the exact DP for one bottleneck W;
- ``threshold_sweep``: the sweep over W, and which bounds rule a W out before the DP
  (``marker_bounds``, ``gpu_relaxation``, ``node_bounds``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oobleck.errors import PlanningError
from oobleck.planning.bottleneck_search import _bottleneck_dp, _stage_links, _to_stages
from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.node_geometry import bottleneck_floor
from oobleck.planning.outputs import PipelineTemplate, StageSpec
from oobleck.planning.pipeline_cost import ProfileArrays, link_seconds, pipeline_iteration_time
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.threshold_sweep import TemplateProgress, _sweep_thresholds

INF = math.inf


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
