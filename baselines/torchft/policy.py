"""torchft (PyTorch's fault-tolerance library) as an external peer: what the harness decides for it.

torchft keeps training through failures by itself: every replica group asks a *lighthouse* for a
quorum each step, all-reduces its gradients with the quorum's members over a reconfigurable
``ProcessGroupGloo``, and steps its optimizer only if ``Manager.should_commit()`` says every rank
of the group got through; a replica that joins (or fell behind) heals by receiving a live peer's
state. So the harness's decisions are few:

- ``start``: replica groups of ``nodes_per_replica`` nodes (one: the whole model on each node, as
  torchft's ``train_ddp.py``; more: the planner's template of that many nodes as a pipeline
  inside the group, torchft's HSDP-style use with the pipeline in place of FSDP), leftover nodes
  standing by; or ``STOP`` before launch when the model does not fit a group, the node count or
  the batch does not suit torchft's replicas;
- ``on_change``: ``CONTINUE``: the lighthouse forms a quorum without the lost replicas and joiners
  heal from a peer, with no help from the controller (which records a ``continue`` recovery: kill
  to next committed step); ``STOP`` when fewer than ``min_replicas`` groups are left. With groups
  of several nodes a joined node stands by (the harness cannot hand torchft a whole new group),
  and a group that lost a node is gone: its survivors leave (``baselines.torchft.worker``);
- ``services``: the lighthouse, started by the controller before any node and stopped with it
  (``baselines.torchft.service``).

Its settings, detection timeouts and shards: ``baselines.torchft.config``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from baselines.torchft.config import LOG_LEVELS, MB, TorchftConfig, require_torchft
from oobleck.errors import ConfigError, PlanningError
from oobleck.planning.inputs import GB
from oobleck.planning.instantiate import build_plan
from oobleck.planning.pipeline_cost import stage_memory_bytes
from oobleck.strategy import Decision, Kind, Layout, RunInfo, RunState, Strategy, StrategyConfig, StrategyContext

__all__ = ["Torchft", "TorchftConfig"]


class Torchft(Strategy):
    Config = TorchftConfig
    worker_module = "baselines.torchft.worker"
    config: TorchftConfig

    def __init__(self, config: StrategyConfig, context: StrategyContext) -> None:
        super().__init__(config, context)
        c = self.config
        if c.log_level not in LOG_LEVELS:
            raise ConfigError(f"strategy.log_level={c.log_level} must be one of {', '.join(LOG_LEVELS)}")
        require_torchft(c.log_level)
        positive = (
            "nodes_per_replica",
            "min_replicas",
            "quorum_tick_ms",
            "heartbeat_timeout_ms",
            "heartbeat_interval_ms",
            "timeout_s",
            "quorum_timeout_s",
            "connect_timeout_s",
            "pg_timeout_s",
        )
        for key in (*positive, "join_timeout_ms"):
            value = getattr(c, key)
            if value is None:
                continue
            if value < 0 or (value == 0 and key in positive):
                raise ConfigError(
                    f"strategy.{key}={value} must be {'> 0' if key in positive else '>= 0'}; see conf/strategy/torchft.yaml"
                )

    # ------------------------------------------------------------------ layouts
    def replicas_layout(self, nodes: Sequence[int]) -> Layout:
        """One pipeline of ``nodes_per_replica`` nodes per replica group; leftover nodes stand by."""
        ctx = self.context
        ordered = sorted(nodes)
        k = int(self.config.nodes_per_replica)
        groups = [tuple(ordered[i : i + k]) for i in range(0, len(ordered) - k + 1, k)]
        plan = build_plan(ctx.templates(0), [k] * len(groups), groups, ctx.global_batch_size, ctx.microbatch_size, 0)
        # state: the nodes lost so far (they stay in the plan; torchft needs no new one)
        return Layout(
            plan=plan,
            iteration_s=plan.predicted_iteration_s,
            description=f"torchft: {len(groups)} replica groups of {k} node{'s' if k > 1 else ''}",
            standby=tuple(ordered[len(groups) * k :]),
            state=(),
        )

    def start(self, nodes: Sequence[int]) -> Decision:
        ctx, c = self.context, self.config
        gpus = ctx.cluster.gpus_per_node
        if gpus != 1:
            return Decision(
                Kind.STOP,
                reason=f"strategy=torchft runs one worker per node; cluster.gpus_per_node={gpus} must be 1",
            )
        k = int(c.nodes_per_replica)
        replicas = len(nodes) // k
        if replicas < c.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{len(nodes)} nodes make {replicas} replica groups of strategy.nodes_per_replica={k}, fewer "
                f"than strategy.min_replicas={c.min_replicas}",
            )
        microbatches = ctx.num_microbatches
        batch = f"job.global_batch_size={ctx.global_batch_size} / job.microbatch_size={ctx.microbatch_size}"
        if c.async_quorum and microbatches % replicas:
            return Decision(
                Kind.STOP,
                reason=f"with strategy.async_quorum=true each of the {replicas} replica groups trains a fixed shard of "
                f"the step's {microbatches} microbatches ({batch}), which must divide evenly; make the microbatch "
                "count a multiple of the replica groups, or set strategy.async_quorum=false",
            )
        if replicas > microbatches:
            return Decision(
                Kind.STOP,
                reason=f"{replicas} replica groups would share {microbatches} microbatches per step ({batch}); "
                "raise job.global_batch_size or lower job.microbatch_size",
            )
        try:
            templates = ctx.templates(0)
        except PlanningError as error:  # fits on no number of nodes at all
            return Decision(Kind.STOP, reason=str(error), out_of_memory=True)
        if templates.min_nodes > k:
            return Decision(Kind.STOP, reason=self._does_not_fit(templates.min_nodes), out_of_memory=True)
        if k not in templates:
            return Decision(
                Kind.STOP,
                reason=f"the planner has no template of strategy.nodes_per_replica={k} nodes "
                f"(templates exist for {list(templates.sizes)}); choose one of those",
            )
        return Decision(Kind.START, self.replicas_layout(nodes))

    def _does_not_fit(self, n0: int) -> str:
        profile, cluster = self.context.profile, self.context.cluster
        k = int(self.config.nodes_per_replica)
        # The planner's memory model of the whole model as one stage on one device.
        need = stage_memory_bytes(profile, 0, profile.num_layers, 1, 0, 1)
        return (
            f"a torchft replica group of strategy.nodes_per_replica={k} node{'s' if k > 1 else ''} cannot hold "
            f"{profile.model}: it needs at least n0={n0} nodes (the planner's fewest; the whole model on one "
            f"device takes {need / MB:.1f} MB: training state at 16 bytes/parameter plus activations, and "
            f"cluster.device_memory_gb={cluster.device_memory_bytes / GB:g} gives {cluster.device_memory_bytes / MB:.1f} "
            f"MB per device); set strategy.nodes_per_replica={n0} (torchft's HSDP-style groups)"
        )

    def on_change(self, state: RunState) -> Decision:
        k = int(self.config.nodes_per_replica)
        alive, layout = set(state.alive), state.layout
        working = set(layout.nodes)
        # Replica groups left: the first plan's groups with every node alive, and with one-node
        # groups every joiner (each is a group of its own: it heals and trains). A joiner of a run
        # of larger groups stands by, as do nodes left over at the start.
        intact = sum(1 for p in layout.plan.pipelines if set(p.nodes) <= alive)
        newcomers = sorted(n for n in alive if n not in working)
        replicas = intact + (len(newcomers) if k == 1 else 0)
        if replicas < self.config.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{replicas} replica group(s) of strategy.nodes_per_replica={k} left, fewer than "
                f"strategy.min_replicas={self.config.min_replicas}: no quorum can form",
            )
        # The plan keeps every node torchft started on, so state.removed also lists nodes lost
        # earlier (and state.joined earlier joiners): the layout's state remembers which.
        lost_before = tuple(n for n in layout.state or () if n not in alive)  # a rejoined id is alive
        lost = tuple(n for n in state.removed if n not in lost_before and n not in layout.standby)
        reason = f"torchft: the lighthouse re-forms the quorum without nodes {list(lost)}" if lost else ""
        standby = tuple(newcomers) if k > 1 else ()
        if not lost and set(standby) - set(layout.standby):
            reason = f"nodes {sorted(set(standby) - set(layout.standby))} stand by: groups of {k} nodes take no joiners"
        return Decision(
            Kind.CONTINUE, replace(layout, state=tuple(sorted({*lost_before, *lost})), standby=standby), reason=reason
        )

    def services(self, run: RunInfo) -> contextlib.AbstractContextManager[dict[str, Any]]:
        from baselines.torchft.service import lighthouse_service

        return lighthouse_service(self.config, run)
