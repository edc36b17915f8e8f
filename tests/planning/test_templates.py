"""Template generation: exact against brute force over every layout, valid layouts, n0 and errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import SMALL_PROBLEMS, brute_force_template

from oobleck.errors import PlanningError, ProfileError
from oobleck.planning.inputs import LayerProfile, ModelProfile
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateSet, generate_templates, min_nodes
from testing.plans import cluster


def _assert_valid_layout(template, num_layers, gpus):
    stages = template.stages
    assert stages[0].start == 0 and stages[-1].end == num_layers
    for left, right in zip(stages, stages[1:]):
        assert left.end == right.start and left.end > left.start
        assert right.node in (left.node, left.node + 1)
    used = {}
    for stage in stages:
        assert stage.gpu_offset == used.get(stage.node, 0)  # GPUs of a node are dealt out in order
        used[stage.node] = stage.gpu_offset + stage.gpus
    assert sorted(used) == list(range(template.num_nodes))
    assert all(total == gpus for total in used.values())  # no idle GPU, no stage spanning nodes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL_PROBLEMS, r=st.sampled_from([1, 2, 4]))
def test_templates_match_brute_force(layers, gpus, nodes, seed, memory, r, output_bytes, max_gpus):
    profile = synthetic_profile(layers, seed=seed, jitter=0.6, output_bytes=output_bytes)
    spec = cluster(nodes, gpus, memory)
    try:
        found = generate_templates(profile, spec, 0, reference_microbatches_per_stage=r, max_gpus_per_stage=max_gpus)
        got = {n: t.reference_iteration_s for n, t in found.templates.items()}
    except PlanningError:
        found, got = None, {}
    for n in range(1, nodes + 1):
        expected = brute_force_template(profile, spec, n, r, max_gpus)
        value = got.get(n, math.inf)
        assert value == expected or value == pytest.approx(expected, rel=1e-9), (n, value, expected)
        if found is not None and n in found.templates:
            template = found.templates[n]
            _assert_valid_layout(template, layers, gpus)
            assert all(m <= memory for m in template.stage_memory_bytes)
            assert all(s.gpus <= (max_gpus or gpus) for s in template.stages)


def test_equal_layers_split_evenly():
    profile = synthetic_profile(12, seed=0, jitter=0.0, output_bytes=0)
    # Uniform middle layers; the lighter embedding and head sit at the ends.
    found = generate_templates(profile, cluster(3), 0)
    assert [s.end - s.start for s in found[3].stages] in ([4, 4, 4], [5, 3, 4], [4, 3, 5], [5, 4, 3], [3, 4, 5])
    assert found.sizes == (1, 2, 3)


def test_n0_is_fewest_nodes_that_fit():
    profile = synthetic_profile(6, seed=0, jitter=0.0, param_bytes=100_000_000, activation_bytes=0)
    # 16 bytes/param: a block needs 0.4 GB; 1.3 GB holds three blocks, so six need two nodes.
    spec = cluster(6, memory=1.3e9)
    assert min_nodes(profile, spec) == 2
    found = generate_templates(profile, spec, 1)
    assert found.min_nodes == 2 and found.max_nodes == 4 and found.sizes == (2, 3, 4)


def test_f_too_large_names_the_numbers():
    profile = synthetic_profile(6, seed=0, jitter=0.0, param_bytes=100_000_000, activation_bytes=0)
    with pytest.raises(PlanningError) as error:
        generate_templates(profile, cluster(6, memory=1.3e9), 3)
    assert str(error.value) == "f=3 needs 4 pipelines of at least n0=2 nodes = 8 nodes; cluster.nodes=6"


def test_model_that_never_fits():
    profile = synthetic_profile(3, seed=0, param_bytes=400_000_000)
    with pytest.raises(PlanningError, match="cluster.device_memory_gb"):
        generate_templates(profile, cluster(4, memory=1e9), 0)


def test_template_set_round_trips(profile8):
    found = generate_templates(profile8, cluster(4, gpus=2), 1)
    again = TemplateSet.from_dict(found.to_dict())
    assert again == found


def test_bad_profiles_are_rejected():
    good = dict(name="l", forward_s=0.1, backward_s=0.2, param_bytes=4, activation_bytes=0, output_bytes=0)
    with pytest.raises(ProfileError, match="no layers"):
        ModelProfile(model="m", microbatch_size=1, device="cpu", layers=())
    with pytest.raises(ProfileError, match="forward_s=-0.1"):
        ModelProfile(model="m", microbatch_size=1, device="cpu", layers=(LayerProfile(**{**good, "forward_s": -0.1}),))
    with pytest.raises(ProfileError, match="backward_s=0"):
        ModelProfile(model="m", microbatch_size=1, device="cpu", layers=(LayerProfile(**{**good, "backward_s": 0}),))


# Best reference times of medium cases, computed by slower searches that were themselves checked
# against brute force: the first two by the search before the inner-loop hoisting in
# _solve_for_threshold, the other three by the search before the node-level bound
# (_marker_bounds) and the per-threshold memory compression. Too large for brute force, they pin
# the faster search to the slower one. The second case is memory-bound with 8 devices per node
# (sub-node stages at 1 node, a 1-GPU stage at 2 nodes); the third has boundary tensors so large
# that crossing a node costs more than a stage computes (a negative single-stage capacity in the
# bound); the fourth is memory-bound with many nodes; the fifth has 2 to 3 layers per node.
MEDIUM_CASES = [
    (
        {"layers": 30, "nodes": 10, "gpus": 4, "memory": 40e9, "seed": 5},
        {
            1: 0.898906894910394,
            2: 1.0268140023479966,
            3: 1.0928826815324808,
            4: 1.1129395818646117,
            5: 1.1485363572871607,
            6: 1.1587219641653348,
            7: 1.198102281908679,
            8: 1.217210302462386,
            9: 1.2655718969796665,
        },
    ),
    (
        {"layers": 40, "nodes": 8, "gpus": 8, "memory": 4e9, "seed": 11},
        {
            1: 1.962366626024544,
            2: 0.947309125184477,
            3: 0.6632289928426784,
            4: 0.6878027515777024,
            5: 0.703600864738341,
            6: 0.7274908453534203,
            7: 0.7196327290390616,
        },
    ),
    (
        {
            "layers": 12,
            "nodes": 6,
            "gpus": 8,
            "memory": 2e9,
            "seed": 1,
            "output_bytes": 300_000_000,
            "jitter": 0.6,
            "r": 2,
        },
        {
            1: 0.22086656406437216,
            2: 0.23700027193243486,
            3: 0.38384081095374484,
            4: 0.5255304923320977,
            5: 0.6791391646715813,
        },
    ),
    (
        {"layers": 24, "nodes": 12, "gpus": 8, "memory": 6e9, "seed": 2, "jitter": 0.6},
        {
            1: 0.33555948645782263,
            2: 0.3928788058472711,
            3: 0.4014524819237765,
            4: 0.4303586641273701,
            5: 0.4590294431497173,
            6: 0.46014082812614837,
            7: 0.46331748114100246,
            8: 0.49246358531533146,
            9: 0.4723446332997788,
            10: 0.5010667949596174,
            11: 0.5308599407344821,
        },
    ),
    (
        {"layers": 40, "nodes": 18, "gpus": 8, "memory": 40e9, "seed": 3, "output_bytes": 60_000_000},
        {
            1: 0.5863112601270176,
            2: 0.7114758128168487,
            3: 0.7856575904018508,
            4: 0.8586795692015166,
            5: 0.9151519945473425,
            6: 0.9800480790233536,
            7: 1.0216528191039678,
            8: 1.0861224888958279,
            9: 1.1333569336734988,
            10: 1.1991041920046541,
            11: 1.2525656368242508,
            12: 1.3176492514593356,
            13: 1.3713935269941904,
            14: 1.4026925243658825,
            15: 1.4840584118400528,
            16: 1.5192727357460831,
            17: 1.5940086604454813,
        },
    ),
]


@pytest.mark.parametrize("case,expected", MEDIUM_CASES)
def test_medium_cases_match_reference_search(case, expected):
    shape = {key: case[key] for key in ("output_bytes", "jitter") if key in case}
    profile = synthetic_profile(case["layers"], seed=case["seed"], **shape)
    spec = cluster(case["nodes"], case["gpus"], case["memory"], intra=150e9, inter=12.5e9)
    found = generate_templates(profile, spec, 1, reference_microbatches_per_stage=case.get("r", 4))
    assert {n: t.reference_iteration_s for n, t in found.templates.items()} == pytest.approx(expected, rel=1e-12)
    for template in found.templates.values():
        _assert_valid_layout(template, case["layers"], case["gpus"])
