"""Varuna-style resilience (Athlur et al., EuroSys'22): checkpoint, restart, morph.

- Layout ("job morphing"): the best homogeneous D x P on the live nodes, the global batch split
  over D identical pipelines, leftover nodes standing by. ``layout_rule`` chooses how:

  - ``varuna`` (default), Varuna's own ``AutoConfig`` (microsoft/varuna, ``varuna/auto_config.py``,
    which ``launcher.py`` calls when neither ``--nstages`` nor ``--chunk_size`` is given, as its
    morphing docs recommend): P ranges over the divisors of the model's partition count (the
    stretches between its CutPoints) below that count (``range(1, num_pstages)``; P = 1 always);
    each stage takes an equal number of consecutive partitions; per P the largest microbatch
    whose stages fit in device memory; D = devices // P; the P with the least predicted batch
    time wins (ties: the smaller P, as ``get_min``'s strict ``<``).
  - ``oobleck_templates``: D identical pipelines of the planner's optimal P-node template (Oobleck's
    templates generated with f=0, so any P from n0 to N) with the job's microbatch: generous to
    Varuna, whose equal partitions are not balanced.

  Where ``varuna`` differs from Varuna's code, and why: partitions are the harness's layers with
  the embedding joined to the first transformer block and the head to the last, which is where
  Varuna's GPT-2 example puts its CutPoints (one between consecutive blocks,
  ``examples/Megatron-LM/megatron.patch``); a stage is one node (data parallel over the node's
  devices) where Varuna counts GPUs; memory and time come from the harness's one cost model (the
  job's profile with forward, backward, activation and boundary sizes scaled linearly to the
  microbatch) where Varuna profiles every microbatch size and simulates its schedule; and the
  whole global batch is trained in microbatches that divide it (the step-indexed sampler needs
  it), replicas differing by at most one, where Varuna gives each replica ``batch_size // D``
  samples (dropping the rest) in microbatches of the largest size that fits: of the sizes that
  fit, the one that leaves the busiest replica the fewest samples, then the largest.
  With a microbatch other than the job's the step's samples and mean loss stay the same.

- Every ``checkpoint_every_steps`` steps a checkpoint (``checkpoint.every_steps`` overrides it).
- Losing a working node kills the job: every worker process stops, fresh ones start on the best
  D x P of the survivors, load the last checkpoint and redo every step since (``RESTART``);
  losing a standby costs nothing.
- A join: if the best layout on the larger node set is faster, checkpoint the current step,
  restart and morph onto it (nothing lost); otherwise keep running, the new node standing by.
- A preemption notice (``on_notice``) for a working node: checkpoint the next step boundary, stop
  there and restart on the best layout of the nodes that stay (nothing lost when the checkpoint
  completes before the kill; otherwise the kill overtakes it and the run rolls back to the last
  complete checkpoint, as on a crash). That is Varuna's morph server on a scheduled event
  (``varuna/morph_server.py``, ``'preempt'``: a listener polls Azure's scheduled events every 5 s,
  ``vmss_scripts/listen_preemption.py``; the server waits until 30 s before the event's NotBefore
  time, at once when less is left, then sends SIGUSR1 to every worker, whose handler saves a
  checkpoint at the end of the iteration and exits; on "checkpoint done" it restarts the job on
  the machines available). Where ours differs: the notices of these runs are seconds, so the
  reaction always comes at once, as Varuna's does for any notice under 30 s; and Varuna then
  sleeps 120 s ("wait for scheduled event to occur") before restarting, where ours restarts at
  once without the nodes under notice (generous to Varuna by that wait). A notice for standby
  nodes changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oobleck.errors import ConfigError, PlanningError
from oobleck.planning.inputs import ModelProfile
from oobleck.planning.instantiate import build_plan
from oobleck.planning.outputs import ExecutionPlan, StageSpec
from oobleck.planning.templates import TemplateSet, make_template
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy, StrategyConfig, StrategyContext

LAYOUT_RULES = ("varuna", "oobleck_templates")


@dataclass
class VarunaConfig(StrategyConfig):
    _target_: str = "baselines.varuna.policy.Varuna"
    name: str = "varuna"
    # Source: the Oobleck artifact's Varuna simulator (SymbioticLab/Oobleck, sosp23-artifact,
    # tools/simulator/varuna_simulator.py): checkpoint_per_iter=10.
    checkpoint_every_steps: int = 10
    morph_on_join: bool = True  # restart onto joined nodes when the larger layout is faster
    layout_rule: str = "varuna"  # varuna | oobleck_templates (module docstring)


def varuna_partitions(profile: ModelProfile) -> list[tuple[int, int]]:
    """The layer ranges between Varuna's CutPoints: one per layer, with a leading embedding joined to
    the first block and a trailing head to the last (GPT-2's CutPoints sit between blocks)."""
    n = profile.num_layers
    first = 1 if n >= 3 and profile.layers[0].name == "embedding" else 0
    last = n - 1 if n >= 3 and profile.layers[-1].name == "head" else n
    if first >= last:
        return [(0, n)]
    units = [(i, i + 1) for i in range(first, last)]
    units[0] = (0, units[0][1])
    units[-1] = (units[-1][0], n)
    return units


def varuna_depths(partitions: int) -> list[int]:
    """AutoConfig's stage counts: divisors of the partition count below it (P = 1 always)."""
    return [p for p in range(1, max(partitions, 2)) if partitions % p == 0]


def scaled_profile(profile: ModelProfile, microbatch_size: int) -> ModelProfile:
    """The profile at another microbatch size: compute, activations and boundary tensors linear in it."""
    if microbatch_size == profile.microbatch_size:
        return profile
    ratio = microbatch_size / profile.microbatch_size
    layers = tuple(
        dataclasses.replace(
            layer,
            forward_s=layer.forward_s * ratio,
            backward_s=layer.backward_s * ratio,
            activation_bytes=round(layer.activation_bytes * ratio),
            output_bytes=round(layer.output_bytes * ratio),
        )
        for layer in profile.layers
    )
    return dataclasses.replace(profile, microbatch_size=microbatch_size, layers=layers)


# The best layout per node count, per strategy context: a layout's speed depends on how many
# nodes it has, not on which, so every restart of every simulation of a model shares the search.
_BEST: dict[int, dict[tuple[Any, ...], Any]] = {}


def _cache_for(owner: object) -> dict[tuple[Any, ...], Any]:
    key = id(owner)
    if key not in _BEST:
        _BEST[key] = {}
        weakref.finalize(owner, _BEST.pop, key, None)
    return _BEST[key]


@dataclass(frozen=True)
class _Shape:
    """One homogeneous layout: D pipelines of P nodes on a template set of that one template."""

    pipelines: int
    size: int
    microbatch: int
    templates: TemplateSet
    iteration_s: float


class Varuna(Strategy):
    Config = VarunaConfig
    requires_checkpoints = True
    config: VarunaConfig

    def __init__(self, config: StrategyConfig, context: StrategyContext) -> None:
        super().__init__(config, context)
        if self.config.layout_rule not in LAYOUT_RULES:
            raise ConfigError(
                f"strategy.layout_rule={self.config.layout_rule} is not one of {', '.join(LAYOUT_RULES)}; "
                "see conf/strategy/varuna.yaml"
            )

    # ------------------------------------------------------------------ layouts
    def _plan(self, shape: _Shape, ordered: Sequence[int]) -> ExecutionPlan:
        ctx = self.context
        groups = [tuple(ordered[i * shape.size : (i + 1) * shape.size]) for i in range(shape.pipelines)]
        return build_plan(
            shape.templates, [shape.size] * shape.pipelines, groups, ctx.global_batch_size, shape.microbatch, 0
        )

    def _shape(self, count: int) -> _Shape | None:
        ctx = self.context
        cache = _cache_for(ctx)
        key = (self.config.layout_rule, count, ctx.global_batch_size, ctx.microbatch_size)
        if key not in cache:
            candidates = (
                self._varuna_shapes(count) if self.config.layout_rule == "varuna" else self._template_shapes(count)
            )
            # Fastest first; on a tie, fewer nodes, then shallower pipelines.
            cache[key] = min(candidates, key=lambda s: (s.iteration_s, s.pipelines * s.size, s.size), default=None)
        return cache[key]

    def _timed(self, templates: TemplateSet, size: int, pipelines: int, microbatch: int) -> _Shape:
        shape = _Shape(pipelines, size, microbatch, templates, 0.0)
        iteration_s = self._plan(shape, range(pipelines * size)).predicted_iteration_s
        return dataclasses.replace(shape, iteration_s=iteration_s)

    def _template_shapes(self, count: int) -> list[_Shape]:
        ctx = self.context
        templates = ctx.templates(0)
        return [
            self._timed(templates, size, min(count // size, ctx.num_microbatches), ctx.microbatch_size)
            for size in templates.sizes
            if count // size >= 1
        ]

    def _varuna_shapes(self, count: int) -> list[_Shape]:
        ctx = self.context
        partitions = varuna_partitions(ctx.profile)
        batch = ctx.global_batch_size
        shapes = []
        for depth in varuna_depths(len(partitions)):
            pipelines = min(count // depth, batch)  # at least one sample per replica
            if pipelines < 1:
                continue
            per_stage = len(partitions) // depth
            ranges = [(partitions[s * per_stage][0], partitions[(s + 1) * per_stage - 1][1]) for s in range(depth)]
            # Varuna's largest microbatch that fits: memory grows with the microbatch, so the first
            # fitting one from the top bounds them. Among those that divide the batch and give every
            # replica one, the fewest samples on the busiest replica (Varuna gives each B // D), then
            # the largest microbatch.
            sizes = [b for b in range(batch // pipelines, 0, -1) if batch % b == 0]
            largest = next((b for b in sizes if self._varuna_templates(ranges, b) is not None), None)
            if largest is None:
                continue
            microbatch = min(
                (b for b in sizes if b <= largest), key=lambda b: (b * math.ceil(batch // b / pipelines), -b)
            )
            templates = self._varuna_templates(ranges, microbatch)
            assert templates is not None
            shapes.append(self._timed(templates, depth, pipelines, microbatch))
        return shapes

    def _varuna_templates(self, ranges: list[tuple[int, int]], microbatch: int) -> TemplateSet | None:
        """A template set of the one equal-partition template at ``microbatch``, if it fits memory."""
        ctx = self.context
        cluster = ctx.cluster
        profile = scaled_profile(ctx.profile, microbatch)
        gpus = cluster.gpus_per_node
        stages = [StageSpec(start, end, node, 0, gpus) for node, (start, end) in enumerate(ranges)]
        template = make_template(profile, cluster, stages, ctx.reference_microbatches_per_stage)
        if max(template.stage_memory_bytes) > cluster.device_memory_bytes:
            return None
        return TemplateSet(
            min_nodes=len(ranges),
            max_nodes=len(ranges),
            templates={len(ranges): template},
            num_layers=profile.num_layers,
            gpus_per_node=gpus,
            layer_param_bytes=tuple(layer.param_bytes for layer in profile.layers),
            intra_node_bandwidth=cluster.intra_node_bandwidth,
            inter_node_bandwidth=cluster.inter_node_bandwidth,
        )

    def best_layout(self, nodes: Sequence[int]) -> Layout | None:
        """The fastest D x P layout on ``nodes`` by ``layout_rule`` (None if none fits)."""
        ordered = sorted(nodes)
        shape = self._shape(len(ordered))
        if shape is None:
            return None
        plan = self._plan(shape, ordered)
        micro = "" if shape.microbatch == self.context.microbatch_size else f", microbatch {shape.microbatch}"
        return Layout(
            plan=plan,
            iteration_s=plan.predicted_iteration_s,
            description=f"D={shape.pipelines} x P={shape.size}{micro}",
            standby=tuple(ordered[shape.pipelines * shape.size :]),
            state=(shape.pipelines, shape.size),
        )

    # ------------------------------------------------------------------ decisions
    def start(self, nodes: Sequence[int]) -> Decision:
        try:
            layout = self.best_layout(nodes)
        except PlanningError as error:  # the model fits on no number of nodes at all
            return Decision(Kind.STOP, reason=str(error), out_of_memory=True)
        if layout is None:
            if self.config.layout_rule == "varuna":
                return Decision(
                    Kind.STOP,
                    reason=f"no Varuna layout fits on {len(nodes)} nodes: at every pipeline depth P in "
                    f"{varuna_depths(len(varuna_partitions(self.context.profile)))} (divisors of the model's "
                    "partition count) a stage of one sample exceeds cluster.device_memory_gb; raise it, add "
                    "nodes, or set strategy.layout_rule=oobleck_templates",
                    out_of_memory=True,
                )
            return Decision(Kind.STOP, reason=f"no D x P layout fits on {len(nodes)} nodes")
        return Decision(Kind.START, layout)

    def on_change(self, state: RunState) -> Decision:
        layout = state.layout
        working = set(layout.nodes)
        if any(node in working for node in state.removed):
            return self.restart(state, "a working node was lost: roll back to the last checkpoint")
        idle = tuple(sorted(n for n in state.alive if n not in working))
        standing = Layout(layout.plan, layout.iteration_s, layout.description, standby=idle, state=layout.state)
        if state.joined and self.config.morph_on_join:
            candidate = self.best_layout(state.alive)
            if candidate is not None and candidate.iteration_s < layout.iteration_s:
                return Decision(
                    Kind.RESTART,
                    candidate,
                    rollback_to_step=state.step,
                    checkpoint_first=True,
                    reason=f"morph onto the joined nodes: {candidate.description}",
                )
        return Decision(Kind.CONTINUE, standing)

    def on_notice(self, state: RunState) -> Decision:
        """Checkpoint the next step boundary and restart without the nodes under notice (module docstring)."""
        leaving = sorted(set(state.leaving) & set(state.layout.nodes))
        if not leaving:
            return Decision(Kind.CONTINUE)  # only standbys leave
        layout = self.best_layout(state.staying)
        if layout is None:
            return Decision(Kind.CONTINUE, reason=f"no layout fits on the {len(state.staying)} nodes that stay")
        return Decision(
            Kind.RESTART,
            layout,
            rollback_to_step=state.step,
            checkpoint_first=True,
            reason=f"preemption notice for nodes {leaving}: checkpoint, then restart on {layout.description}",
        )
