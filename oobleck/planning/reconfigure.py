"""Reconfiguration planning: the plan after nodes fail or join, where its nodes go, and the copies.

Deterministic (every process computes the same plan from the same input), in this order:

1. Membership. ``removed`` nodes failed (a node that is both removed and joined failed and came
   back empty); ``joined`` and ``standby`` nodes hold nothing. Every layer must still have a live
   holder in the old plan, else ``PlanningError`` names the lost layers and the nodes that held them.
2. Size. The new plan keeps ``f' + 1`` pipelines, ``f' = min(f, the most the alive nodes allow)``,
   and uses as many alive nodes as template sizes cover exactly with ``f' + 1 .. M`` pipelines (each
   pipeline needs one of the M microbatches). Alive nodes beyond that stay *standby*: a join that
   cannot be used never fails the run, and a later reconfiguration takes standbys back in.
3. Candidates, each an exact choice of template sizes by the cost model (instantiate's search):
   *regroup* keeps every pipeline that lost no node as it is and picks the best sizes for the
   other nodes (if none covers them, intact pipelines are given up, smallest first); *fresh* is
   the best instantiation on the same number of nodes.
4. Placement. A candidate's pipelines go on the alive nodes by a min-cost assignment
   (``scipy.optimize.linear_sum_assignment``): a node at a pipeline position costs the parameter
   bytes that position needs and the node does not hold (the same local rank keeps its device);
   among equal costs, nodes that hold something come first. The optimum is ``min_bytes_moved``.
5. Decision, by the cost model: ``replan_horizon_steps * predicted iteration time + copy time``
   (``cost.copy_seconds`` of the copies); the cheaper candidate wins, ties go to regrouping. So
   the new plan is never slower than a fresh instantiation unless the extra state a fresh plan
   must copy costs more than it saves over the horizon. ``replanned`` and ``reason`` say which.
6. Copies. Every (worker, layer) that the new plan needs and the worker does not hold gets the
   layer from up to ``max_sources`` surviving holders, as equal chunks, choosing the least-loaded
   sources first so no single source sends it all.

Where the parts live (each module's docstring explains its step): this module, steps 1, 2 and 5
(``reconfigure``) and the f check (``check_fault_tolerance``); ``instantiate``, the search of
step 3; ``placement``, step 4; ``layer_copies``, step 6 and ``plan_transfers``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

from oobleck.errors import PlanningError
from oobleck.planning.gradient_sync import sync_of
from oobleck.planning.instantiate import _best_multiset
from oobleck.planning.layer_copies import (
    DEFAULT_COPY_PIECE_BYTES,
    DEFAULT_MAX_SOURCES,
    _check_replicas,
    _held_ranges,
    plan_transfers,  # noqa: F401 (callers import it from here)
)
from oobleck.planning.outputs import ExecutionPlan, ReconfigurationPlan
from oobleck.planning.placement import (
    _Candidate,
    _place,
    preload_solver,  # noqa: F401 (callers import it from here)
)
from oobleck.planning.templates import TemplateSet

# Steps over which a faster fresh plan must repay its extra copying, for direct API callers; runs
# pass planner.replan_horizon_steps (conf/config.yaml).
DEFAULT_REPLAN_HORIZON_STEPS = 100


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a reconfiguration is planned, which sits on a
    recovery's critical path. Planning allocates tens of thousands of short acyclic tuples, and a
    full collection they trigger traverses everything the process holds (template sets and their
    memos): at 64 nodes of 8 GPUs it added 14-18 ms to one cold 31-33 ms reconfiguration in four
    (``benchmarks/bench_planner.py``). Paused, that collection runs after the recovery instead."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def reconfigure(
    plan: ExecutionPlan,
    templates: TemplateSet,
    removed: Sequence[int] = (),
    joined: Sequence[int] = (),
    layer_param_bytes: Sequence[int] | None = None,
    *,
    max_sources: int = DEFAULT_MAX_SOURCES,
    replan_horizon_steps: int = DEFAULT_REPLAN_HORIZON_STEPS,
    standby: Sequence[int] = (),
    fault_tolerance: int | None = None,
    piece_bytes: int = DEFAULT_COPY_PIECE_BYTES,
) -> ReconfigurationPlan:
    """The plan after ``removed`` nodes fail and ``joined`` nodes arrive (see module docstring).

    ``standby``: alive nodes outside ``plan`` (the previous result's ``standby``); they are
    candidates like joined nodes and may fail (be ``removed``). ``fault_tolerance``: the job's f
    to keep (default ``plan.fault_tolerance``, which after a drop is the reduced value: pass the
    job's f so that joins can restore it).
    """
    if max_sources <= 0:
        raise PlanningError(f"planner.transfer_sources={max_sources} must be > 0")
    if piece_bytes <= 0:
        raise PlanningError(f"planner.copy_piece_mb={piece_bytes / 2**20:g} must be > 0")
    if replan_horizon_steps < 0:
        raise PlanningError(f"planner.replan_horizon_steps={replan_horizon_steps} must be >= 0")
    layer_bytes = tuple(layer_param_bytes if layer_param_bytes is not None else templates.layer_param_bytes)
    if len(layer_bytes) != plan.num_layers:
        raise PlanningError(
            f"layer_param_bytes has {len(layer_bytes)} entries but the plan has {plan.num_layers} layers"
        )
    f = plan.fault_tolerance if fault_tolerance is None else fault_tolerance
    if f < 0:
        raise PlanningError(f"job.fault_tolerance={f} must be >= 0")
    gone, alive = _membership(plan, removed, joined, standby)
    live = _check_replicas(plan, gone)
    M = plan.num_microbatches
    used, kept_f = _plan_size(templates, len(alive), M, f, gone)
    sync = sync_of(templates)
    held = _held_ranges(plan, gone)

    untouched = [p.nodes for p in plan.pipelines if not gone.intersection(p.nodes)]
    intact = sorted(len(nodes) for nodes in untouched)
    regroup = None
    while regroup is None:
        regroup = _best_multiset(templates, used, M, kept_f + 1, sync, fixed=intact)
        if regroup is None:
            if not intact:
                raise PlanningError(f"no template sizes {list(templates.sizes)} cover {used} nodes (a planner bug)")
            intact.pop(0)  # give up the smallest intact pipeline
    fresh = _best_multiset(templates, used, M, kept_f + 1, sync)
    sizes = {"regroup": regroup[1]}
    if fresh is not None and fresh[1] != regroup[1]:
        sizes["fresh"] = fresh[1]
    candidates = [
        _place(
            name,
            multiset,
            plan,
            untouched,
            templates,
            alive,
            held,
            live,
            layer_bytes,
            max_sources,
            piece_bytes,
            f,
            sync,
        )
        for name, multiset in sizes.items()
    ]
    chosen = min(candidates, key=lambda c: c.cost(replan_horizon_steps))  # ties: the first (regroup)
    return ReconfigurationPlan(
        old=plan,
        new=chosen.plan,
        removed=tuple(sorted(gone)),
        joined=tuple(sorted(set(joined))),
        transfers=chosen.transfers,
        standby=chosen.standby,
        min_bytes_moved=chosen.min_bytes,
        replanned=chosen.name == "fresh",
        reason=_reason(chosen, candidates, replan_horizon_steps, f, len(alive)),
    )


def _membership(
    plan: ExecutionPlan, removed: Sequence[int], joined: Sequence[int], standby: Sequence[int]
) -> tuple[set[int], list[int]]:
    """The failed nodes and the sorted alive ones, after checking the change makes sense."""
    current, idle, gone, arrived = set(plan.nodes), set(standby), set(removed), set(joined)
    for name, values in (("removed", removed), ("joined", joined), ("standby", standby)):
        if len(set(values)) != len(values):
            raise PlanningError(f"{name} nodes {sorted(values)} contain duplicates")
    if idle & current:
        raise PlanningError(f"standby nodes {sorted(idle & current)} are in the current plan; standby means idle")
    unknown = sorted(gone - current - idle)
    if unknown:
        raise PlanningError(
            f"removed nodes {unknown} are not in the current plan (nodes {sorted(current)}) nor standby ({sorted(idle)})"
        )
    already = sorted(arrived & ((current | idle) - gone))
    if already:
        raise PlanningError(
            f"joined nodes {already} are already alive (in the current plan or standby); a node that "
            "failed and came back is both removed and joined"
        )
    return gone, sorted(((current | idle) - gone) | arrived)


def _plan_size(templates: TemplateSet, alive: int, microbatches: int, f: int, gone: set[int]) -> tuple[int, int]:
    """(nodes to use, failures the new plan keeps tolerating): step 2 of the module docstring.

    ``counts[n]`` is a bit set of the pipeline counts whose template sizes sum to n exactly.
    """
    n0 = templates.min_nodes
    if alive < n0:
        raise PlanningError(
            f"{alive} nodes are left after losing {sorted(gone)}, fewer than n0={n0} that one pipeline needs; "
            "restart from a checkpoint with more nodes"
        )
    counts = [1] + [0] * alive
    for n in range(1, alive + 1):
        for size in templates.sizes:
            if size > n:
                break
            counts[n] |= counts[n - size] << 1
    usable = (1 << (min(microbatches, alive) + 1)) - 2  # 1 .. M pipelines (never more than nodes)
    most = max((counts[n] & usable).bit_length() - 1 for n in range(alive + 1))
    if most < 1:
        raise PlanningError(
            f"no template sizes {list(templates.sizes)} fit in {alive} alive nodes; restart from a checkpoint"
        )
    kept = min(f, most - 1)
    wanted = usable & ~((1 << (kept + 1)) - 1)  # kept + 1 .. M pipelines
    used = max(n for n in range(alive + 1) if counts[n] & wanted)
    return used, kept


def _reason(chosen: _Candidate, candidates: Sequence[_Candidate], horizon: int, f: int, alive: int) -> str:
    """One sentence with the cost-model figures behind the decision (for events and logs)."""
    by_name = {c.name: c for c in candidates}
    regroup, fresh = by_name["regroup"], by_name.get("fresh")
    if fresh is None:
        text = "regrouped: the pipelines that lost no node stay as they are, and a fresh plan would choose the same template sizes"
    else:
        other = fresh if chosen is regroup else regroup
        saved = horizon * (other.plan.predicted_iteration_s - chosen.plan.predicted_iteration_s)
        extra = chosen.copy_s - other.copy_s
        verb, versus = ("regrouped", "a fresh plan") if chosen is regroup else ("re-planned from scratch", "regrouping")
        text = (
            f"{verb}: {chosen.plan.predicted_iteration_s:.4g} s per iteration and {chosen.copy_s:.3g} s of copying "
            f"({chosen.min_bytes / 1e9:.3g} GB of parameters) against {other.plan.predicted_iteration_s:.4g} s and "
            f"{other.copy_s:.3g} s ({other.min_bytes / 1e9:.3g} GB) for {versus}: over "
            f"planner.replan_horizon_steps={horizon} steps it saves {saved - extra:.4g} s"
        )
    if chosen.plan.fault_tolerance < f:
        text += f"; it tolerates {chosen.plan.fault_tolerance} failures, fewer than job.fault_tolerance={f}"
    if chosen.standby:
        text += (
            f"; nodes {list(chosen.standby)} stay standby: with {chosen.plan.fault_tolerance + 1} to "
            f"{chosen.plan.num_microbatches} pipelines the template sizes cover {len(chosen.plan.nodes)} of the "
            f"{alive} alive nodes, not all"
        )
    return text


def check_fault_tolerance(templates: TemplateSet, nodes: int, fault_tolerance: int) -> None:
    """Raise PlanningError unless every survivor count after up to f failures can be covered.

    Covered: the survivors split exactly into pipelines of template sizes (no idle node). With
    at least f+1 pipelines initially, each holding every layer, f failures leave a replica of
    every layer; with fewer nodes than (f+1) n0 there cannot be f+1 pipelines.
    """
    f = fault_tolerance
    n0 = templates.min_nodes
    if nodes < (f + 1) * n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={nodes}"
        )
    sizes = templates.sizes
    reachable = [False] * (nodes + 1)
    reachable[0] = True
    for n in range(1, nodes + 1):
        reachable[n] = any(s <= n and reachable[n - s] for s in sizes)
    uncovered = [n for n in range(max(nodes - f, 0), nodes + 1) if not reachable[n]]
    if uncovered:
        raise PlanningError(
            f"with f={f} failures out of {nodes} nodes, survivor counts {uncovered} cannot be split into "
            f"pipelines of the template sizes {list(sizes)}; lower job.fault_tolerance or change cluster.nodes"
        )
