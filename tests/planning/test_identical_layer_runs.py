"""Runs of identical layers: the template search against brute force on profiles built from runs.

Stage compute is summed by a range's signature (``ProfileArrays.span_compute``), so equal ranges
of identical layers take bit-identical times and the search meets each as one candidate
bottleneck. These tests check that the sum is the same wherever the planner takes it, that it
differs from plain prefix sums only by rounding, that it does merge the candidates, and that the
search stays exact (brute force over every layout) on random profiles made of runs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import all_layouts, brute_force_template

from oobleck.errors import PlanningError
from oobleck.planning.inputs import LayerProfile, ModelProfile
from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE, ProfileArrays
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.templates import generate_templates, stage_memories_of
from oobleck.planning.threshold_sweep import _fewest_stages
from testing.plans import cluster

# Per-layer forward seconds a run may have: decimals that binary floats do not hold exactly, so
# prefix sums over different positions of a run round differently.
FORWARDS = (0.0063629145125925, 0.01, 0.007, 0.0033, 0.0121)


def runs_profile(runs: list[tuple[int, int, int, int, int]]) -> ModelProfile:
    """Layers from ``(length, forward index, parameter MB, activation MB, output MB)`` runs:
    every layer of a run has the same compute and sizes."""
    layers = []
    for length, kind, params, activations, output in runs:
        forward = FORWARDS[kind]
        for _ in range(length):
            layers.append(
                LayerProfile(
                    f"layer{len(layers)}",
                    forward,
                    2 * forward,
                    params * 1_000_000,
                    activations * 1_000_000,
                    output * 1_000_000,
                )
            )
    return ModelProfile(model="runs", microbatch_size=1, device="synthetic", layers=tuple(layers))


def memory_tight_case(rng, gpt_shaped, blocks, block_activation_mb, memories, synthetic_memories, activations=None):
    """A seeded random (profile, cluster) where memory puts several stages on a node: a GPT shape
    (embedding, ``blocks`` (low, high) identical blocks of ``block_activation_mb``, head, device
    memory from ``memories``) or jittered synthetic layers (activation bytes from ``activations``
    when given, memory from ``synthetic_memories``)."""
    from oobleck.planning.synthetic import synthetic_profile

    gpus = rng.choice([2, 4, 8])
    if gpt_shaped:
        count = rng.randint(*blocks)
        body = (count, rng.randint(0, 4), 800, block_activation_mb, 16)
        profile = runs_profile([(1, 3, 200, 8, 16), body, (1, 4, 800, 440, 0)])
        memory = rng.choice(memories)
    else:
        sizes = {"layers": rng.randint(8, 24), "seed": rng.randint(0, 10**6), "jitter": rng.choice([0.0, 0.6])}
        sizes["param_bytes"] = rng.choice([200_000_000, 400_000_000])
        if activations is not None:
            sizes["activation_bytes"] = rng.choice(activations)
        sizes["output_bytes"] = rng.choice([4_000_000, 60_000_000])
        profile = synthetic_profile(sizes.pop("layers"), **sizes)
        memory = rng.choice(synthetic_memories)
    return profile, cluster(rng.randint(2, 8), gpus, memory, intra=150e9, inter=12.5e9)


def transformer(blocks: int) -> ModelProfile:
    """An embedding, ``blocks`` identical decoder layers and a head (the shape of a GPT)."""
    return runs_profile([(1, 3, 200, 8, 16), (blocks, 0, 800, 950, 16), (1, 4, 800, 440, 0)])


def test_equal_ranges_of_a_run_take_identical_compute():
    arrays = ProfileArrays(transformer(40))
    span = arrays.span_compute()
    L = arrays.num_layers
    for count in range(1, 41):
        inside = {float(span[s, s + count]) for s in range(1, L - count)}
        assert len(inside) == 1, count  # bit-identical wherever the range sits in the run
        with_embedding = {float(span[0, count + 1])}
        assert with_embedding == {arrays.compute_s(0, count + 1)}
    prefix = arrays.compute[None, :] - arrays.compute[:, None]
    upper = np.triu_indices(L + 1, 1)
    assert np.allclose(span[upper], prefix[upper], rtol=1e-12, atol=0)
    assert all(span[s, e] == arrays.compute_s(s, e) for s in range(L + 1) for e in range(s + 1, L + 1))
    assert arrays.compute_s(5, 5) == 0.0


def test_identical_layers_merge_candidate_bottlenecks():
    # 60 identical layers on nodes of 4 GPUs: a stage's time is set by its layer count, its GPUs
    # and its link, so there are at most that many distinct candidate bottlenecks.
    profile = runs_profile([(60, 0, 50, 20, 4)])
    table = _StageTable(profile, cluster(8, 4, 1e13), 4)
    assert len(table.candidates) <= 60 * 4 * len((LINK_NONE, LINK_INTRA, LINK_INTER))
    # Every stage of k layers on g GPUs with an in-node link costs the same, wherever it starts.
    for g in (1, 3):
        for count in (1, 7, 20):
            costs = {table.cost[g][LINK_INTRA][end][end - count] for end in range(count, 60)}
            assert len(costs) == 1


@st.composite
def run_lists(draw):
    runs, total = [], 0
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        length = draw(st.integers(min_value=1, max_value=max(1, 7 - total)))
        if total + length > 7:
            break
        runs.append(
            (
                length,
                draw(st.integers(min_value=0, max_value=len(FORWARDS) - 1)),
                draw(st.sampled_from([50, 200])),
                draw(st.sampled_from([20, 300])),
                draw(st.sampled_from([0, 4, 400])),
            )
        )
        total += length
    return runs


# Small cases of identical-layer runs that brute force can enumerate (also the GPU relaxation's).
RUN_CASES = {
    "runs": run_lists(),
    "gpus": st.integers(min_value=1, max_value=3),
    "nodes": st.integers(min_value=1, max_value=3),
    "memory": st.sampled_from([1e13, 1e9, 2.5e9]),
    "r": st.sampled_from([1, 2, 4]),
    "max_gpus": st.sampled_from([None, 2]),
}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**RUN_CASES)
def test_runs_match_brute_force(runs, gpus, nodes, memory, r, max_gpus):
    profile = runs_profile(runs)
    spec = cluster(nodes, gpus, memory)
    try:
        found = generate_templates(profile, spec, 0, reference_microbatches_per_stage=r, max_gpus_per_stage=max_gpus)
        got = {n: t.reference_iteration_s for n, t in found.templates.items()}
    except PlanningError:
        got = {}
    for n in range(1, nodes + 1):
        expected = brute_force_template(profile, spec, n, r, max_gpus)
        value = got.get(n, math.inf)
        assert value == expected or value == pytest.approx(expected, rel=1e-9), (n, value, expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=run_lists(),
    gpus=st.integers(min_value=1, max_value=3),
    memory=st.sampled_from([1e13, 1e9, 2.5e9]),
    max_gpus=st.sampled_from([None, 1, 2]),
)
def test_fewest_stages_is_what_memory_forces(runs, gpus, memory, max_gpus):
    # The sweep's window bound counts at least this many stages on any node count: no layout
    # that fits has fewer, and one-stage-per-node layouts reach it when there are enough nodes.
    profile = runs_profile(runs)
    spec = cluster(3, gpus, memory)
    limit = min(max_gpus or gpus, gpus)
    fewest = _fewest_stages(_StageTable(profile, spec, limit))
    least = math.inf
    for n in range(1, 4):
        for stages in all_layouts(profile.num_layers, n, gpus, limit):
            if all(m <= memory for m in stage_memories_of(profile, stages)):
                least = min(least, len(stages))
    if fewest == 0:
        assert least == math.inf
    else:
        assert least >= fewest
        if fewest <= 3 and limit == gpus:
            assert least == fewest
