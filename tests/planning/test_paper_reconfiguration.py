"""The paper's reconfiguration (oobleck.planning.sosp23): the released code's own examples, the plan
it builds and its single-source copies.

The examples are the four failure cases of the Oobleck artifact's
``tests/sosp23/test_dynamic_reconfiguration.py`` (SymbioticLab/Oobleck, sosp23-artifact): pipelines
of 2, 3, 4 and 5 nodes (n0 = 2) losing 1, 3, 5 and 9 nodes, with the node groups that test expects.
"""

from __future__ import annotations

import dataclasses

import pytest

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import build_plan
from oobleck.planning.outputs import StageSpec
from oobleck.planning.sosp23 import reconfigure_sosp23, regroup
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateSet, make_template
from testing.plans import cluster

PAPER_PIPELINES = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
PAPER_CASES = {
    "shrink": ([2], [[0, 1], [3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]),
    "borrow": ([1, 3, 4], [[0, 13], [2, 12], [9, 10, 11], [5, 6, 7, 8]]),
    "borrow twice": ([2, 4, 6, 7, 8], [[0, 1], [3, 13], [5, 12], [9, 10, 11]]),
    "merge": ([1, 2, 3, 5, 6, 7, 9, 10, 11], [[0, 4], [8, 12, 13]]),
}
# Five layers, n0 = 2; every template puts layer 0 on its first node and layer 4 on its last, so
# even the nine-node loss keeps a replica of every layer.
LAYOUTS = {
    2: [(0, 3), (3, 5)],
    3: [(0, 2), (2, 4), (4, 5)],
    4: [(0, 2), (2, 3), (3, 4), (4, 5)],
    5: [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
}


@pytest.fixture(scope="module")
def paper():
    profile = synthetic_profile(5, seed=2)
    spec = cluster(14)
    templates = TemplateSet(
        min_nodes=2,
        max_nodes=5,
        templates={
            n: make_template(profile, spec, [StageSpec(a, b, node, 0, 1) for node, (a, b) in enumerate(layout)], 4)
            for n, layout in LAYOUTS.items()
        },
        num_layers=5,
        gpus_per_node=1,
        layer_param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        intra_node_bandwidth=spec.intra_node_bandwidth,
        inter_node_bandwidth=spec.inter_node_bandwidth,
    )
    return templates, build_plan(templates, [2, 3, 4, 5], PAPER_PIPELINES, 64, 2, 3)


@pytest.mark.parametrize("case", PAPER_CASES, ids=list(PAPER_CASES))
def test_the_released_codes_examples_regroup_as_it_expects(case):
    lost, expected = PAPER_CASES[case]
    result = regroup(PAPER_PIPELINES, lost, 2)
    assert [list(g) for g in result.groups] == expected
    if case == "shrink":
        assert result.shrunk == (1,) and not result.borrowed and not result.merged
    if case == "borrow":
        # Pipelines 0 and 1 each take the last node of the biggest pipeline (3), which keeps 3.
        assert result.borrowed == ((13, 3, 0), (12, 3, 1)) and not result.merged
    if case == "merge":
        # Nobody can lend (the biggest left has n0 nodes): 0 and 1 merge, then 2 with the first full one.
        assert result.merged == ((0, 1), (2, 3)) and not result.borrowed
    assert "paper's reconfiguration" in result.describe()


def test_regrouping_leaves_the_input_alone_and_refuses_what_cannot_form_a_pipeline():
    pipelines = [[0, 1], [2, 3]]
    regroup(pipelines, [1], 2)
    assert pipelines == [[0, 1], [2, 3]]
    assert [list(g) for g in regroup(pipelines, [1, 3], 2).groups] == [[0, 2]]  # two short ones merge
    with pytest.raises(PlanningError, match="cannot form a pipeline of n0=3 nodes"):
        regroup([[0, 1, 2], [3, 4, 5]], [1, 2, 4, 5], 3)


@pytest.mark.parametrize("case", PAPER_CASES, ids=list(PAPER_CASES))
def test_the_new_plan_and_its_copies_each_from_one_holder(paper, case):
    templates, plan = paper
    lost, expected = PAPER_CASES[case]
    result = reconfigure_sosp23(plan, templates, lost, templates.layer_param_bytes, 3)
    new = result.new
    assert [list(p.nodes) for p in new.pipelines] == expected
    assert [p.template for p in new.pipelines] == [templates[len(g)] for g in expected]
    assert sum(p.microbatches for p in new.pipelines) == plan.num_microbatches
    assert new.fault_tolerance == min(3, len(expected) - 1)
    held = {}
    for a in plan.assignments():
        if a.worker[0] not in lost:
            held.setdefault(a.worker, set()).update(a.layers)
    sources = {}
    for t in result.transfers:
        assert t.chunks == 1 and t.chunk == 0 and t.nbytes == templates.layer_param_bytes[t.layer]  # whole layer
        assert t.source[0] not in lost and t.layer in held[t.source]  # a live holder
        sources.setdefault(t.layer, set()).add(t.source)
    assert all(len(s) == 1 for s in sources.values()), sources  # one holder sends each layer
    needed = {(a.worker, layer) for a in new.assignments() for layer in a.layers if layer not in held.get(a.worker, ())}
    assert {(t.target, t.layer) for t in result.transfers} == needed  # exactly what each node lacks
    assert result.bytes_moved == result.min_bytes_moved and not result.replanned
    if case == "shrink":
        # The source is the first old pipeline that keeps the layer where it was: pipeline 0.
        assert {t.source[0] for t in result.transfers} <= {0, 1}
    assert reconfigure_sosp23(plan, templates, lost, templates.layer_param_bytes, 3) == result  # deterministic


def test_a_layer_without_a_live_replica_or_a_size_without_a_template_is_refused(paper):
    templates, plan = paper
    firsts = [p.nodes[0] for p in plan.pipelines]  # every holder of layer 0
    with pytest.raises(PlanningError, match=r"layers \[0\] have no live replica"):
        reconfigure_sosp23(plan, templates, firsts, templates.layer_param_bytes, 3)
    small = dataclasses.replace(templates, templates={n: templates[n] for n in (2, 4, 5)})
    two_three = build_plan(small, [4, 5], [[0, 1, 2, 3], [4, 5, 6, 7, 8]], 64, 2, 1)
    with pytest.raises(PlanningError, match=r"pipelines of \[3\] nodes, which have no template"):
        reconfigure_sosp23(two_three, small, [3], small.layer_param_bytes, 1)
    with pytest.raises(PlanningError, match=r"removed nodes \[99\] are not in the running plan"):
        reconfigure_sosp23(plan, templates, [99], templates.layer_param_bytes, 3)
