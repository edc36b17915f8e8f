"""What a plan means for communication: ranks of every stage shard, P2P channels, gradient groups.

Pure functions of the plan (no torch), so every rank derives the same group list and creates the
groups it belongs to in the same global order.

- Stage shards: a stage on g devices splits every microbatch's rows into g contiguous parts
  (``rows``); a shard sends to each shard of the next hop of a microbatch's route exactly the
  rows both own. Routes (``oobleck.schedules.routes``) are a plan's pipelines, stage by stage, and
  a re-routed pipeline's detours through peer pipelines: the channels are those of every route's
  consecutive hops, so they are exactly the peers the schedule's sends and receives name.
- Gradient groups: layers whose holder rank sets are equal share one group (``grad/<ranks>``),
  so one bucketed all-reduce per group sums the gradient over every pipeline and every shard.
- Tied weights (embedding and LM head): one group over the union of both layers' holders.
- Gradient-norm ownership: each layer's norm is counted by its lowest-rank holder only.
- Shadow copies (``WorkerAssignment.shadow_layers``) are holders like any other: they join the
  layer's gradient group (contributing a zero gradient, receiving the sum) and step the same
  optimizer, so they stay bit-identical; only the norm is counted by a stage's own holder.
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.planning.outputs import ExecutionPlan, ReconfigurationPlan, WorkerAssignment
from oobleck.runtime.comm import GroupSpec, channel_name
from oobleck.schedules.routes import Routes, plan_routes, rows

WORLD = "world"


def _ranks_name(kind: str, ranks: tuple[int, ...]) -> str:
    return f"{kind}/" + "-".join(str(r) for r in ranks)


@dataclass(frozen=True)
class GradGroup:
    name: str
    ranks: tuple[int, ...]
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    plan: ExecutionPlan
    rank: int
    assignment: WorkerAssignment
    world: tuple[int, ...]
    stage_ranks: dict[tuple[int, int], tuple[int, ...]]  # (pipeline, stage) -> ranks by shard
    grad_groups: tuple[GradGroup, ...]  # every group of the plan (size >= 2)
    tied_group: GradGroup | None  # union of holders of the tied layers
    norm_owner: dict[int, int]  # layer -> rank that counts it in the gradient norm
    routes: Routes  # every microbatch's hops through the plan's ranks

    @property
    def pipeline(self):
        return self.plan.pipelines[self.assignment.pipeline]

    @property
    def num_stages(self) -> int:
        return self.pipeline.template.num_stages

    @property
    def is_first(self) -> bool:
        return self.assignment.stage == 0

    @property
    def is_last(self) -> bool:
        return self.assignment.stage == self.num_stages - 1

    def my_rows(self) -> tuple[int, int]:
        return rows(self.plan.microbatch_size, self.assignment.shards, self.assignment.shard)

    def my_grad_groups(self) -> list[GradGroup]:
        return [g for g in self.grad_groups if self.rank in g.ranks]


def build_topology(plan: ExecutionPlan, worker: tuple[int, int], tied_layers: tuple[int, ...] = ()) -> Topology | None:
    """The topology of ``plan`` seen from ``worker``; None when the plan does not use it."""
    assignments = plan.assignments()
    mine = next((a for a in assignments if tuple(a.worker) == tuple(worker)), None)
    if mine is None:
        return None
    stage_ranks: dict[tuple[int, int], list[int]] = {}
    holders: dict[int, list[int]] = {layer: [] for layer in range(plan.num_layers)}
    primary: dict[int, list[int]] = {layer: [] for layer in range(plan.num_layers)}
    for a in assignments:
        stage_ranks.setdefault((a.pipeline, a.stage), []).append(a.rank)
        for layer in a.held_layers:
            holders[layer].append(a.rank)
        for layer in a.layers:
            primary[layer].append(a.rank)
    by_set: dict[tuple[int, ...], list[int]] = {}
    for layer, ranks in holders.items():
        by_set.setdefault(tuple(sorted(ranks)), []).append(layer)
    grad_groups = tuple(
        GradGroup(_ranks_name("grad", ranks), ranks, tuple(layers))
        for ranks, layers in sorted(by_set.items())
        if len(ranks) > 1
    )
    tied_group = None
    if tied_layers:
        union = tuple(sorted({r for layer in tied_layers for r in holders[layer]}))
        tied_group = GradGroup(_ranks_name("tied", union), union, tuple(tied_layers))
    return Topology(
        plan=plan,
        rank=mine.rank,
        assignment=mine,
        world=tuple(a.rank for a in assignments),
        stage_ranks={k: tuple(v) for k, v in stage_ranks.items()},
        grad_groups=grad_groups,
        tied_group=tied_group,
        norm_owner={layer: min(ranks) for layer, ranks in primary.items() if ranks},
        routes=plan_routes(plan),
    )


def rank_of(plan: ExecutionPlan) -> dict[tuple[int, int], int]:
    return {a.worker: a.rank for a in plan.assignments()}


def group_specs(topology: Topology, reconfiguration: ReconfigurationPlan | None = None) -> list[GroupSpec]:
    """Every group of the generation (all ranks compute the same list)."""
    plan = topology.plan
    specs: list[GroupSpec] = []
    if len(topology.world) > 1:
        specs.append(GroupSpec(WORLD, tuple(sorted(topology.world))))
    specs += [GroupSpec(g.name, g.ranks) for g in topology.grad_groups]
    if topology.tied_group is not None and len(topology.tied_group.ranks) > 1:
        specs.append(GroupSpec(topology.tied_group.name, topology.tied_group.ranks))
    for src, dst in topology.routes.channels():
        specs.append(GroupSpec(channel_name(src, dst, "act"), tuple(sorted((src, dst)))))
        specs.append(GroupSpec(channel_name(dst, src, "grad"), tuple(sorted((src, dst)))))
    if reconfiguration is not None:
        ranks = rank_of(plan)
        pairs = sorted({(ranks[t.source], ranks[t.target]) for t in reconfiguration.transfers})
        specs += [GroupSpec(channel_name(s, d, "xfer"), tuple(sorted((s, d)))) for s, d in pairs if s != d]
    return specs
