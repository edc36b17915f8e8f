"""Plans for the schedule tests, built directly (no planner): any layout the runtime accepts.

``random_plan`` draws heterogeneous pipelines (different depths and layer splits, stages sharded
over up to 3 devices, two stages sharing a node, microbatch counts below and above the depth);
``bamboo_plan`` a D x P layout whose stages also hold their successor's layers; ``rerouted_plan``
a D x P layout where some pipelines lost stages and send those microbatches through peers
(``seeded_rerouted_plan`` the same from a seeded ``random.Random``, with uneven layer splits and
per-pipeline stage times); ``crafted_routes`` routes no plan makes.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import strategies as st

from oobleck.planning.outputs import (
    ExecutionPlan,
    PipelineInstance,
    PipelineTemplate,
    Reroute,
    ShadowCopy,
    StageSpec,
)
from oobleck.schedules.routes import Route, Routes, plan_routes


def make_template(stages: list[tuple[int, int, int, int, int]], seconds: list[float] | None = None) -> PipelineTemplate:
    """stages: (start, end, node position, gpu offset, gpus)."""
    specs = tuple(StageSpec(*s) for s in stages)
    times = tuple(seconds) if seconds is not None else tuple(1.0 for _ in specs)
    num_nodes = max(s.node for s in specs) + 1
    return PipelineTemplate(num_nodes, specs, times, tuple(0.0 for _ in specs), 4 * len(specs), 1.0)


def make_plan(
    pipelines: list[tuple[PipelineTemplate, int]], *, layers: int, micro: int, gpus: int, node_base: int = 0
) -> ExecutionPlan:
    """pipelines: (template, microbatches); each pipeline gets fresh node ids in order."""
    instances, first, node = [], 0, node_base
    for index, (template, m) in enumerate(pipelines):
        nodes = tuple(range(node, node + template.num_nodes))
        node += template.num_nodes
        instances.append(PipelineInstance(index, template, nodes, m, first, 1.0))
        first += m
    return ExecutionPlan(tuple(instances), layers, first * micro, micro, 0, gpus, 1.0)


@st.composite
def random_plan(draw, max_pipelines: int = 3, max_stages: int = 4, max_gpus: int = 3) -> ExecutionPlan:
    layers = draw(st.integers(2, 8))
    micro = draw(st.integers(1, 4))
    count = draw(st.integers(1, max_pipelines))
    pipelines = []
    for _ in range(count):
        depth = draw(st.integers(1, min(max_stages, layers)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=depth - 1, max_size=depth - 1)))
        bounds = [0, *cuts, layers]
        stages, node, offset = [], 0, 0
        for i in range(depth):
            gpus = draw(st.integers(1, max_gpus))
            if i > 0 and (offset + gpus > max_gpus or not draw(st.booleans())):
                node, offset = node + 1, 0
            stages.append((bounds[i], bounds[i + 1], node, offset, gpus))
            offset += gpus
        seconds = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(depth)]
        pipelines.append((make_template(stages, seconds), draw(st.integers(0, 2 * depth + 1))))
    if sum(m for _, m in pipelines) == 0:
        pipelines[0] = (pipelines[0][0], 1)
    return make_plan(pipelines, layers=layers, micro=micro, gpus=max_gpus)


def even_bounds(layers: int, depth: int) -> list[int]:
    return [i * layers // depth for i in range(depth + 1)]


def dxp_template(bounds: list[int], gpus: int) -> PipelineTemplate:
    return make_template([(bounds[i], bounds[i + 1], i, 0, gpus) for i in range(len(bounds) - 1)])


@st.composite
def bamboo_plan(draw) -> ExecutionPlan:
    depth = draw(st.integers(2, 4))
    layers = draw(st.integers(depth, 8))
    gpus = draw(st.integers(1, 2))
    count = draw(st.integers(1, 3))
    bounds = even_bounds(layers, depth)
    template = dxp_template(bounds, gpus)
    plan = make_plan(
        [(template, draw(st.integers(1, 2 * depth + 1))) for _ in range(count)],
        layers=layers,
        micro=draw(st.integers(1, 3)),
        gpus=gpus,
    )
    shadows = tuple(
        ShadowCopy(p, i, tuple(range(bounds[(i + 1) % depth], bounds[(i + 1) % depth + 1])))
        for p in range(count)
        for i in range(depth)
    )
    return replace(plan, shadows=shadows, redundancy=draw(st.sampled_from(["inline", "eager", "lazy"])))


@st.composite
def rerouted_plan(draw) -> ExecutionPlan:
    depth = draw(st.integers(2, 4))
    count = draw(st.integers(2, 4))
    layers = draw(st.integers(depth, 8))
    gpus = draw(st.integers(1, 2))
    bounds = even_bounds(layers, depth)
    lost = draw(st.sets(st.tuples(st.integers(0, count - 1), st.integers(0, depth - 1)), min_size=1, max_size=count))
    # Every stage keeps a holder and every pipeline keeps a stage.
    lost = {(p, s) for p, s in lost if sum((q, s) in lost for q in range(count)) < count}
    lost = {(p, s) for p, s in lost if sum((p, t) in lost for t in range(depth)) < depth}
    if not lost:
        lost = {(0, depth - 1)}
    pipelines = []
    for p in range(count):
        kept = [s for s in range(depth) if (p, s) not in lost]
        stages = [(bounds[s], bounds[s + 1], node, 0, gpus) for node, s in enumerate(kept)]
        pipelines.append((make_template(stages), draw(st.integers(1, 2 * depth + 1))))
    plan = make_plan(pipelines, layers=layers, micro=draw(st.integers(1, 3)), gpus=gpus)
    reroutes = []
    for p, s in sorted(lost):
        keepers = [q for q in range(count) if (q, s) not in lost]
        via = tuple(draw(st.sampled_from(keepers)) for _ in range(pipelines[p][1]))
        reroutes.append(Reroute(p, bounds[s], bounds[s + 1], via))
    return replace(plan, reroutes=tuple(reroutes))


def seeded_rerouted_plan(rng: random.Random, max_depth: int = 6, max_pipelines: int = 5) -> ExecutionPlan:
    """A D x P layout with an uneven layer split where some pipelines lost stages (every stage
    keeps a holder, every pipeline a stage); each pipeline has its own stage times."""
    depth = rng.randint(2, max_depth)
    count = rng.randint(2, max_pipelines)
    layers = rng.randint(depth, depth + 4)
    bounds = [0, *sorted(rng.sample(range(1, layers), depth - 1)), layers]
    lost = {(rng.randrange(count), rng.randrange(depth)) for _ in range(rng.randint(1, 2 * count))}
    lost = {(p, s) for p, s in lost if sum((q, s) in lost for q in range(count)) < count}
    lost = {(p, s) for p, s in lost if sum((p, t) in lost for t in range(depth)) < depth}
    if not lost:
        lost = {(0, rng.randrange(depth))}
    times = rng.choice([[1.0], [0.5, 1.0, 2.0], [0.0, 1.0, 1.5], [0.0, 0.25, 3.0]])
    gpus = rng.randint(1, 2)
    pipelines = []
    for p in range(count):
        kept = [s for s in range(depth) if (p, s) not in lost]
        stages = [(bounds[s], bounds[s + 1], node, 0, gpus) for node, s in enumerate(kept)]
        seconds = [rng.choice(times) for _ in kept]
        pipelines.append((make_template(stages, seconds), rng.randint(1, 3 * depth)))
    plan = make_plan(pipelines, layers=layers, micro=rng.randint(1, 3), gpus=gpus)
    reroutes = []
    for p, s in sorted(lost):
        keepers = [q for q in range(count) if (q, s) not in lost]
        m = pipelines[p][1]
        if rng.random() < 0.5:
            via = tuple(keepers[k % len(keepers)] for k in range(m))
        else:
            via = tuple(rng.choice(keepers) for _ in range(m))
        reroutes.append(Reroute(p, bounds[s], bounds[s + 1], via))
    return replace(plan, reroutes=tuple(reroutes))


def crafted_routes(rng: random.Random, repeats: bool = False) -> Routes:
    """Routes no plan makes: each microbatch visits random distinct slots of a D x P layout in a
    random order, so slots sit at different positions on different routes (the in-flight limits
    then hold every slot at times, and the scheduler relaxes them); with ``repeats``, a route may
    visit a slot more than once (for lowering arbitrary orders)."""
    depth, count = rng.randint(1, 4), rng.randint(1, 4)
    template = dxp_template(even_bounds(depth, depth), 1)
    pipelines = [
        (
            replace(template, stage_seconds=tuple(rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(depth))),
            rng.randint(1, 8),
        )
        for _ in range(count)
    ]
    plan = make_plan(pipelines, layers=depth, micro=1, gpus=1)
    slots = plan_routes(plan).slots
    keys = sorted(slots)
    routes = []
    for pipeline in plan.pipelines:
        for k in range(pipeline.microbatches):
            length = rng.randint(1, min(len(keys), depth + 2))
            path = rng.choices(keys, k=length) if repeats else rng.sample(keys, length)
            routes.append(Route(pipeline.index, pipeline.first_microbatch + k, tuple(slots[s] for s in path)))
    return Routes(plan, tuple(routes), slots)
