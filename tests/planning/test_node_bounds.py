"""Node-level bounds of the template search never exceed what they bound (brute force).

Every layout of small random profiles is enumerated; for its bottleneck W (the marker: its
rightmost slowest stage), ``root_bounds`` must not exceed its T, ``bottleneck_floor`` must not
exceed its slowest stage, and ``PrefixBounds`` must not exceed the cost (Eq. 1-4 summed per stage:
``w + rW`` left of the marker, ``rW`` for it, ``2w + (r-1)W`` right of it) of the nodes that cover
any prefix of it ending at a node boundary. The template tests then show the search stays exact.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import SMALL_PROBLEMS, all_layouts

from oobleck.planning.node_bounds import (
    LEVELS_CACHED,
    NodeCosts,
    NodeGeometry,
    PrefixBounds,
    bottleneck_floor,
    root_bounds,
)
from oobleck.planning.pipeline_cost import bottleneck_index, pipeline_iteration_time
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import stage_memories_of, stage_seconds_of
from testing.plans import cluster


def _stage_costs(seconds: list[float], r: int) -> list[float]:
    k = bottleneck_index(seconds)
    W = seconds[k]
    return [w + r * W if i < k else r * W if i == k else 2 * w + (r - 1) * W for i, w in enumerate(seconds)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL_PROBLEMS, r=st.sampled_from([1, 2, 4]))
def test_node_bounds_never_exceed_brute_force(layers, gpus, nodes, seed, memory, r, output_bytes, max_gpus):
    profile = synthetic_profile(layers, seed=seed, jitter=0.6, output_bytes=output_bytes)
    spec = cluster(nodes, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    table = _StageTable(profile, spec, limit)
    geometry = NodeGeometry(table, spec)
    floors = bottleneck_floor(geometry, nodes)
    costs_at: dict[float, NodeCosts] = {}
    for n in range(1, nodes + 1):
        for stages in all_layouts(layers, n, gpus, limit):
            if any(m > memory for m in stage_memories_of(profile, stages)):
                continue
            seconds = [float(w) for w in stage_seconds_of(profile, spec, stages)]
            W = max(seconds)
            assert floors[n] <= W * (1 + 1e-12)
            if W not in costs_at:
                lo = int(np.searchsorted(table.marker_costs, W, side="left"))
                hi = int(np.searchsorted(table.marker_costs, W, side="right"))
                marker = (table.marker_starts[lo:hi], table.marker_ends[lo:hi], table.marker_gpus[lo:hi])
                costs_at[W] = NodeCosts(geometry, W, r, *marker)
            costs = costs_at[W]
            T = pipeline_iteration_time(seconds, r * len(seconds))
            assert root_bounds(costs, n)[n] <= T * (1 + 1e-12)
            # Every prefix of whole nodes, before the last node.
            prefix = PrefixBounds(costs, n)
            # The stages before the last node's keep at least one more microbatch in flight each
            # than the stages after them: the tables for in-flight >= (stages after the prefix) + 1.
            per_stage = _stage_costs(seconds, r)
            k = bottleneck_index(seconds)
            spent, last_node = 0.0, {s.node: i for i, s in enumerate(stages)}
            for i, stage in enumerate(stages[:-1]):
                spent += per_stage[i]
                if last_node[stage.node] == i:  # the node ends here
                    left, marked = prefix.at(len(stages) - i)
                    table_ = marked if i >= k else left
                    assert table_[stage.node + 1][stage.end] <= spent * (1 + 1e-12) or math.isclose(
                        table_[stage.node + 1][stage.end], spent, rel_tol=1e-12
                    )
                else:  # inside a node: its stages so far use these GPUs, the whole nodes before it
                    used = stage.gpu_offset + stage.gpus
                    left, marked = prefix.partial(len(stages) - i, used)
                    table_ = marked if i >= k else left
                    assert table_[stage.node][stage.end] <= spent * (1 + 1e-12) or math.isclose(
                        table_[stage.node][stage.end], spent, rel_tol=1e-12
                    )


def test_chains_match_the_all_entries_chains():
    """``root_bounds`` and ``PrefixBounds`` compute only the entries a step can reach (and still
    needs): over seeded random profiles (jittered, and runs of identical layers), memory limits,
    r and node counts, at sampled candidate bottlenecks, both equal the chains computed over
    every entry, and the partial-node tables a plain minimum over every window, to the last bit."""
    import random

    from planning_brute import (
        all_columns_prefix_tables,
        all_rows_root_bounds,
        entrywise_bands,
        entrywise_stage_counts,
        windowed_partial,
    )

    rng = random.Random(30)
    finite = 0
    paths = {True: 0, False: 0}
    for _ in range(40):
        layers, gpus = rng.randint(2, 24), rng.choice([1, 2, 4, 8])
        profile = synthetic_profile(
            layers,
            seed=rng.randint(0, 10**6),
            jitter=rng.choice([0.0, 0.0, 0.6]),  # 0: every block identical (a GPT)
            param_bytes=rng.choice([50_000_000, 400_000_000, 2_000_000_000]),
            # Large activations: memory binds at many in-flight counts (many split-node levels).
            activation_bytes=rng.choice([20_000_000, 20_000_000, 1_000_000_000]),
        )
        spec = cluster(rng.randint(1, 24), gpus, rng.choice([1e13, 8e9, 40e9]))
        table = _StageTable(profile, spec, rng.choice([gpus, max(1, gpus // 2)]))
        geometry = NodeGeometry(table, spec)
        r = rng.choice([1, 2, 4])
        for W in rng.sample(list(table.candidates), min(12, len(table.candidates))):
            lo = int(np.searchsorted(table.marker_costs, W, side="left"))
            hi = int(np.searchsorted(table.marker_costs, W, side="right"))
            marker = (table.marker_starts[lo:hi], table.marker_ends[lo:hi], table.marker_gpus[lo:hi])
            max_nodes = rng.randint(1, spec.nodes)
            fast = root_bounds(NodeCosts(geometry, float(W), r, *marker), max_nodes)
            expected = all_rows_root_bounds(NodeCosts(geometry, float(W), r, *marker), max_nodes)
            assert np.array_equal(fast, expected)
            costs = NodeCosts(geometry, float(W), r, *marker)
            in_flight = rng.randint(1, layers + 1)
            tables = PrefixBounds(costs, max_nodes)._arrays(in_flight)
            for table_, reference in zip(tables, all_columns_prefix_tables(costs, max_nodes, in_flight)):
                assert np.array_equal(table_, reference)
            free = rng.randint(1, gpus)
            assert tuple(
                rows.tolist() for rows in PrefixBounds(costs, max_nodes).partial(in_flight, free)
            ) == windowed_partial(PrefixBounds(costs, max_nodes), in_flight, free)
            finite += int(np.isfinite(fast[2:]).sum())
            # The bands of entries at their own in-flight counts, taken from the whole band at each
            # distinct most compute per stage: the entrywise computation's bits.
            vector = np.array([rng.randint(1, layers + 2) for _ in range(layers + 2)])
            first = rng.randint(0, layers)
            rows = slice(first, rng.randint(first, layers) + 1)
            for _ in range(2):  # (the second time from the levels cached by the first)
                steps = costs.chain_steps(vector, rows)
                for band, reference in zip(steps, entrywise_bands(costs, vector, rows)):
                    assert np.array_equal(band, reference)
                assert np.array_equal(steps[3], entrywise_stage_counts(costs, vector, rows))
            band_in_flight = vector[np.minimum(costs.after[rows], len(vector) - 1)]
            if len(np.unique(costs._most_of(band_in_flight))) > 1:
                paths[len(costs._level_most) <= LEVELS_CACHED] += 1  # (levels cached, or entrywise)
    assert finite > 100
    assert min(paths.values()) > 10, paths


def test_whole_node_prefix_tables_at_powers_of_two():
    """``PrefixBounds.at`` serves every in-flight count from the tables at the power of two at or
    below it (a search then builds a handful of tables where memory binds at many counts): over
    seeded memory-tight profiles, the lists equal those tables to the last bit and no entry
    exceeds the tables at the count itself (fewer in flight only loosens memory), and the two
    differ somewhere, so the rounding is what is tested."""
    import random

    rng = random.Random(7)
    looser = 0
    for _ in range(30):
        layers, gpus = rng.randint(4, 24), rng.choice([1, 2, 4, 8])
        profile = synthetic_profile(
            layers,
            seed=rng.randint(0, 10**6),
            jitter=rng.choice([0.0, 0.6]),
            param_bytes=rng.choice([400_000_000, 2_000_000_000]),
            activation_bytes=1_000_000_000,  # memory binds at many in-flight counts
        )
        spec = cluster(rng.randint(2, 16), gpus, rng.choice([8e9, 40e9]))
        table = _StageTable(profile, spec, gpus)
        geometry = NodeGeometry(table, spec)
        r = rng.choice([1, 4])
        for W in rng.sample(list(table.candidates), min(6, len(table.candidates))):
            lo = int(np.searchsorted(table.marker_costs, W, side="left"))
            hi = int(np.searchsorted(table.marker_costs, W, side="right"))
            marker = (table.marker_starts[lo:hi], table.marker_ends[lo:hi], table.marker_gpus[lo:hi])
            prefix = PrefixBounds(NodeCosts(geometry, float(W), r, *marker), rng.randint(1, spec.nodes))
            for in_flight in range(1, layers + 2):
                power = 1 << (in_flight.bit_length() - 1)
                served = tuple(rows.tolist() for rows in prefix.at(in_flight))
                assert served == tuple(table_.tolist() for table_ in prefix._arrays(power))
                for lists, exact in zip(served, prefix._arrays(in_flight)):
                    assert np.all(np.array(lists) <= exact)
                    looser += int(not np.array_equal(np.array(lists), exact))
    assert looser > 10


def test_prefix_rows_are_made_as_a_search_reads_them():
    """``PrefixBounds`` hands the template search its tables as rows made on first read: every
    row made equals the table's, a row is made once, and the searches of a template generation
    read fewer rows than their tables have (the conversions this saves)."""
    import oobleck.planning.threshold_sweep as sweep_module
    from oobleck.planning.node_bounds import LazyRows
    from oobleck.planning.templates import generate_templates

    handed: list[LazyRows] = []

    class Recording(PrefixBounds):
        def at(self, in_flight):
            found = super().at(in_flight)
            handed.extend(found)
            return found

        def partial(self, in_flight, free_gpus):
            found = super().partial(in_flight, free_gpus)
            handed.extend(found)
            return found

    real = sweep_module.PrefixBounds
    sweep_module.PrefixBounds = Recording
    try:
        generate_templates(synthetic_profile(40, seed=5), cluster(12, 4, 1e13), 1)
    finally:
        sweep_module.PrefixBounds = real
    tables = {id(rows): rows for rows in handed}.values()
    made = [(rows, index) for rows in tables for index in list(rows)]
    assert made
    for rows, index in made:
        assert rows[index] is dict.__getitem__(rows, index)  # made once, then served
        assert rows[index] == rows.table[index].tolist()
    assert len(made) < sum(len(rows.table) for rows in tables)


def test_split_floors_are_the_split_floor_tables():
    """``NodeGeometry.split_floors`` (made once, the last node's column computed alone) equals
    ``split_floor`` with the cross-node links and, at the pipeline's end, with none, to the last
    bit, over seeded profiles (equal and jittered layers, boundary tensors of every size)."""
    import random

    rng = random.Random(31)
    for _ in range(60):
        layers, gpus = rng.randint(1, 16), rng.choice([1, 2, 3, 4, 8])
        profile = synthetic_profile(
            layers,
            seed=rng.randint(0, 10**6),
            jitter=rng.choice([0.0, 0.6]),
            output_bytes=rng.choice([0, 4_000_000, 400_000_000]),
        )
        spec = cluster(rng.randint(1, 8), gpus, 1e13)
        geometry = NodeGeometry(_StageTable(profile, spec, gpus), spec)
        inter, last = geometry.split_floors()
        assert np.array_equal(inter, geometry.split_floor(geometry.cross))
        assert np.array_equal(last, geometry.split_floor(np.zeros(layers + 1))[:, layers])
        assert geometry.split_floors()[0] is inter  # made once
