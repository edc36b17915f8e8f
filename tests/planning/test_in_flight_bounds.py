"""Bounds from what memory forces at the stages' in-flight counts: exact counts against an
exhaustive search, and a template search that uses them returns the same templates, bit for bit,
as the search without them.

Stage i of S keeps S - i microbatches in flight, so memory bounds how many stages a range needs
(``_StageTable.memory_stage_counts``, and on few GPUs ``gpu_stage_counts``: narrow stages hold
few layers) and how far from the pipeline's end the bottleneck stage may sit (its own memory
limit). The template search uses both to skip searches that cannot find a better layout.
"""

from __future__ import annotations

import math
import random
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import SMALL_PROBLEMS
from test_identical_layer_runs import memory_tight_case

import oobleck.planning.threshold_sweep as sweep_module
from oobleck.errors import PlanningError
from oobleck.planning.pipeline_cost import stage_memory_bytes
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import _DeepRecursion, _feasibility
from oobleck.planning.threshold_sweep import _sweep_thresholds
from testing.plans import cluster


def _fits(profile, memory, start, end, gpus, in_flight):
    return stage_memory_bytes(profile, start, end, gpus, 0, in_flight) <= memory


def _fewest_covers(profile, memory, limit, most_gpus):
    """``fewest(s, j, u)``: the fewest stages covering [0, s) on at most u GPUs (None: any), the
    first from the right keeping j + 1 in flight, over every cover (every start, every width)."""

    @cache
    def fewest(s, j, u):
        if s == 0:
            return 0
        best = math.inf
        for start in range(s):
            for g in range(1, limit + 1):
                if (u is None or g <= u) and _fits(profile, memory, start, s, g, j + 1):
                    best = min(best, 1 + fewest(start, j + 1, None if u is None else u - g))
        return best

    return fewest


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL_PROBLEMS, identical=st.booleans())
def test_stage_counts_match_every_cover(layers, gpus, nodes, seed, memory, output_bytes, max_gpus, identical):
    profile = synthetic_profile(layers, seed=seed, jitter=0.0 if identical else 0.6, output_bytes=output_bytes)
    spec = cluster(nodes, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    table = _StageTable(profile, spec, limit)
    fewest = _fewest_covers(profile, memory, limit, nodes * gpus)
    after, before, before_lists = table.memory_stage_counts()
    by_gpus = table.gpu_stage_counts(nodes * gpus)
    for s in range(layers + 1):
        for j in range(layers + 1 - s):  # j stages right of [0, s): no layout reaches more
            assert before[j, s] == before_lists[j][s] == fewest(s, j, None), (s, j)
            for u in range(nodes * gpus + 1):
                assert by_gpus[j][u][s] == fewest(s, j, u), (s, j, u)

    # The last stages of a layout: the j-th from the right keeps j in flight.
    def last(e):
        @cache
        def cover(end, count):  # [e, end) with ``count`` stages after it
            if end == e:
                return 0
            options = [
                1 + cover(start, count + 1)
                for start in range(e, end)
                if any(_fits(profile, memory, start, end, g, count + 1) for g in range(1, limit + 1))
            ]
            return min(options, default=math.inf)

        return cover(layers, 0)

    for e in range(layers + 1):
        assert after[e] == last(e), e


def _sweeps(profile, spec, r):
    """The sweep's result with the in-flight bounds and without, and how many threshold DPs each
    ran."""
    try:
        table, bottleneck, _ = _feasibility(profile, spec, spec.gpus_per_node)
    except PlanningError:
        return None
    wanted = [n for n in bottleneck if bottleneck[n] < math.inf]
    real = sweep_module._solve_for_threshold
    searches = {True: 0, False: 0}
    results = {}
    with _DeepRecursion(profile.num_layers):
        for in_flight in (True, False):

            def counting(*args, flag=in_flight, **kwargs):
                searches[flag] += 1
                return real(*args, **kwargs)

            sweep_module._solve_for_threshold = counting
            try:
                results[in_flight] = _sweep_thresholds(
                    table, spec.gpus_per_node, r, wanted, bottleneck, in_flight=in_flight
                )
            finally:
                sweep_module._solve_for_threshold = real
    return results[True], results[False], searches


def test_in_flight_bounds_change_no_template():
    """Seeded random profiles where memory puts several stages on a node (runs of identical
    layers, the shape of a GPT, and jittered layers), with r = 1 .. 4: the same layouts and
    values, to the last bit, with the bounds and without; and the bounds saved searches."""
    rng = random.Random(5050)
    saved = 0
    for case in range(30):
        profile, spec = memory_tight_case(
            rng, case % 3 != 0, (10, 28), 950, [5e9, 8e9, 12e9], [3e9, 5e9, 8e9], [100_000_000, 400_000_000]
        )
        result = _sweeps(profile, spec, rng.choice([1, 2, 4]))
        if result is None:
            continue
        fast, slow, searches = result
        assert fast == slow, case
        assert searches[True] <= searches[False], case
        saved += searches[False] - searches[True]
    assert saved >= 10
