"""The planner's memoised results (``TemplateSet.memo``) are exactly what a fresh computation gives.

A simulation asks the planner the same questions at every membership change, so the best
template sizes, the synchronisation figures and the batch splits are memoised on the template
set. These tests replay a real trace's membership changes through the planner twice, once on a
template set that keeps its memo and once clearing it before every call, and compare every
result to the last bit; and they compare the memoised search with the uncached one for every
node count the trace visits, asked in an order that would expose a key missing an argument.
"""

from __future__ import annotations

import dataclasses

import pytest

from oobleck.errors import PlanningError
from oobleck.faults.trace import load_trace
from oobleck.planning.instantiate import _best_multiset, _search_multiset, instantiate, sync_of
from oobleck.planning.reconfigure import reconfigure
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import generate_templates
from testing.plans import cluster

TRACE = "spot/ec2_p3_scaled"  # the 11 h EC2 trace the simulator benchmark replays
BATCH, MICROBATCH, F = 64, 1, 1


@pytest.fixture(scope="module")
def trace_templates():
    trace = load_trace(TRACE)
    # Memory for about a third of the model per device, so n0 > 1 and pipelines differ in depth.
    templates = generate_templates(synthetic_profile(24, seed=5), cluster(trace.max_nodes(), memory=1.2e10), F)
    return trace, templates


def _replay(trace, templates, clear: bool) -> list:
    """Every plan the planner picks over the trace (reconfigure, or a fresh instantiate where in
    place is impossible), as the Oobleck policy drives it; ``clear`` empties the memo before each call."""
    ids = {name: i for i, name in enumerate(trace.nodes)}
    changes = trace.changes()
    if clear:
        templates.memo.clear()
    plan = instantiate(templates, [ids[n] for n in changes[0].added], BATCH, MICROBATCH, F)
    standby: tuple[int, ...] = ()
    alive = set(plan.nodes)
    results: list = [plan]
    for change in changes[1:]:
        held = alive
        removed = sorted(ids[n] for n in change.removed if ids[n] in held)
        joined = sorted(ids[n] for n in change.added)
        alive = (alive - set(removed)) | set(joined)
        if clear:
            templates.memo.clear()
        try:
            result = reconfigure(plan, templates, removed, joined, standby=standby, fault_tolerance=F)
            plan, standby = result.new, result.standby
            results.append(result)
        except PlanningError as error:  # beyond in-place: a fresh plan on the survivors
            if clear:
                templates.memo.clear()
            plan = instantiate(
                templates, sorted(alive), BATCH, MICROBATCH, min(F, len(alive) // templates.min_nodes - 1)
            )
            standby = tuple(sorted(alive - set(plan.nodes)))
            results.append((str(error), plan))
    return results


def test_memoised_replay_equals_uncached_replay(trace_templates):
    trace, templates = trace_templates
    cached = _replay(trace, dataclasses.replace(templates), clear=False)
    uncached = _replay(trace, dataclasses.replace(templates), clear=True)
    assert len(cached) == len(trace.changes())
    assert cached == uncached  # plans, transfers, reasons: float for float


def test_memoised_search_equals_uncached_search_per_node_count(trace_templates):
    trace, templates = trace_templates
    templates = dataclasses.replace(templates)  # a fresh, empty memo
    assert not templates.memo
    sync = sync_of(templates)
    M = BATCH // MICROBATCH
    counts = sorted({len(nodes) for _, nodes in trace.membership()})
    fixed_choices = [(), (templates.sizes[0],), (templates.sizes[-1], templates.sizes[0])]
    # Ask with a fixed part and a larger pipeline minimum first: a key that left either out would
    # then return the wrong answer for the plainer question that follows.
    questions = [(n, p, fixed) for n in counts for fixed in reversed(fixed_choices) for p in (3, 2, 1)]
    for nodes, pipelines, fixed in questions:
        first = _best_multiset(templates, nodes, M, pipelines, sync, fixed)
        again = _best_multiset(templates, nodes, M, pipelines, sync, fixed)
        assert first == again == _search_multiset(templates, nodes, M, pipelines, sync, fixed), (
            nodes,
            pipelines,
            fixed,
        )
        if first is not None:
            first[1].append(-1)  # a caller changing its copy leaves the memo alone
            assert _best_multiset(templates, nodes, M, pipelines, sync, fixed)[1] == again[1]
    # Another cluster's bandwidths are another question.
    other = sync_of(templates, templates.intra_node_bandwidth, templates.inter_node_bandwidth / 10)
    assert other is not sync and other is sync_of(templates, inter_bandwidth=templates.inter_node_bandwidth / 10)
    for nodes in counts:
        assert _best_multiset(templates, nodes, M, 2, other) == _search_multiset(templates, nodes, M, 2, other)


def test_memo_is_not_part_of_the_template_set(trace_templates):
    _, templates = trace_templates
    fresh = dataclasses.replace(templates)
    instantiate(fresh, list(range(20)), BATCH, MICROBATCH, F)
    assert fresh.memo and fresh == dataclasses.replace(templates)  # eq ignores it
    assert "memo=" not in repr(fresh) and "memo" not in fresh.to_dict()


def test_plan_tables_are_copies(trace_templates):
    _, templates = trace_templates
    plan = instantiate(templates, list(range(20)), BATCH, MICROBATCH, F)
    holders = plan.layer_holders()
    holders[0] = ()
    assert plan.layer_holders()[0] and plan.assignments() == plan.assignments()
    assert plan == dataclasses.replace(plan)  # the cached tables are not fields
