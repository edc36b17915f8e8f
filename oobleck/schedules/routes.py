"""Where each microbatch goes: its route, hop by hop, through the ranks of a plan.

A plan's pipeline runs its microbatches through its stages in order; each stage is a *hop* (a
layer range on the ranks of its shards, every shard taking rows ``rows(b, shards, shard)`` of
every microbatch). A re-routed pipeline (``ExecutionPlan.reroutes``, ReCycle-style) has a gap in
its template: for those layers its k-th microbatch takes a detour through the stage of pipeline
``via[k]`` that holds exactly them. Routes are what the schedule generators order and what the
runtime's topology derives its point-to-point channels from, so both always agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan


def rows(microbatch_size: int, shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a microbatch that shard ``shard`` of ``shards`` processes."""
    return shard * microbatch_size // shards, (shard + 1) * microbatch_size // shards


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (0, 0)


@dataclass(frozen=True)
class Hop:
    """Layers ``[start, end)`` on ``ranks`` (one per shard, in shard order) of stage ``stage`` of
    pipeline ``pipeline``."""

    pipeline: int
    stage: int
    start: int
    end: int
    ranks: tuple[int, ...]

    def shard_rows(self, microbatch_size: int) -> list[tuple[int, tuple[int, int]]]:
        """(rank, rows) of every shard."""
        return [(rank, rows(microbatch_size, len(self.ranks), j)) for j, rank in enumerate(self.ranks)]


@dataclass(frozen=True)
class Route:
    """The hops microbatch ``microbatch`` of pipeline ``pipeline`` takes, in layer order."""

    pipeline: int
    microbatch: int
    hops: tuple[Hop, ...]


@dataclass(frozen=True)
class Routes:
    """Every microbatch's route through a plan, and the plan's stage slots."""

    plan: ExecutionPlan
    routes: tuple[Route, ...]  # in plan.iter_microbatches() order
    slots: dict[tuple[int, int], Hop]  # (pipeline, stage) -> the stage as a hop

    @property
    def microbatch_size(self) -> int:
        return self.plan.microbatch_size

    @cached_property
    def by_microbatch(self) -> dict[int, Route]:
        return {route.microbatch: route for route in self.routes}

    def neighbours(
        self, hop: Hop, rank: int, route: Route, position: int, offset: int
    ) -> list[tuple[int, tuple[int, int]]]:
        """(peer rank, rows both own) for each shard of the hop ``offset`` away from ``position``
        on ``route`` whose rows overlap those of ``rank`` (a shard of ``hop``)."""
        return self.overlapping(hop, rank, route.hops[position + offset])

    def overlapping(self, hop: Hop, rank: int, other: Hop) -> list[tuple[int, tuple[int, int]]]:
        """(peer rank, rows both own) for each shard of ``other`` whose rows overlap those of
        ``rank`` (a shard of ``hop``), in shard order."""
        mine = rows(self.microbatch_size, len(hop.ranks), hop.ranks.index(rank))
        result = []
        for peer, theirs in other.shard_rows(self.microbatch_size):
            common = overlap(mine, theirs)
            if common[1] > common[0]:
                result.append((peer, common))
        return result

    def channels(self) -> Iterator[tuple[int, int]]:
        """(sender, receiver) of every activation channel (each has a gradient channel back)."""
        seen: set[tuple[int, int]] = set()
        b = self.microbatch_size
        for route in self.routes:
            for here, there in zip(route.hops, route.hops[1:]):
                for src, a in here.shard_rows(b):
                    for dst, c in there.shard_rows(b):
                        common = overlap(a, c)
                        if common[1] > common[0] and (src, dst) not in seen:
                            seen.add((src, dst))
                            yield src, dst


