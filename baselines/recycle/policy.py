"""ReCycle-style resilience (Gandhi et al., SOSP'24, first titled "SlipStream"): re-route, no state copy.

What this implements of ReCycle, and where it differs:

- Layout: ReCycle's own setting, homogeneous D x P data and pipeline parallelism: P stages, one per
  node on all of its devices, the layers split into P contiguous ranges balancing compute (forward
  plus backward seconds; ReCycle's prototype's own partitioning is not reproduced); D = floor(nodes /
  P) identical pipelines share the batch evenly; leftover nodes stand by. P is ``pipeline_depth``
  or, when unset, the fastest depth that leaves at least ``min_pipelines`` pipelines (a re-route
  needs a peer) and whose stages fit in device memory. P is fixed at the first start.
- A lost node of stage s of pipeline p (*adaptive pipelining*): p keeps its microbatches and its
  other stages; its template keeps a gap at s and each of its microbatches runs stage s on stage s
  of a peer pipeline (``ExecutionPlan.reroutes``), the peers taking turns so the extra work is
  spread evenly (ReCycle's planner balances it with an MILP). No layer state moves: every peer
  already holds stage s (``Kind.REROUTE``). Several failures are several gaps, in one pipeline or
  many. A pipeline that lost every node is dropped and its microbatches go to the others (they
  are data parallel: the batch is the same). ReCycle's *failure normalisation* (moving failures
  so that they line up) is not done.
- *Decoupled back-propagation*: the re-routed schedule splits each backward into input- and
  weight-gradient passes and defers the latter into bubbles (``oobleck.schedules.recycle``,
  greedy list scheduling instead of ReCycle's MILP).
- *Staggered optimizer step*: not done. Gradient clipping by the global norm needs every stage's
  gradients before any stage may step, so a staggered step would change the trajectory (or need
  ReCycle's own post-step validation and rollback). Steps stay synchronous, so training stays
  exactly single-process training; ``staggering_bound_s`` says what staggering could at most save
  per step by the operation-level cost.
- Time: the same Eq. 1-4 plan time as every explicit layout (``oobleck.planning.layouts``) plus
  what the re-routes add by the operation-level cost of the runtime's own lists
  (``oobleck.schedules.cost``: the re-routed plan's makespan less the intact plan's).
- Fall-back, when no live pipeline holds some stage any more (all D copies lost): a checkpoint
  restart on the best D x P of the alive nodes (``Strategy.restart``); re-instantiation would
  need the lost stage's state, which nobody holds. Checkpoints are periodic for that case only.
- Joins (and standbys): a joined node stands by; while a pipeline has a gap, a standby takes the
  lost stage back: its layers are copied from a peer's stage (a ``RECONFIGURE`` with transfers)
  and that re-route is dropped, restoring the layout.
- Heterogeneous templates (Oobleck's, with several stages per node or unequal ranges) would need a
  lost range split over several peer stages, each hop a partial range; the route builder refuses
  that with its reason (``oobleck.schedules.routes``).
- Memory: a peer running re-routed microbatches keeps their activations (and, until its deferred
  weight passes, their inputs) too; the memory check covers the intact stages only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from baselines.fixed_depth import FixedDepthPipelines, PipelinesState, balanced_partition
from oobleck.errors import ConfigError
from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.layouts import even_split
from oobleck.planning.outputs import ExecutionPlan, PipelineTemplate, Reroute
from oobleck.planning.reconfigure import plan_transfers
from oobleck.strategy import Decision, Kind, Layout, RunState, StrategyConfig, StrategyContext

FAILED = -1  # a stage slot whose node failed: its microbatches are re-routed through peers
NANOSECONDS = 1e9  # compute seconds as integer weights for the balanced partition


@dataclass
class ReCycleConfig(StrategyConfig):
    _target_: str = "baselines.recycle.policy.ReCycle"
    name: str = "recycle"
    # Checkpoints serve only the fall-back (all copies of a stage lost): rare, like Bamboo's.
    checkpoint_every_steps: int = 100
    pipeline_depth: int | None = None  # None: the fastest depth leaving min_pipelines pipelines
    # A re-route needs a peer pipeline holding the same stage: at least 2.
    min_pipelines: int = 2

    def __post_init__(self) -> None:
        if self.pipeline_depth is not None and int(self.pipeline_depth) < 1:
            raise ConfigError(
                f"strategy.pipeline_depth={self.pipeline_depth} must be at least 1 (or null: the fastest "
                "depth); see conf/strategy/recycle.yaml"
            )
        if int(self.min_pipelines) < 2:
            raise ConfigError(
                f"strategy.min_pipelines={self.min_pipelines} must be at least 2: a re-route sends a lost "
                "stage's work through the same stage of a peer pipeline; see conf/strategy/recycle.yaml"
            )


@dataclass(frozen=True)
class ReCycleState(PipelinesState):
    """A slot's node is FAILED when its microbatches are re-routed through peer pipelines."""

    @property
    def gaps(self) -> int:
        return sum(node == FAILED for slots in self.pipelines for node in slots)


