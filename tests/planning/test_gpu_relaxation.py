"""The GPU-level relaxation (``gpu_relaxation._GpuRelaxation``) against the exact searches.

It bounds T, at one bottleneck W, of every layout on n nodes, with exact stage times, GPU counts,
node boundaries and the marker, and only the microbatches each stage keeps in flight relaxed.
The sweep skips a search where the bound reaches the budget, so the bound must never exceed the
best T of a layout with bottleneck W: checked against brute force over every layout (runs of
identical layers, memory from unlimited to forcing a stage per layer) and against the exact DP
on larger memory-tight cases. Where memory does not bind, nothing is relaxed: the bound is the
best T itself.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import all_layouts
from test_identical_layer_runs import RUN_CASES, memory_tight_case, runs_profile

from oobleck.errors import PlanningError
from oobleck.planning.bottleneck_search import _stage_links
from oobleck.planning.gpu_relaxation import _GpuRelaxation
from oobleck.planning.pipeline_cost import pipeline_iteration_time
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.templates import _DeepRecursion, _feasibility, stage_memories_of
from oobleck.planning.threshold_search import _solve_for_threshold
from testing.plans import cluster

# Sums in another order than the brute force's: equal up to rounding.
REL = 1e-9


def _best_by_bottleneck(profile, spec, table, nodes, r, limit):
    """{W: {n: (best T, its rightmost slowest stage)}} over every memory-feasible layout."""
    best: dict[float, dict[int, tuple[float, tuple[int, int, int]]]] = defaultdict(dict)
    for n in range(1, nodes + 1):
        for stages in all_layouts(profile.num_layers, n, spec.gpus_per_node, limit):
            if any(m > spec.device_memory_bytes for m in stage_memories_of(profile, stages)):
                continue
            links = _stage_links(stages)
            seconds = [table.cost[s.gpus][link][s.end][s.start] for s, link in zip(stages, links)]
            W = max(seconds)
            k = max(i for i, w in enumerate(seconds) if w == W)
            T = pipeline_iteration_time(seconds, r * len(stages))
            marker = (stages[k].start, stages[k].end, stages[k].gpus)
            if n not in best[W] or T < best[W][n][0]:
                best[W][n] = (T, marker)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**RUN_CASES)
def test_relaxation_never_exceeds_brute_force(runs, gpus, nodes, memory, r, max_gpus):
    profile = runs_profile(runs)
    spec = cluster(nodes, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    table = _StageTable(profile, spec, limit)
    best = _best_by_bottleneck(profile, spec, table, nodes, r, limit)
    for W, by_nodes in best.items():
        free = _GpuRelaxation(table, gpus, W, r, None).bounds(nodes)
        for n, (T, marker) in by_nodes.items():
            assert free[n] <= T * (1 + REL), (W, n, free[n], T)
            # The sweep passes the markers it may take: the bound of that set, with this one in it.
            assert _GpuRelaxation(table, gpus, W, r, {marker}).bounds(nodes)[n] <= T * (1 + REL)
        if memory == 1e13:  # nothing relaxed: the best T of every node count, and INF where none
            for n in range(1, nodes + 1):
                expected = by_nodes[n][0] if n in by_nodes else math.inf
                assert free[n] == pytest.approx(expected, rel=REL), (W, n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**RUN_CASES, pick=st.randoms(use_true_random=False))
def test_interval_relaxation_never_exceeds_brute_force(runs, gpus, nodes, memory, r, max_gpus, pick):
    """Over an interval of bottlenecks [low, high] (stage costs at low, stages up to high, any
    stage within it the marker): never above the best T of a layout whose bottleneck lies in it,
    so the sweep may skip every threshold of an interval whose bound reaches the budget."""
    profile = runs_profile(runs)
    spec = cluster(nodes, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    table = _StageTable(profile, spec, limit)
    best = _best_by_bottleneck(profile, spec, table, nodes, r, limit)
    bottlenecks = sorted(best)
    for _ in range(4):
        if not bottlenecks:
            break
        first = pick.randrange(len(bottlenecks))
        last = min(first + pick.randrange(1, 9), len(bottlenecks) - 1)
        low, high = bottlenecks[first], bottlenecks[last]
        bounds = _GpuRelaxation(table, gpus, low, r, None, top=high).bounds(nodes)
        for W in bottlenecks[first : last + 1]:
            for n, (T, _) in best[W].items():
                assert bounds[n] <= T * (1 + REL), (low, high, W, n, bounds[n], T)


def test_relaxation_never_exceeds_the_exact_search():
    """Seeded random cases where memory puts several stages on a node (runs of identical layers
    in a GPT's shape, and jittered layers): at every fifth candidate bottleneck, the bound of every
    node count against the exact DP's best T at that W; and mostly the bound is that T."""
    rng = random.Random(3030)
    checked = tight = 0
    for case in range(12):
        profile, spec = memory_tight_case(rng, case % 3 != 0, (8, 20), 950, [5e9, 8e9, 12e9], [3e9, 5e9, 8e9])
        r = rng.choice([1, 2, 4])
        G = spec.gpus_per_node
        try:
            table, _, n0 = _feasibility(profile, spec, G)
        except PlanningError:
            continue
        nodes = range(n0, min(spec.nodes, n0 + 2) + 1)
        with _DeepRecursion(profile.num_layers):
            for W in table.candidates[::5]:
                W = float(W)
                bounds = _GpuRelaxation(table, G, W, r, None).bounds(max(nodes))
                exact = _solve_for_threshold(table, G, W, r, dict.fromkeys(nodes, math.inf))
                for n in nodes:
                    value = exact[n][0] if n in exact else math.inf
                    assert bounds[n] <= value * (1 + REL), (case, W, n, bounds[n], value)
                    checked += value < math.inf
                    tight += value < math.inf and bounds[n] >= value * (1 - REL)
    assert checked >= 20
    assert tight >= checked // 2  # the relaxation is mostly exact there: it decides searches
