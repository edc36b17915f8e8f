"""Instantiation: cover the live nodes with template pipelines and split the batch over them.

Predicted iteration time of a plan with k pipelines (documented in ``oobleck.planning.pipeline_cost``):

    V = max_p [ T_p(m_p) + intra_p ] + ring(k, X)

``T_p(m)`` is ``pipeline_time`` of pipeline p's template with m microbatches; ``intra_p`` is the
slowest in-node all-reduce among p's stages (a stage of g devices reduces its parameters'
gradients over g devices); the cross-pipeline ring all-reduce starts when the slowest pipeline
is done and moves, on the busiest node, ``X`` = the largest parameter bytes one node holds in any
chosen pipeline (every layer's gradient is reduced among the k pipelines that hold it).

Batch distribution: each ``T_p`` is nondecreasing in m, so the min-max integer split is exact
with a search on the finishing time (no MINLP solver). Choosing the pipelines is exact and
polynomial: for every pipeline count k and every cap X on bytes per node, a search on the
finishing time t asks a knapsack DP "can k templates with sum of nodes N take M microbatches by
time t?" (each template's capacity at t is its largest m with ``T(m) + intra <= t``); no
enumeration of template multisets. Both searches test feasibility only where it can change (at
some ``T(m) + intra``), so they end on the exact optimum, at any m including m <= S; and every
time and capacity comes from one function (``_PipelineCurve``), so they agree to the last bit.

Speed without giving up exactness: the (X, k) pairs are taken best-first by lower bounds of
their value (some pipeline runs ceil(M / K) microbatches; the Eq. 1-4 lines with fractional
template counts, whose optimum uses at most two sizes; lazily, the same with integer
capacities), and the search stops at the first bound that cannot beat the best plan found, so
usually one or two pairs reach the knapsack (benchmarks/bench_planner.py measures it). The
bounds are computed by other float operations than the times, so they carry a relative slack.

Where the parts live (each module's docstring explains its mechanism):

- this module: ``instantiate``, ``build_plan``, V (``plan_iteration_time``) and the best-first
  search over (X, k) pairs (``_search_multiset``, memoised as ``_best_multiset``);
- ``batch_distribution``: ``_PipelineCurve``, the finishing-time search (``_least_time``) and the
  min-max split (``distribute_microbatches``);
- ``count_search``: one (X, k) pair: the knapsack DP and the lower bounds that order the pairs;
- ``gradient_sync``: ``intra_p``, the bytes per node and the ring (``_Sync``, ``sync_of``), and
  the bound on the template set's memo (``_remember``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import cast

from oobleck.errors import PlanningError
from oobleck.planning.batch_distribution import (
    _min_max_split,
    _PipelineCurve,
    distribute_microbatches,  # noqa: F401 (callers import it from here)
)
from oobleck.planning.count_search import _count_floors, _CountSearch
from oobleck.planning.gradient_sync import _remember, _Sync, sync_of
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate
from oobleck.planning.templates import TemplateSet

# The knapsack adds up to M capacities of at most M each in int64, below its -2**60 sentinel:
# M * M must stay under 2**58, so at most 2**29 microbatches per iteration (536,870,912).
MAX_MICROBATCHES = 2**29


def plan_iteration_time(
    templates: Sequence[PipelineTemplate], microbatches: Sequence[int], sync: _Sync
) -> tuple[float, list[float]]:
    """V of the module docstring, and each pipeline's ``T_p(m_p) + intra_p``."""
    per_pipeline = [
        _PipelineCurve(t.stage_seconds, sync.intra_of[t.num_nodes]).time(m) for t, m in zip(templates, microbatches)
    ]
    node_bytes = max(sync.node_bytes_of[t.num_nodes] for t in templates)
    return max(per_pipeline) + sync.cross(len(templates), node_bytes), per_pipeline


def _best_multiset(
    templates: TemplateSet,
    nodes: int,
    microbatches: int,
    min_pipelines: int,
    sync: _Sync,
    fixed: Sequence[int] = (),
) -> tuple[float, list[int]] | None:
    """``_search_multiset``, memoised on the template set: it is a pure function of the set, the
    bandwidths behind ``sync`` and the other (hashable) arguments, and a reconfiguration asks it
    the same questions over and over (a fresh plan per node count, a regroup per intact sizes)."""
    key = ("multiset", sync.intra, sync.inter, nodes, microbatches, min_pipelines, tuple(sorted(fixed, reverse=True)))
    if key not in templates.memo:
        _remember(templates, key, _search_multiset(templates, nodes, microbatches, min_pipelines, sync, fixed))
    result = templates.memo[key]
    return None if result is None else (result[0], list(result[1]))  # a copy: callers may mutate it


