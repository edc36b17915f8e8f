"""Reconfiguration: the original authors' failure cases, joins, transfers, errors, the f check."""

from __future__ import annotations

import pytest
from conftest import cluster

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import build_plan, instantiate
from oobleck.planning.plan import ReconfigurationPlan, StageSpec
from oobleck.planning.reconfigure import check_fault_tolerance, reconfigure
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateSet, generate_templates, make_template

# Five layers; n0 = 2. Hand-made layouts so that the heavy-loss cases keep a replica of every layer.
LAYOUTS = {
    2: [(0, 3), (3, 5)],
    3: [(0, 2), (2, 4), (4, 5)],
    4: [(0, 2), (2, 3), (3, 4), (4, 5)],
    5: [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
}
AUTHORS_PIPELINES = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def authors():
    profile = synthetic_profile(5, seed=2)
    spec = cluster(14)
    templates = {
        n: make_template(profile, spec, [StageSpec(a, b, node, 0, 1) for node, (a, b) in enumerate(layout)], 4)
        for n, layout in LAYOUTS.items()
    }
    template_set = TemplateSet(
        min_nodes=2,
        max_nodes=5,
        templates=templates,
        num_layers=5,
        gpus_per_node=1,
        layer_param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        intra_node_bandwidth=spec.intra_node_bandwidth,
        inter_node_bandwidth=spec.inter_node_bandwidth,
    )
    plan = build_plan(template_set, [2, 3, 4, 5], AUTHORS_PIPELINES, 64, 2, 3)
    return template_set, plan


def _assert_valid(result: ReconfigurationPlan, templates: TemplateSet):
    old, new = result.old, result.new
    expected_nodes = sorted((set(old.nodes) - set(result.removed)) | set(result.joined))
    assert list(new.nodes) == expected_nodes  # every survivor used once, no idle node
    assert all(len(p.nodes) in templates.sizes and len(p.nodes) >= templates.min_nodes for p in new.pipelines)
    assert sum(p.microbatches for p in new.pipelines) == old.num_microbatches
    assert [p.first_microbatch for p in new.pipelines] == [
        sum(q.microbatches for q in new.pipelines[:i]) for i in range(len(new.pipelines))
    ]
    old_held = {}
    for a in old.assignments():
        old_held.setdefault(a.worker, set()).update(a.layers)
    received = {}
    for t in result.transfers:
        assert t.source[0] not in result.removed and t.layer in old_held[t.source]  # a live, real holder
        assert t.source != t.target
        received.setdefault((t.target, t.layer), []).append(t)
    for a in new.assignments():
        for layer in a.layers:
            if layer in old_held.get(a.worker, set()):
                assert (a.worker, layer) not in received  # kept in place, nothing moves
                continue
            chunks = received[(a.worker, layer)]
            assert sorted(c.chunk for c in chunks) == list(range(chunks[0].chunks))
            assert len({c.source for c in chunks}) == len(chunks)  # distinct sources
            assert sum(c.nbytes for c in chunks) == templates.layer_param_bytes[layer]


@pytest.mark.parametrize(
    "lost", [[2], [1, 3, 4], [2, 4, 6, 7, 8], [1, 2, 3, 5, 6, 7, 9, 10, 11]], ids=["one", "three", "five", "nine"]
)
def test_authors_failure_cases(authors, lost):
    templates, plan = authors
    result = reconfigure(plan, templates, removed=lost)
    _assert_valid(result, templates)
    assert reconfigure(plan, templates, removed=lost) == result  # deterministic


def test_losing_one_node_keeps_other_pipelines_in_place(authors):
    templates, plan = authors
    result = reconfigure(plan, templates, removed=[2])
    assert [list(p.nodes) for p in result.new.pipelines] == [[0, 1], [3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
    moved_to = {t.target[0] for t in result.transfers}
    assert moved_to <= {3, 4}


@pytest.mark.parametrize("joined", [[20], [20, 21], [20, 21, 22]])
def test_joins_grow_or_add_pipelines(authors, joined):
    templates, plan = authors
    result = reconfigure(plan, templates, joined=joined)
    _assert_valid(result, templates)
    if len(joined) >= templates.min_nodes:
        assert len(result.new.pipelines) == len(plan.pipelines) + 1


def test_failure_and_join_together(authors):
    templates, plan = authors
    _assert_valid(reconfigure(plan, templates, removed=[0, 1], joined=[30]), templates)


def test_lost_layer_is_named(authors):
    templates, plan = authors
    # Layer 0 lives on node 0, 2, 5 and 9 (the first node of each pipeline) and nowhere else.
    with pytest.raises(PlanningError, match=r"layers \[0\] have no live replica"):
        reconfigure(plan, templates, removed=[0, 2, 5, 9])


def test_bad_membership_changes(authors):
    templates, plan = authors
    with pytest.raises(PlanningError, match="not in the current plan"):
        reconfigure(plan, templates, removed=[99])
    with pytest.raises(PlanningError, match="already in the current plan"):
        reconfigure(plan, templates, joined=[3])


def test_transfers_spread_over_sources():
    profile = synthetic_profile(8, seed=1)
    templates = generate_templates(profile, cluster(8), 3)
    plan = instantiate(templates, range(8), 64, 1, 3)
    result = reconfigure(plan, templates, removed=[plan.pipelines[0].nodes[0]], max_sources=2)
    _assert_valid(result, templates)
    assert result.transfers and all(t.chunks <= 2 for t in result.transfers)
    assert len({t.source for t in result.transfers}) >= 2


def test_fault_tolerance_check():
    profile = synthetic_profile(6, seed=0, jitter=0.0, param_bytes=100_000_000, activation_bytes=0)
    templates = generate_templates(profile, cluster(9, memory=1.3e9), 2)
    check_fault_tolerance(templates, 9, 2)  # n0 = 2: 7, 8, 9 survivors all split into 2..5
    with pytest.raises(PlanningError, match="f=4 needs 5 pipelines of at least n0=2 nodes = 10 nodes; cluster.nodes=9"):
        check_fault_tolerance(templates, 9, 4)
    gappy = TemplateSet(min_nodes=3, max_nodes=3, templates={3: templates[3]}, num_layers=6)
    with pytest.raises(PlanningError, match=r"survivor counts \[7, 8\]"):
        check_fault_tolerance(gappy, 9, 2)


@pytest.mark.parametrize("lost", [[0], [1, 5], [0, 3, 6]])
def test_multi_gpu_nodes_and_round_trip(lost):
    profile = synthetic_profile(10, seed=4)
    templates = generate_templates(profile, cluster(8, gpus=2, memory=2e9), 2)
    plan = instantiate(templates, range(8), 64, 2, 2)
    result = reconfigure(plan, templates, removed=lost)
    _assert_valid(result, templates)
    assert ReconfigurationPlan.from_dict(result.to_dict()) == result
