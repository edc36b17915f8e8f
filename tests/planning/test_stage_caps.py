"""The stage-count bound of the template sweep: exact against brute force, and a search that
skips thresholds by it returns the same templates, bit for bit, as the search without it.

Feasibility is monotone in the bottleneck: a layout of at most s stages, all at most W, exists
for every W from the least slowest stage of such layouts (``_bottleneck_dp`` with ``stage_cap``)
on, and for none below it. The sweep uses that to rule out, without a search, thresholds that
force more stages than a better layout can have (``_sweep_thresholds``). Where one stage per node
fits memory, the least slowest stage of n stages on n nodes is the seed's
(``_one_stage_per_node``), and thresholds below it force n + 1 stages; below the floor under the
slowest stage of layouts with at most e split nodes (``split_node_floors``), more than n + e.
"""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import SMALL_PROBLEMS, all_layouts
from test_identical_layer_runs import memory_tight_case, transformer

import oobleck.planning.threshold_sweep as sweep_module
from oobleck.errors import PlanningError
from oobleck.planning.bottleneck_search import _bottleneck_dp, _layout_seconds, _one_stage_per_node
from oobleck.planning.node_bounds import NodeGeometry, split_node_floors
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import _DeepRecursion, _feasibility, stage_memories_of, stage_seconds_of
from oobleck.planning.threshold_sweep import _sweep_thresholds
from testing.plans import cluster


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL_PROBLEMS, identical=st.booleans())
def test_capped_bottleneck_matches_brute_force(layers, gpus, nodes, seed, memory, output_bytes, max_gpus, identical):
    profile = synthetic_profile(layers, seed=seed, jitter=0.0 if identical else 0.6, output_bytes=output_bytes)
    spec = cluster(nodes, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    table = _StageTable(profile, spec, limit)
    # Least slowest stage over every memory-feasible layout on ``nodes`` nodes, by stage count.
    least: dict[int, float] = {}
    for stages in all_layouts(layers, nodes, gpus, limit):
        if any(m > memory for m in stage_memories_of(profile, stages)):
            continue
        slowest = max(stage_seconds_of(profile, spec, stages))
        least[len(stages)] = min(least.get(len(stages), math.inf), slowest)
    with _DeepRecursion(layers):
        for cap in range(1, layers * gpus + 2):
            expected = min((w for count, w in least.items() if count <= cap), default=math.inf)
            found = _bottleneck_dp(table, gpus, nodes, only=nodes, stage_cap=cap)[nodes]
            assert found == expected, (cap, found, expected)
            # Searching only below a limit: the value under it, else the limit ("at least").
            for below in (expected, math.nextafter(expected, math.inf), 2 * expected, 0.5 * expected):
                if math.isfinite(below):
                    limited = _bottleneck_dp(table, gpus, nodes, only=nodes, stage_cap=cap, below=below)[nodes]
                    assert limited == (expected if expected < below else below), (cap, below, limited)


def _sweeps(profile, spec, r):
    """The sweep's result with the stage-count bound and without it, and how many stage-capped
    DPs the first ran."""
    try:
        table, bottleneck, n0 = _feasibility(profile, spec, spec.gpus_per_node)
    except PlanningError:
        return None
    wanted = [n for n in bottleneck if bottleneck[n] < math.inf]
    capped = []
    real = sweep_module._bottleneck_dp

    def counting(*args, **kwargs):
        if kwargs.get("stage_cap") is not None:
            capped.append(kwargs["stage_cap"])
        return real(*args, **kwargs)

    with _DeepRecursion(profile.num_layers):
        sweep_module._bottleneck_dp = counting
        try:
            fast = _sweep_thresholds(table, spec.gpus_per_node, r, wanted, bottleneck)
        finally:
            sweep_module._bottleneck_dp = real
        slow = _sweep_thresholds(table, spec.gpus_per_node, r, wanted, bottleneck, stage_caps=False)
    return fast, slow, len(capped)


def test_stage_caps_change_no_template():
    """Seeded random profiles where memory puts several stages on a node (jittered layers, and
    runs of identical layers): the same layouts and values, to the last bit, with and without
    the bound; and the bound did run."""
    rng = random.Random(3030)
    ran = 0
    for case in range(36):
        profile, spec = memory_tight_case(rng, case % 2 != 0, (8, 24), 400, [4e9, 6e9, 9e9], [3e9, 5e9, 8e9])
        result = _sweeps(profile, spec, rng.choice([2, 4]))
        if result is None:
            continue
        fast, slow, capped = result
        assert fast == slow, case
        ran += capped
    assert ran >= 10


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL_PROBLEMS, identical=st.booleans())
def test_one_stage_seeds_are_the_least_slowest_of_n_stages(
    layers, gpus, nodes, seed, memory, output_bytes, max_gpus, identical
):
    """The seed for n nodes has the least slowest stage of every memory-feasible layout of n
    stages on n nodes (brute force), and there is a seed wherever such a layout exists."""
    profile = synthetic_profile(layers, seed=seed, jitter=0.0 if identical else 0.6, output_bytes=output_bytes)
    spec = cluster(nodes, gpus, memory)
    table = _StageTable(profile, spec, gpus)
    seeds = _one_stage_per_node(table, gpus, nodes)
    for n in range(1, nodes + 1):
        least = math.inf
        for stages in all_layouts(layers, n, gpus, gpus):
            if len(stages) != n or any(m > memory for m in stage_memories_of(profile, stages)):
                continue
            least = min(least, max(stage_seconds_of(profile, spec, stages)))
        found = max(_layout_seconds(table, seeds[n], gpus)) if n in seeds else math.inf
        assert found == least, (n, found, least)


