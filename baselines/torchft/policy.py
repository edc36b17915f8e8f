"""torchft (PyTorch's fault-tolerance library) as an external peer: what the harness decides for it.

torchft keeps training through failures by itself: every replica group asks a *lighthouse* for a
quorum each step, all-reduces its gradients with the quorum's members over a reconfigurable
``ProcessGroupGloo``, and steps its optimizer only if ``Manager.should_commit()`` says every rank
of the group got through; a replica that joins (or fell behind) heals by receiving a live peer's
state. So the harness's decisions are few:

- ``start``: replica groups of ``nodes_per_replica`` nodes (one: the whole model on each node, as
  torchft's ``train_ddp.py``; more: the planner's template of that many nodes as a pipeline
  inside the group, torchft's HSDP-style use with the pipeline in place of FSDP; ``min``: the
  planner's fewest nodes that hold the model, n0, the most groups a torchft user gets), leftover
  nodes standing by; or ``STOP`` before launch when the model does not fit a group, the node
  count or the batch does not suit torchft's replicas;
- ``on_change``: ``CONTINUE``: the lighthouse forms a quorum without the lost replicas and joiners
  heal from a peer, with no help from the controller (which records a ``continue`` recovery: kill
  to next committed step); ``STOP`` when fewer than ``min_replicas`` groups are left. A group
  that lost a node is gone: its survivors leave (``baselines.torchft.worker``);
- ``services``: the lighthouse, started by the controller before any node and stopped with it
  (``baselines.torchft.service``).

The layout (``TorchftLayout``) keeps the plan torchft started on (its workers never get another:
the real runtime requires a ``continue`` to keep it) and names the replica groups that train now,
each with its fixed shard of the batch (asynchronous quorum): its ``nodes`` are the nodes of those
groups, its ``samples_per_iteration`` the samples they train per step (a lost group's shard is
skipped, as the worker reports in ``metrics.csv``) and its ``iteration_s`` the planner's time of
that many groups, so the simulator counts what torchft trains, not the whole batch.

Where the simulator and the harness's runtime differ (``strategy.deployment``):

- ``harness`` (the default; what ``baselines.torchft.worker`` runs): the batch is cut into one
  equal fixed shard per replica group of the first plan (``config.replica_shards``), so an
  asynchronous quorum needs the microbatch count to divide by the groups; a node that joins a run
  of multi-node groups stands by (the harness cannot hand torchft a whole new group), and the
  survivors of a broken group leave;
- ``torchft`` (the simulator only; ``services`` refuses it for a real run): what torchft's own
  deployment does. Its ``DistributedSampler`` (``torchft/data.py``) gives every replica group its
  own shard of the data and each group its own batch size, built for the most groups the job
  will have (``NUM_REPLICA_GROUPS`` in ``train_ddp.py``): here the step's microbatches are cut
  into as many shards as the cluster's most nodes make groups, differing by at most one
  microbatch (nothing has to divide), and a group trains its shard; and a scheduler that has
  ``nodes_per_replica`` free nodes (a broken group's survivors, joiners) launches a new replica
  group on them, which heals from a live peer (torchx/Slurm relaunching the group's job; the
  harness's runtime has no such launcher).

Its settings, detection timeouts and shards: ``baselines.torchft.config``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from baselines.torchft.config import DEPLOYMENTS, LOG_LEVELS, MB, TorchftConfig, require_torchft
from oobleck.errors import ConfigError, PlanningError
from oobleck.planning.inputs import GB
from oobleck.planning.instantiate import build_plan
from oobleck.planning.pipeline_cost import stage_memory_bytes
from oobleck.strategy import Decision, Kind, Layout, RunInfo, RunState, Strategy, StrategyConfig, StrategyContext

__all__ = ["Group", "Torchft", "TorchftConfig", "TorchftLayout", "shard_sizes"]

# Values of nodes_per_replica the policy resolves (the simulator only: the worker reads a number).
NAMED_SIZES = ("min", "fastest")


@dataclass(frozen=True)
class Group:
    """A replica group: its nodes (the pipeline's stages in order) and the fixed shard of the step's
    batch it trains (asynchronous quorum; None: the synchronous quorum splits the batch)."""

    nodes: tuple[int, ...]
    shard: int | None = None


@dataclass(frozen=True)
class TorchftLayout(Layout):
    """torchft's layout: the first plan and the replica groups that train now (module docstring)."""

    groups: tuple[Group, ...] = ()
    # Microbatches of each fixed shard (asynchronous quorum); empty: the synchronous quorum, which
    # trains the whole batch over whatever groups take part.
    shards: tuple[int, ...] = ()
    microbatch_size: int = 1
    lost: tuple[int, ...] = ()  # nodes of replica groups lost so far

    @property
    def nodes(self) -> tuple[int, ...]:
        """Nodes doing work: those of the replica groups that train now."""
        return tuple(sorted(n for group in self.groups for n in group.nodes))

    @property
    def samples_per_iteration(self) -> int:
        """Samples trained per step: every shard some group trains (once however many train it)."""
        if not self.shards:
            return self.plan.global_batch_size
        trained = {g.shard for g in self.groups if g.shard is not None}
        return sum(self.shards[s] for s in trained) * self.microbatch_size


def shard_sizes(microbatches: int, shards: int, equal: bool) -> tuple[int, ...]:
    """Microbatches of each of ``shards`` fixed shards: equal (the harness's worker), or differing
    by at most one (torchft's ``DistributedSampler``, whose groups each set their own batch)."""
    if equal:
        return (microbatches // shards,) * shards
    return tuple((i + 1) * microbatches // shards - i * microbatches // shards for i in range(shards))


class Torchft(Strategy):
    Config = TorchftConfig
    worker_module = "baselines.torchft.worker"
    config: TorchftConfig

    def __init__(self, config: StrategyConfig, context: StrategyContext) -> None:
        super().__init__(config, context)
        c = self.config
        if c.log_level not in LOG_LEVELS:
            raise ConfigError(f"strategy.log_level={c.log_level} must be one of {', '.join(LOG_LEVELS)}")
        if c.deployment not in DEPLOYMENTS:
            raise ConfigError(
                f"strategy.deployment={c.deployment} must be one of {', '.join(DEPLOYMENTS)}; "
                "see conf/strategy/torchft.yaml"
            )
        k = c.nodes_per_replica
        if k not in NAMED_SIZES and (isinstance(k, bool) or not isinstance(k, int)):
            raise ConfigError(
                f"strategy.nodes_per_replica={k!r} must be a number of nodes, min (the planner's fewest nodes "
                "that hold the model) or fastest (the group size that trains the most samples per second); "
                "see conf/strategy/torchft.yaml"
            )
        require_torchft(c.log_level)
        positive: tuple[str, ...] = (
            "min_replicas",
            "quorum_tick_ms",
            "heartbeat_timeout_ms",
            "heartbeat_interval_ms",
            "timeout_s",
            "quorum_timeout_s",
            "connect_timeout_s",
            "pg_timeout_s",
        )
        if k not in NAMED_SIZES:
            positive = ("nodes_per_replica", *positive)
        for key in (*positive, "join_timeout_ms"):
            value = getattr(c, key)
            if value is None:
                continue
            if value < 0 or (value == 0 and key in positive):
                raise ConfigError(
                    f"strategy.{key}={value} must be {'> 0' if key in positive else '>= 0'}; see conf/strategy/torchft.yaml"
                )
        # Predicted step of (groups, microbatches per group): the planner's time of that many
        # groups, each a pipeline of the same template (every layout of a run shares them).
        self._steps: dict[tuple[int, int], float] = {}

    # ------------------------------------------------------------------ layouts
    def group_nodes(self, nodes: Sequence[int] | None = None) -> int:
        """Nodes per replica group: ``strategy.nodes_per_replica``, ``min`` as the planner's n0,
        ``fastest`` as the group size whose start on ``nodes`` (default: the cluster's most)
        trains the most samples per second."""
        k = self.config.nodes_per_replica
        if k == "fastest":
            decision = self.start(nodes if nodes is not None else range(self.context.cluster.nodes))
            if decision.layout is not None:
                return len(decision.layout.plan.pipelines[0].nodes)
            k = "min"
        return int(self.context.templates(0).min_nodes) if k == "min" else int(k)

    def _step_s(self, groups: Sequence[Group], per_group: int) -> float:
        """The planner's iteration of ``groups`` each training ``per_group`` microbatches (the
        slowest pipeline, then the reduction over the groups: ``plan_iteration_time``)."""
        key = (len(groups), per_group)
        if key not in self._steps:
            ctx = self.context
            sizes = [len(g.nodes) for g in groups]
            batch = per_group * len(groups) * ctx.microbatch_size
            plan = build_plan(ctx.templates(0), sizes, [g.nodes for g in groups], batch, ctx.microbatch_size, 0)
            self._steps[key] = plan.predicted_iteration_s
        return self._steps[key]

    def _layout(self, base: TorchftLayout, groups: Sequence[Group], **changes: Any) -> TorchftLayout:
        """``base`` with ``groups`` training: its step time, samples and description follow them."""
        shards, k = base.shards, len(base.plan.pipelines[0].nodes)
        if shards:
            per_group = max(shards[g.shard] for g in groups if g.shard is not None)
        else:
            per_group = -(-self.context.num_microbatches // len(groups))  # the batch split over the groups
        description = f"torchft: {len(groups)} replica groups of {k} node{'s' if k > 1 else ''}"
        if shards and len({g.shard for g in groups}) < len(shards):
            description += f" ({len({g.shard for g in groups})} of {len(shards)} shards trained)"
        return replace(
            base, groups=tuple(groups), iteration_s=self._step_s(groups, per_group), description=description, **changes
        )

    def replicas_layout(self, nodes: Sequence[int], k: int, shards: tuple[int, ...] = ()) -> TorchftLayout:
        """One pipeline of ``k`` nodes per replica group, group i on shard i of ``shards`` (none:
        the synchronous quorum); leftover nodes stand by."""
        ctx = self.context
        ordered = sorted(nodes)
        members = [tuple(ordered[i : i + k]) for i in range(0, len(ordered) - k + 1, k)]
        plan = build_plan(ctx.templates(0), [k] * len(members), members, ctx.global_batch_size, ctx.microbatch_size, 0)
        groups = [Group(m, i if shards else None) for i, m in enumerate(members)]
        base = TorchftLayout(
            plan=plan,
            iteration_s=plan.predicted_iteration_s,
            description="",
            standby=tuple(ordered[len(members) * k :]),
            shards=shards,
            microbatch_size=ctx.microbatch_size,
        )
        return self._layout(base, groups)

    def start(self, nodes: Sequence[int]) -> Decision:
        if self.config.nodes_per_replica != "fastest":
            return self._start(nodes, None)
        # Every group size the planner has a template for (n0 and up): the one that trains the
        # most samples per second on these nodes, as Varuna's layout is the planner's fastest.
        try:
            sizes = self.context.templates(0).sizes
        except PlanningError:
            return self._start(nodes, None)
        starts = [self._start(nodes, k) for k in sizes if k <= len(nodes)]
        running = [(d, d.layout) for d in starts if d.layout is not None]
        if not running:
            return self._start(nodes, None)
        return max(running, key=lambda pair: (pair[1].samples_per_s, -len(pair[1].plan.pipelines[0].nodes)))[0]

    def _start(self, nodes: Sequence[int], size: int | None) -> Decision:
        """The start on groups of ``size`` nodes (None: ``group_nodes()``, fastest read as min)."""
        ctx, c = self.context, self.config
        gpus = ctx.cluster.gpus_per_node
        if gpus != 1:
            return Decision(
                Kind.STOP,
                reason=f"strategy=torchft runs one worker per node; cluster.gpus_per_node={gpus} must be 1",
            )
        try:
            templates = ctx.templates(0)
        except PlanningError as error:  # fits on no number of nodes at all
            return Decision(Kind.STOP, reason=str(error), out_of_memory=True)
        k = (
            size
            if size is not None
            else int(templates.min_nodes)
            if c.nodes_per_replica == "fastest"
            else self.group_nodes()
        )
        replicas = len(nodes) // k
        if replicas < c.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{len(nodes)} nodes make {replicas} replica groups of strategy.nodes_per_replica={k}, fewer "
                f"than strategy.min_replicas={c.min_replicas}",
            )
        microbatches = ctx.num_microbatches
        batch = f"job.global_batch_size={ctx.global_batch_size} / job.microbatch_size={ctx.microbatch_size}"
        harness = c.deployment == "harness"
        # Asynchronous quorum: the harness cuts one shard per group of the first plan; torchft's
        # sampler is built for the most groups the job can have (the cluster's most nodes).
        shards = 0
        if c.async_quorum:
            shards = replicas if harness else max(replicas, ctx.cluster.nodes // k)
        if harness and shards and microbatches % shards:
            return Decision(
                Kind.STOP,
                reason=f"with strategy.async_quorum=true each of the {replicas} replica groups trains a fixed shard of "
                f"the step's {microbatches} microbatches ({batch}), which must divide evenly; make the microbatch "
                "count a multiple of the replica groups, or set strategy.async_quorum=false",
            )
        if max(replicas, shards) > microbatches:
            return Decision(
                Kind.STOP,
                reason=f"{max(replicas, shards)} replica groups would share {microbatches} microbatches per step "
                f"({batch}); raise job.global_batch_size or lower job.microbatch_size",
            )
        if templates.min_nodes > k:
            return Decision(Kind.STOP, reason=self._does_not_fit(templates.min_nodes, k), out_of_memory=True)
        if k not in templates:
            return Decision(
                Kind.STOP,
                reason=f"the planner has no template of strategy.nodes_per_replica={k} nodes "
                f"(templates exist for {list(templates.sizes)}); choose one of those",
            )
        sizes = shard_sizes(microbatches, shards, equal=harness) if shards else ()
        return Decision(Kind.START, self.replicas_layout(nodes, k, sizes))

    def _does_not_fit(self, n0: int, k: int) -> str:
        profile, cluster = self.context.profile, self.context.cluster
        # The planner's memory model of the whole model as one stage on one device.
        need = stage_memory_bytes(profile, 0, profile.num_layers, 1, 0, 1)
        return (
            f"a torchft replica group of strategy.nodes_per_replica={k} node{'s' if k > 1 else ''} cannot hold "
            f"{profile.model}: it needs at least n0={n0} nodes (the planner's fewest; the whole model on one "
            f"device takes {need / MB:.1f} MB: training state at 16 bytes/parameter plus activations, and "
            f"cluster.device_memory_gb={cluster.device_memory_bytes / GB:g} gives {cluster.device_memory_bytes / MB:.1f} "
            f"MB per device); set strategy.nodes_per_replica={n0} (torchft's HSDP-style groups) or min"
        )

    def on_change(self, state: RunState) -> Decision:
        layout = state.layout
        if not isinstance(layout, TorchftLayout):
            raise TypeError(f"strategy=torchft decides on its own layouts, not {type(layout).__name__}")
        c, k = self.config, len(layout.plan.pipelines[0].nodes)
        alive = set(state.alive)
        kept = [g for g in layout.groups if set(g.nodes) <= alive]
        lost = tuple(sorted({n for g in layout.groups for n in g.nodes} - alive))
        relaunch = c.deployment == "torchft"
        # New replica groups: with one-node groups every joiner is one (it heals and trains, in the
        # harness too); with larger groups only where a scheduler launches them (deployment=torchft).
        # A broken group's survivors leave the harness's run; under torchft's they are free nodes.
        working = {n for g in kept for n in g.nodes}
        pool = sorted(alive - working - (set() if relaunch else set(layout.plan.nodes)))
        added: list[Group] = []
        while (k == 1 or relaunch) and len(pool) >= k:
            room, shard = self._free_shard(layout, [*kept, *added], pool[0])
            if not room:
                break
            added.append(Group(tuple(pool[:k]), shard))
            pool = pool[k:]
        groups = [*kept, *added]
        if len(groups) < c.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{len(groups)} replica group(s) of strategy.nodes_per_replica={k} left, fewer than "
                f"strategy.min_replicas={c.min_replicas}: no quorum can form",
            )
        standby = tuple(pool) if (k > 1 or relaunch) else ()
        reason = f"torchft: the lighthouse re-forms the quorum without nodes {list(lost)}" if lost else ""
        if relaunch and added:
            reason += "; " if reason else "torchft: "
            reason += f"new replica group(s) {[list(g.nodes) for g in added]} heal from a live peer"
        elif not lost and set(standby) - set(layout.standby):
            reason = f"nodes {sorted(set(standby) - set(layout.standby))} stand by: groups of {k} nodes take no joiners"
        if not lost and not added and tuple(groups) == layout.groups:
            return Decision(Kind.CONTINUE, replace(layout, standby=standby), reason=reason)
        changed = self._layout(layout, groups, standby=standby, lost=tuple(sorted({*layout.lost, *lost})))
        return Decision(Kind.CONTINUE, changed, reason=reason)

    def _free_shard(self, layout: TorchftLayout, groups: Sequence[Group], node: int) -> tuple[bool, int | None]:
        """Whether a new group (first node ``node``) has room, and the shard it takes: the lowest no
        group trains (``groups.vacant_shard``); with none vacant, the harness's joiner trains the
        shard of its node's number (a duplicate, which adds no samples) and torchft's scheduler
        launches no group. None: the synchronous quorum (room while every group gets a microbatch)."""
        if not layout.shards:
            return len(groups) < self.context.num_microbatches, None
        taken = {g.shard for g in groups}
        vacant = [s for s in range(len(layout.shards)) if s not in taken]
        if vacant:
            return True, vacant[0]
        return self.config.deployment != "torchft", node % len(layout.shards)

    def services(self, run: RunInfo) -> contextlib.AbstractContextManager[dict[str, Any]]:
        from baselines.torchft.service import lighthouse_service

        self.refuse_simulated_settings()
        return lighthouse_service(self.config, run)

    def refuse_simulated_settings(self) -> None:
        """A real run refuses what only the simulator models (module docstring): the worker reads
        ``nodes_per_replica`` as a number and runs the harness's deployment."""
        c = self.config
        if c.deployment != "harness":
            raise ConfigError(
                f"strategy.deployment={c.deployment} (torchft's own sampler shards and a scheduler relaunching "
                "replica groups) is modelled by the simulator only; a real run takes strategy.deployment=harness"
            )
        if c.nodes_per_replica in NAMED_SIZES:
            try:
                n0 = f"={self.group_nodes()}"
            except PlanningError:
                n0 = " to a number"
            raise ConfigError(
                f"strategy.nodes_per_replica={c.nodes_per_replica} is resolved by the simulator only (the torchft "
                f"worker reads a number); set strategy.nodes_per_replica{n0}"
            )