def plan_routes(plan: ExecutionPlan) -> Routes:
    """The routes of ``plan``; ``PlanningError`` names what makes a re-routed plan inconsistent."""
    slots: dict[tuple[int, int], Hop] = {}
    ranks: dict[tuple[int, int], list[int]] = {}
    for a in plan.assignments():
        ranks.setdefault((a.pipeline, a.stage), []).append(a.rank)
    for pipeline in plan.pipelines:
        for index, stage in enumerate(pipeline.template.stages):
            key = (pipeline.index, index)
            slots[key] = Hop(pipeline.index, index, stage.start, stage.end, tuple(ranks[key]))
    gaps = _gaps(plan)
    routes = []
    for pipeline in plan.pipelines:
        own = [slots[(pipeline.index, i)] for i in range(pipeline.template.num_stages)]
        for k in range(pipeline.microbatches):
            hops = list(own)
            for start, (end, via) in gaps.get(pipeline.index, {}).items():
                hops.append(_peer_hop(plan, slots, pipeline.index, start, end, via[k]))
            hops.sort(key=lambda hop: hop.start)
            routes.append(Route(pipeline.index, pipeline.first_microbatch + k, tuple(hops)))
    return Routes(plan, tuple(routes), slots)


def _gaps(plan: ExecutionPlan) -> dict[int, dict[int, tuple[int, tuple[int, ...]]]]:
    """pipeline -> gap start -> (gap end, via), checked against the pipelines' templates."""
    pipelines = {p.index: p for p in plan.pipelines}
    declared: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
    for reroute in plan.reroutes:
        p = reroute.pipeline
        if p not in pipelines:
            raise PlanningError(f"re-route of pipeline {p}: the plan has pipelines {sorted(pipelines)}")
        if not 0 <= reroute.start < reroute.end <= plan.num_layers:
            raise PlanningError(
                f"re-route of pipeline {p}: layers [{reroute.start}, {reroute.end}) are not a layer range of "
                f"the model's {plan.num_layers}"
            )
        if len(reroute.via) != pipelines[p].microbatches:
            raise PlanningError(
                f"re-route of pipeline {p}, layers [{reroute.start}, {reroute.end}): via names "
                f"{len(reroute.via)} pipelines but the pipeline takes {pipelines[p].microbatches} microbatches "
                "(one peer per microbatch)"
            )
        declared.setdefault(p, {})[reroute.start] = (reroute.end, tuple(reroute.via))
    for pipeline in plan.pipelines:
        expected = 0
        for stage in sorted(pipeline.template.stages, key=lambda s: s.start):
            expected = _skip_gap(declared, pipeline.index, expected, stage.start)
            expected = stage.end
        _skip_gap(declared, pipeline.index, expected, plan.num_layers)
    for p, gaps in declared.items():
        for start, (end, _) in gaps.items():
            holes = [s for s in pipelines[p].template.stages if s.start < end and start < s.end]
            if holes:
                raise PlanningError(
                    f"re-route of pipeline {p}: its template still has a stage of layers "
                    f"[{holes[0].start}, {holes[0].end}) inside the re-routed [{start}, {end})"
                )
    return declared


def _skip_gap(declared: dict, pipeline: int, expected: int, found: int) -> int:
    """Walk the declared gaps of ``pipeline`` from layer ``expected`` to its next stage at ``found``."""
    while expected < found:
        gap = declared.get(pipeline, {}).get(expected)
        if gap is None or gap[0] > found:
            raise PlanningError(
                f"pipeline {pipeline} has no stage for layers [{expected}, {found}) and no re-route of them: "
                "a pipeline's stages must cover every layer, or Reroutes must name its gaps exactly"
            )
        expected = gap[0]
    if expected != found:
        raise PlanningError(f"pipeline {pipeline}: a re-route ends at layer {expected}, inside its stage from {found}")
    return found


def _peer_hop(
    plan: ExecutionPlan, slots: dict[tuple[int, int], Hop], pipeline: int, start: int, end: int, via: int
) -> Hop:
    matches = [hop for (p, _), hop in slots.items() if p == via and hop.start == start and hop.end == end]
    if via == pipeline or not matches:
        raise PlanningError(
            f"re-route of pipeline {pipeline}, layers [{start}, {end}): pipeline {via} has no stage of exactly "
            "those layers to run them (a peer must hold the same stage; heterogeneous templates need the "
            "re-routed range split over several peer stages, which this generator does not do)"
        )
    return matches[0]