def test_split_node_floors_never_exceed_brute_force():
    """Over seeded small problems, ``split_node_floors[n, e]`` is at most the slowest stage of
    every memory-feasible layout on n nodes with at most e nodes of two or more stages (brute
    force); with e = 0 it is the least one exactly (whole nodes are costed exactly), and where
    split nodes lower the least slowest stage the floor often follows it exactly (one boundary
    tensor size: a two-stage node's floor is its time), so a looser floor fails this test."""
    rng = random.Random(3033)
    most_splits, tight = 2, 0
    for _ in range(60):
        layers, gpus, nodes = rng.randint(3, 6), rng.choice([2, 3]), rng.randint(2, 3)
        # Large activations: memory binds at one in-flight count and not the one below.
        profile = synthetic_profile(
            layers,
            seed=rng.randint(0, 10**4),
            jitter=rng.choice([0.0, 0.6]),
            activation_bytes=rng.choice([20_000_000, 300_000_000]),
        )
        memory = rng.choice([1e13, 1e9, 1.6e9, 2e9])
        spec = cluster(nodes, gpus, memory)
        table = _StageTable(profile, spec, gpus)
        floors = split_node_floors(NodeGeometry(table, spec), nodes, most_splits)
        assert floors.shape == (nodes + 1, most_splits + 1)
        for n in range(1, nodes + 1):
            least = [math.inf] * (most_splits + 1)
            for stages in all_layouts(layers, n, gpus, gpus):
                if any(m > memory for m in stage_memories_of(profile, stages)):
                    continue
                split_nodes = len({s.node for s in stages if s.gpus < gpus})
                slowest = max(stage_seconds_of(profile, spec, stages))
                for e in range(split_nodes, most_splits + 1):
                    least[e] = min(least[e], slowest)
            assert floors[n, 0] == least[0], (n, floors[n, 0], least[0])
            for e in range(1, most_splits + 1):
                assert floors[n, e] <= least[e] * (1 + 1e-12), (n, e, floors[n, e], least[e])
                tight += least[e] < least[0] and math.isclose(floors[n, e], least[e], rel_tol=1e-12)
    assert tight >= 10, tight


def _counted_sweeps(profile, spec, variants):
    """``_sweep_thresholds`` for one case under each of ``variants`` (its keyword arguments, with
    ``most_splits`` setting ``MOST_SPLITS``), and how many thresholds reached the marker bounds in
    each."""
    table, bottleneck, _ = _feasibility(profile, spec, spec.gpus_per_node)
    wanted = [n for n in bottleneck if bottleneck[n] < math.inf]
    real, most = sweep_module._promising_markers, sweep_module.MOST_SPLITS
    results, attempts = [], []

    def counting(*args, **kwargs):
        attempts[-1] += 1
        return real(*args, **kwargs)

    sweep_module._promising_markers = counting
    try:
        with _DeepRecursion(profile.num_layers):
            for variant in variants:
                options = dict(variant)
                sweep_module.MOST_SPLITS = options.pop("most_splits", most)
                attempts.append(0)
                results.append(_sweep_thresholds(table, spec.gpus_per_node, 4, wanted, bottleneck, **options))
    finally:
        sweep_module._promising_markers = real
        sweep_module.MOST_SPLITS = most
    return results, attempts


def test_split_node_floors_change_no_template():
    """Identical decoder layers between an embedding and a head (and jittered layers) on nodes
    of 8 GPUs, memory for one stage per node: the same layouts and values, to the last bit, with
    the split-node floors and without them (``MOST_SPLITS`` = 0), and with them fewer thresholds
    reach the marker bounds in some cases (never more)."""
    rng = random.Random(3032)
    fewer = 0
    for case in range(12):
        # Nodes of 8 GPUs: a split node has many shapes, and the seeds' windows reach below them.
        blocks = rng.randint(12, 30)
        profile = transformer(blocks) if case % 3 else synthetic_profile(blocks, seed=case, jitter=0.6)
        spec = cluster(rng.randint(8, 20), 8, 1e13, intra=150e9, inter=12.5e9)
        results, attempts = _counted_sweeps(profile, spec, [{}, {"most_splits": 0}])
        assert results[0] == results[1], case
        assert attempts[0] <= attempts[1], case
        fewer += attempts[0] < attempts[1]
    assert fewer >= 3, fewer


def test_thresholds_below_the_one_stage_seed_change_no_template():
    """Identical decoder layers between an embedding and a head, memory for one stage per node:
    the same layouts and values, to the last bit, with and without the stage-count bounds, and
    the bound below the seeds' slowest stage ruled out thresholds (fewer reach the marker bounds)
    where no stage-capped DP ran."""
    rng = random.Random(3031)
    fewer = 0
    for case in range(12):
        profile = transformer(rng.randint(12, 40))
        spec = cluster(rng.randint(6, 16), rng.choice([2, 4, 8]), 1e13, intra=150e9, inter=12.5e9)
        results, attempts = _counted_sweeps(profile, spec, [{"stage_caps": True}, {"stage_caps": False}])
        assert results[0] == results[1], case
        assert attempts[0] <= attempts[1], case
        fewer += attempts[0] < attempts[1]
    assert fewer >= 3, fewer
