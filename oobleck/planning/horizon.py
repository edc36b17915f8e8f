"""The regroup-or-re-plan horizon: how many steps a new plan is expected to run.

On a membership change the planner either regroups around the pipelines that lost no node or
instantiates afresh (``oobleck.planning.reconfigure``): a fresh plan that is faster per step but
copies more state pays off only if it runs long enough. It runs until the next membership change,
so the horizon is the expected number of steps between changes, which a run knows from its failure
schedule: the mean gap between its changes (a poisson schedule's ``failures.mtbf_s``; an explicit
schedule's run length over its number of changes; a trace's span over its changes) over the
predicted step time. Without a schedule to go by, ``planner.replan_horizon_steps`` (conf/config.yaml).

Pure functions, for real runs (``oobleck.elastic.job``) and the simulator alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from oobleck.errors import PlanningError


def mean_change_gap_s(change_times_s: Iterable[float], span_s: float | None = None) -> float | None:
    """Mean seconds between membership changes: ``span_s`` (default: the last change's time) over
    the number of distinct change times; None without changes (or a span of zero)."""
    times = sorted({float(t) for t in change_times_s})
    if not times:
        return None
    span = times[-1] if span_s is None else float(span_s)
    return span / len(times) if span > 0 else None


def replan_horizon_steps(mean_gap_s: float | None, iteration_s: float, default_steps: int) -> int:
    """Steps a new plan is expected to run before the next change: ``mean_gap_s`` over the
    predicted seconds per step (at least one step), or ``default_steps`` when the gap is unknown."""
    if default_steps < 0:
        raise PlanningError(f"planner.replan_horizon_steps={default_steps} must be >= 0")
    if mean_gap_s is None:
        return default_steps
    if not (math.isfinite(mean_gap_s) and mean_gap_s > 0):
        raise PlanningError(f"the mean gap between membership changes, {mean_gap_s} s, must be a positive number")
    if not (math.isfinite(iteration_s) and iteration_s > 0):
        raise PlanningError(f"the predicted step time, {iteration_s} s, must be a positive number")
    return max(1, round(mean_gap_s / iteration_s))