def _search_multiset(
    templates: TemplateSet,
    nodes: int,
    microbatches: int,
    min_pipelines: int,
    sync: _Sync,
    fixed: Sequence[int] = (),
) -> tuple[float, list[int]] | None:
    """The exact best choice of template sizes covering ``nodes`` with at least ``min_pipelines``
    (and at most ``microbatches``) pipelines, always including the sizes in ``fixed``; its
    predicted iteration time first. None if no choice exists. See the module docstring.

    Every (cap X on bytes per node, count) pair gets a lower bound on its value; pairs are
    taken in the order of their bounds, first to tighten the bound (``relaxed_floor``, cheap),
    then to be solved exactly, and the search stops at the first bound that cannot beat the best
    plan found (ties keep the first found, so the choice is deterministic).
    """
    fixed = sorted(fixed, reverse=True)
    free = nodes - sum(fixed)
    sizes = [n for n in templates.sizes if n <= free]
    if free < 0 or (free > 0 and not sizes):
        return None
    curves = {n: _PipelineCurve(templates[n].stage_seconds, sync.intra_of[n]) for n in {*sizes, *fixed}}
    fixed_curves = [curves[n] for n in fixed]
    fixed_bytes = max((sync.node_bytes_of[n] for n in fixed), default=0)
    most_free = min(free // min(sizes), microbatches - len(fixed)) if free else 0
    counts = range(max(min_pipelines - len(fixed), 1 if free else 0), most_free + 1)
    if not counts:
        return None
    floors = _count_floors([curves[n] for n in sizes], sizes, fixed_curves, free, counts, microbatches)
    node_caps = sorted({max(fixed_bytes, sync.node_bytes_of[n]) for n in sizes}) or [fixed_bytes]
    pairs = []
    for index, x in enumerate(node_caps):
        allowed = [n for n in sizes if sync.node_bytes_of[n] <= x]
        if free and not allowed:
            continue
        most = min(free // min(allowed), microbatches - len(fixed)) if free else 0
        for c in counts:
            if c <= most:
                pairs.append((floors[c] + sync.cross(c + len(fixed), x), 0, index, c, floors[c]))
    heapq.heapify(pairs)
    searches: dict[int, _CountSearch] = {}
    best: tuple[float, list[int]] | None = None
    while pairs:
        bound, refined, index, c, floor = heapq.heappop(pairs)
        if best is not None and bound >= best[0]:
            break
        x = node_caps[index]
        if index not in searches:
            allowed = [n for n in sizes if sync.node_bytes_of[n] <= x]
            searches[index] = _CountSearch([curves[n] for n in allowed], allowed, fixed_curves, free, microbatches)
        search = searches[index]
        cross = sync.cross(c + len(fixed), x)
        # Only a plan faster than the best so far matters: its compute must end by `limit`.
        limit = best[0] - cross if best is not None else None
        if not refined:  # first a tighter bound (cheap), then back in line by it
            tighter = search.relaxed_floor(c, floor, limit)
            if tighter is not None:
                heapq.heappush(pairs, (tighter + cross, 1, index, c, tighter))
            continue
        result = search.solve(c, floor, limit)
        if result is None:
            continue
        t, chosen = result
        multiset = sorted([*fixed, *chosen], reverse=True)
        # The least t of this count is the min-max split time of the multiset it returns.
        value = t + sync.cross(len(multiset), max(sync.node_bytes_of[n] for n in multiset))
        if best is None or value < best[0]:
            best = (value, multiset)
    return best


def instantiate(
    templates: TemplateSet,
    nodes: Sequence[int],
    global_batch_size: int,
    microbatch_size: int,
    fault_tolerance: int,
    *,
    intra_node_bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
) -> ExecutionPlan:
    """The best plan over ``nodes`` (live node ids; sorted order is assignment order)."""
    if microbatch_size <= 0 or global_batch_size <= 0 or global_batch_size % microbatch_size:
        raise PlanningError(
            f"job.global_batch_size={global_batch_size} must be a positive multiple of "
            f"job.microbatch_size={microbatch_size}"
        )
    node_ids = sorted(nodes)
    if len(set(node_ids)) != len(node_ids):
        raise PlanningError(f"node ids {node_ids} contain duplicates")
    N = len(node_ids)
    M = global_batch_size // microbatch_size
    if M > MAX_MICROBATCHES:
        raise PlanningError(microbatch_limit_message(global_batch_size, microbatch_size))
    f = fault_tolerance
    n0 = templates.min_nodes
    if N < (f + 1) * n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={N}"
        )
    if M < f + 1:
        raise PlanningError(
            f"{M} microbatches (job.global_batch_size={global_batch_size} / job.microbatch_size={microbatch_size}) "
            f"are fewer than the f+1={f + 1} pipelines; raise the batch or lower the microbatch size"
        )
    sync = sync_of(templates, intra_node_bandwidth, inter_node_bandwidth)
    chosen = _best_multiset(templates, N, M, f + 1, sync)
    if chosen is None:
        raise PlanningError(
            f"no combination of at least {f + 1} pipelines from templates of {list(templates.sizes)} nodes "
            f"covers exactly {N} nodes with at most {M} microbatches; check job.fault_tolerance and the cluster size"
        )
    return build_plan(templates, chosen[1], node_ids, global_batch_size, microbatch_size, f, sync)


def _split_of(
    templates: TemplateSet, sizes: tuple[int, ...], microbatches: int, sync: _Sync
) -> tuple[list[int], float, list[float]]:
    """The min-max split of the microbatches over pipelines of ``sizes`` (in this order), V and
    every pipeline's time: pure in its arguments, so memoised on the template set."""
    key = ("split", sync.intra, sync.inter, sizes, microbatches)
    if key not in templates.memo:
        chosen = [templates[n] for n in sizes]
        curves = [_PipelineCurve(t.stage_seconds, sync.intra_of[t.num_nodes]) for t in chosen]
        split = _min_max_split(curves, microbatches)
        value, per_pipeline = plan_iteration_time(chosen, split, sync)
        _remember(templates, key, (tuple(split), value, tuple(per_pipeline)))
    split, value, per_pipeline = templates.memo[key]
    return list(split), value, list(per_pipeline)


def microbatch_limit_message(global_batch_size: int, microbatch_size: int) -> str:
    return (
        f"job.global_batch_size={global_batch_size} / job.microbatch_size={microbatch_size} = "
        f"{global_batch_size // microbatch_size} microbatches per iteration, more than the planner's "
        f"{MAX_MICROBATCHES}; lower job.global_batch_size or raise job.microbatch_size"
    )


def build_plan(
    templates: TemplateSet,
    pipeline_sizes: Sequence[int],
    node_groups_or_ids: Sequence[int] | Sequence[Sequence[int]],
    global_batch_size: int,
    microbatch_size: int,
    fault_tolerance: int,
    sync: _Sync | None = None,
) -> ExecutionPlan:
    """A plan from template sizes and nodes (a flat sorted id list, or one id list per pipeline).

    Flat ids are dealt out in pipeline order, larger pipelines first. Microbatches are split by
    the exact min-max distribution; offsets are contiguous in pipeline order.
    """
    if sync is None:
        sync = sync_of(templates)
    M = global_batch_size // microbatch_size
    groups: list[tuple[int, ...]] = []
    if node_groups_or_ids and isinstance(node_groups_or_ids[0], int):
        sizes = sorted(pipeline_sizes, reverse=True)
        ids = list(cast("Sequence[int]", node_groups_or_ids))
        offset = 0
        for size in sizes:
            groups.append(tuple(ids[offset : offset + size]))
            offset += size
    else:
        groups = [tuple(g) for g in cast("Sequence[Sequence[int]]", node_groups_or_ids)]
        sizes = [len(g) for g in groups]
    chosen = [templates[n] for n in sizes]
    split, value, per_pipeline = _split_of(templates, tuple(sizes), M, sync)
    pipelines, first = [], 0
    for index, (template, group, m, t) in enumerate(zip(chosen, groups, split, per_pipeline)):
        pipelines.append(
            PipelineInstance(
                index=index,
                template=template,
                nodes=group,
                microbatches=m,
                first_microbatch=first,
                predicted_iteration_s=t,
            )
        )
        first += m
    return ExecutionPlan(
        pipelines=tuple(pipelines),
        num_layers=templates.num_layers,
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        fault_tolerance=fault_tolerance,
        gpus_per_node=templates.gpus_per_node,
        predicted_iteration_s=value,
    )