class ReCycle(FixedDepthPipelines[ReCycleState]):
    Config = ReCycleConfig
    requires_checkpoints = True  # the fall-back restarts from one
    config: ReCycleConfig

    def __init__(self, config: ReCycleConfig, context: StrategyContext) -> None:
        super().__init__(config, context, ReCycleState)
        self._layouts: dict[ReCycleState, Layout] = {}
        # The intact plan's operation-level makespan depends only on the split and the number of
        # pipelines (its nodes are renumbered), and every gapped state of a run shares it: cost it once.
        self._intact_makespan: dict[tuple[tuple[tuple[int, int], ...], int, int], float] = {}
        # Likewise a gapped plan's depends only on where its gaps are, not on which nodes hold the
        # other stages (the cluster's nodes are alike): states of equal gaps share one costing,
        # however the nodes of a run, a trace or a shifted start are numbered.
        self._rerouted_makespan: dict[tuple, float] = {}

    # ----- layouts -------------------------------------------------------------------------------
    def partition(self, depth: int) -> tuple[tuple[int, int], ...]:
        seconds = [round((layer.forward_s + layer.backward_s) * NANOSECONDS) for layer in self.context.profile.layers]
        return balanced_partition(seconds, depth)

    def _gapped(self, template: PipelineTemplate, live: Sequence[int]) -> PipelineTemplate:
        """``template`` without the stage slots not in ``live``, the rest renumbered onto its nodes."""
        stages = tuple(replace(template.stages[s], node=i) for i, s in enumerate(live))
        return replace(
            template,
            num_nodes=len(live),
            stages=stages,
            stage_seconds=tuple(template.stage_seconds[s] for s in live),
            stage_memory_bytes=tuple(template.stage_memory_bytes[s] for s in live),
        )

    def fits(self, depth: int) -> bool:
        memory = self.template(self.partition(depth)).stage_memory_bytes
        return max(memory) <= self.context.cluster.device_memory_bytes

    def plan(self, state: ReCycleState) -> ExecutionPlan:
        """The plan of ``state``: gaps become re-routes through the peers that hold the stage, each
        peer taking the next microbatch in turn (fewest detours first, then the lowest index)."""
        ctx = self.context
        intact = self.template(state.partition)
        split = even_split(ctx.num_microbatches, len(state.pipelines))
        templates, groups, reroutes = [], [], []
        detours = [0] * len(state.pipelines)
        for slots in state.pipelines:
            live = [s for s, node in enumerate(slots) if node != FAILED]
            templates.append(intact if len(live) == state.depth else self._gapped(intact, live))
            groups.append(tuple(slots[s] for s in live))
        for p, slots in enumerate(state.pipelines):
            for s in (s for s, node in enumerate(slots) if node == FAILED):
                peers = [q for q, other in enumerate(state.pipelines) if other[s] != FAILED]
                via = []
                for _ in range(split[p]):
                    peer = min(peers, key=lambda q: (detours[q], q))
                    detours[peer] += 1
                    via.append(peer)
                start, end = state.partition[s]
                reroutes.append(Reroute(p, start, end, tuple(via)))
        plan = self.pipelines_plan(templates, groups, split)
        # explicit_plan takes num_layers from the first template, which is gapped when pipeline 0
        # lost its last stage: the model is still the intact template's.
        return replace(plan, reroutes=tuple(reroutes), num_layers=intact.num_layers)

    def rerouted_extra_s(self, state: ReCycleState, plan: ExecutionPlan | None = None) -> float:
        """Seconds the re-routes add to a step: the operation-level makespan of ``state``'s plan
        (``plan`` when the caller has it) less that of the same pipelines intact
        (``oobleck.schedules.cost``)."""
        key = (
            state.partition,
            state.depth,
            tuple(tuple(node == FAILED for node in nodes) for nodes in state.pipelines),
        )
        if key not in self._rerouted_makespan:
            self._rerouted_makespan[key] = self._makespan_s(self.plan(state) if plan is None else plan)
        return max(0.0, self._rerouted_makespan[key] - self.intact_makespan_s(state))

    def intact_makespan_s(self, state: ReCycleState) -> float:
        """The operation-level makespan of ``state``'s pipelines with no gap, once per
        (partition, depth, pipeline count)."""
        key = (state.partition, state.depth, len(state.pipelines))
        if key not in self._intact_makespan:
            intact = replace(
                state,
                pipelines=tuple(
                    tuple(range(p * state.depth, (p + 1) * state.depth)) for p in range(len(state.pipelines))
                ),
            )
            self._intact_makespan[key] = self._makespan_s(self.plan(intact))
        return self._intact_makespan[key]

    def _makespan_s(self, plan: ExecutionPlan) -> float:
        from oobleck.schedules.cost import plan_cost

        ctx = self.context
        return plan_cost(plan, ctx.profile, ctx.cluster).makespan_s

    def layout(self, state: ReCycleState) -> Layout:
        if state not in self._layouts:
            plan = self.plan(state)
            seconds = plan.predicted_iteration_s + (self.rerouted_extra_s(state, plan) if state.gaps else 0.0)
            plan = replace(plan, predicted_iteration_s=seconds)
            described = f"D={len(state.pipelines)} x P={state.depth}"
            if state.gaps:
                described += f", {state.gaps} stage(s) re-routed"
            self._layouts[state] = Layout(plan, seconds, described, standby=state.spares, state=state)
        return self._layouts[state]

    def choose_depth(self, nodes: Sequence[int]) -> tuple[int | None, str]:
        """The pipeline depth of the first start, or None and why none can run."""
        layers, count = len(self.context.profile.layers), len(nodes)
        least = int(self.config.min_pipelines)
        if self.config.pipeline_depth is not None:
            depth = int(self.config.pipeline_depth)
            if depth > layers or count // depth < least:
                return None, (
                    f"strategy.pipeline_depth={depth} needs depth <= layers ({layers}) and at least "
                    f"strategy.min_pipelines={least} pipelines of it on {count} nodes (a re-route needs a peer); "
                    "lower the depth or add nodes"
                )
            if not self.fits(depth):
                return None, f"out of memory: a stage of pipeline depth {depth} does not fit in device memory"
            return depth, ""
        candidates = [d for d in range(1, min(layers, count // least) + 1) if self.fits(d)]
        if not candidates:
            return None, (
                f"no pipeline depth leaves strategy.min_pipelines={least} pipelines on {count} nodes with every "
                "stage in device memory (out of memory or too few nodes)"
            )
        best = min(candidates, key=lambda d: (self._fresh_iteration_s(d, nodes), d))
        return best, ""

    def _fresh_iteration_s(self, depth: int, nodes: Sequence[int]) -> float:
        state = self.fresh_state(depth, nodes)
        return math.inf if state is None else self.layout(state).iteration_s

    # ----- decisions -----------------------------------------------------------------------------
    def on_change(self, run: RunState) -> Decision:
        state: ReCycleState = run.layout.state
        alive = set(run.alive)
        slots = [tuple(node if node in alive else FAILED for node in nodes) for nodes in state.pipelines]
        spares = [n for n in state.spares if n in alive] + [n for n in run.joined if n not in state.spares]
        lost = sorted(n for nodes in state.pipelines for n in nodes if n != FAILED and n not in alive)
        pipelines = [nodes for nodes in slots if any(node != FAILED for node in nodes)]
        uncovered = [s for s in range(state.depth) if all(nodes[s] == FAILED for nodes in pipelines)]
        if uncovered:
            return self.restart(
                run,
                f"no live pipeline holds stage(s) {uncovered} any more (every copy lost): restart from the "
                "last checkpoint",
            )
        if not lost:
            return self._restore(run, replace(state, spares=tuple(sorted(spares))))
        current = ReCycleState(state.depth, state.partition, tuple(pipelines), tuple(sorted(spares)))
        if spares:  # a standby takes a lost stage back at once (a state copy): see _restore
            return self._restore(run, current, lost)
        return Decision(
            Kind.REROUTE,
            self.layout(current),
            reason=f"lost node(s) {lost}: their stages' microbatches re-routed through peer pipelines",
        )

    def _restore(self, run: RunState, state: ReCycleState, lost: Sequence[int] = ()) -> Decision:
        """Standbys fill gaps (their stage copied from a peer's), the layout restored; else continue."""
        pipelines = [list(nodes) for nodes in state.pipelines]
        spares = list(state.spares)
        filled = []
        for nodes in pipelines:
            for s, node in enumerate(nodes):
                if node == FAILED and spares:
                    nodes[s] = spares.pop(0)
                    filled.append(nodes[s])
        restored = ReCycleState(state.depth, state.partition, tuple(map(tuple, pipelines)), tuple(spares))
        layout = self.layout(restored)
        if not filled and not lost:
            return Decision(Kind.CONTINUE, layout, reason="joined nodes stand by" if run.joined else "")
        if not filled:
            return Decision(Kind.REROUTE, layout, reason=f"lost node(s) {list(lost)}: re-routed")
        ctx = self.context
        transfers = plan_transfers(
            run.layout.plan, layout.plan, run.removed, ctx.layer_param_bytes, max_sources=ctx.transfer_sources
        )
        return Decision(
            Kind.RECONFIGURE,
            layout,
            transfers=tuple(transfers),
            reason=f"node(s) {filled} take back a lost stage (copied from a peer): re-route dropped",
        )


def staggering_bound_s(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterSpec) -> float:
    """The most a staggered optimizer step could save per step of ``plan``, by the operation-level
    cost: a rank whose last op ends early could reduce its gradients and step while the others
    finish, so at most the gap between the earliest rank's end and the makespan is hidden (and
    never more than the reduction and optimizer step themselves, which the caller bounds)."""
    from oobleck.schedules.cost import plan_cost

    cost = plan_cost(plan, profile, cluster)
    return cost.makespan_s - min(cost.rank_end_s)
