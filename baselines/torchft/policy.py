"""torchft (PyTorch's fault-tolerance library) as an external peer: what the harness decides for it.

torchft keeps training through failures by itself: every replica group (here: one per node, the
whole model on its one device) asks a *lighthouse* for a quorum before each step, all-reduces its
gradients with the quorum's members over a reconfigurable ``ProcessGroupGloo``, and steps its
optimizer only if ``Manager.should_commit()`` says every rank of the group got through; a replica
that joins (or fell behind) heals by receiving a live peer's state. So the harness's decisions are
few:

- ``start``: D one-stage pipelines, one per node (data parallelism, like Varuna's D x 1), or
  ``STOP`` before launch when the model does not fit one node (the planner's n0 > 1) or the node
  count does not suit torchft's replicas;
- ``on_change``: ``CONTINUE``: the lighthouse forms a quorum without the lost replicas and
  joiners heal from a peer, with no help from the controller (which records a ``continue``
  recovery: kill to next committed step); ``STOP`` when fewer than ``min_replicas`` are left;
- ``services``: the lighthouse, started by the controller before any node and stopped with it
  (``baselines.torchft.service``).

The worker that runs torchft's real ``Manager`` is ``baselines.torchft.worker``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from baselines.torchft.service import lighthouse_service, require_torchft
from oobleck.errors import ConfigError, PlanningError
from oobleck.planning.inputs import GB
from oobleck.planning.instantiate import build_plan
from oobleck.planning.pipeline_cost import stage_memory_bytes
from oobleck.strategy import Decision, Kind, Layout, RunInfo, RunState, Strategy, StrategyConfig, StrategyContext

MB = 1e6  # as oobleck.planning.inputs.GB = 1e9


@dataclass
class TorchftConfig(StrategyConfig):
    """torchft's knobs (conf/strategy/torchft.yaml says where each default comes from)."""

    _target_: str = "baselines.torchft.policy.Torchft"
    name: str = "torchft"
    checkpoint_every_steps: int = 0  # torchft heals from live peers, not from checkpoints
    min_replicas: int = 1  # lighthouse min_replicas and Manager min_replica_size
    join_timeout_ms: int = 10000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000
    heartbeat_interval_ms: int = 100
    timeout_s: float = 30.0  # Manager: collectives, should_commit, state transfer
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 60.0
    pg_timeout_s: float = 5.0  # ProcessGroupGloo operations
    log_level: str = "error"  # torchft's own logs: error | warn | info | debug
    # false: like torchft's training loops, a step that did not commit drops its batch (the data
    # loader moves on); true: the batch is trained again, as the harness's own strategies do.
    redo_uncommitted_batches: bool = False


class Torchft(Strategy):
    Config = TorchftConfig
    worker_module = "baselines.torchft.worker"
    config: TorchftConfig

    def __init__(self, config: StrategyConfig, context: StrategyContext) -> None:
        super().__init__(config, context)
        if self.config.log_level not in ("error", "warn", "info", "debug"):
            raise ConfigError(f"strategy.log_level={self.config.log_level} must be one of error, warn, info, debug")
        require_torchft(self.config.log_level)
        positive = (
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
            value = getattr(config, key)
            if value < 0 or (value == 0 and key in positive):
                raise ConfigError(
                    f"strategy.{key}={value} must be {'> 0' if key in positive else '>= 0'}; see conf/strategy/torchft.yaml"
                )

    def replicas_layout(self, nodes: Sequence[int]) -> Layout:
        """One single-node, single-stage pipeline per node: each node is one torchft replica group."""
        ctx = self.context
        ordered = sorted(nodes)
        plan = build_plan(
            ctx.templates(0), [1] * len(ordered), [(n,) for n in ordered], ctx.global_batch_size, ctx.microbatch_size, 0
        )
        # state: the nodes lost so far (they stay in the plan; torchft needs no new one)
        return Layout(
            plan=plan,
            iteration_s=plan.predicted_iteration_s,
            description=f"torchft: {len(ordered)} replica groups of 1 node",
            state=(),
        )

    def start(self, nodes: Sequence[int]) -> Decision:
        ctx = self.context
        gpus = ctx.cluster.gpus_per_node
        if gpus != 1:
            return Decision(
                Kind.STOP,
                reason=f"strategy=torchft runs one replica group of one worker per node; cluster.gpus_per_node={gpus} must be 1",
            )
        if len(nodes) < self.config.min_replicas:
            return Decision(
                Kind.STOP, reason=f"{len(nodes)} nodes are fewer than strategy.min_replicas={self.config.min_replicas}"
            )
        if len(nodes) > ctx.num_microbatches:
            return Decision(
                Kind.STOP,
                reason=f"{len(nodes)} replicas would share {ctx.num_microbatches} microbatches per step "
                f"(job.global_batch_size={ctx.global_batch_size} / job.microbatch_size={ctx.microbatch_size}); "
                "raise job.global_batch_size or lower job.microbatch_size",
            )
        try:
            templates = ctx.templates(0)
        except PlanningError as error:  # fits on no number of nodes at all
            return Decision(Kind.STOP, reason=str(error), out_of_memory=True)
        if templates.min_nodes > 1:
            return Decision(Kind.STOP, reason=self._does_not_fit(templates.min_nodes), out_of_memory=True)
        return Decision(Kind.START, self.replicas_layout(nodes))

    def _does_not_fit(self, n0: int) -> str:
        profile, cluster = self.context.profile, self.context.cluster
        # The planner's memory model of the whole model as one stage on one device.
        need = stage_memory_bytes(profile, 0, profile.num_layers, 1, 0, 1)
        return (
            f"torchft replicates the whole model on every node, but {profile.model} needs at least n0={n0} nodes "
            f"(the planner's fewest): one replica takes {need / MB:.1f} MB (training state at 16 bytes/parameter "
            f"plus activations) and cluster.device_memory_gb={cluster.device_memory_bytes / GB:g} gives "
            f"{cluster.device_memory_bytes / MB:.1f} MB per device; pipelines that split it across nodes can run it "
            "(strategy=oobleck)"
        )

    def on_change(self, state: RunState) -> Decision:
        alive = len(state.alive)
        if alive < self.config.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{alive} live replica group(s), fewer than strategy.min_replicas={self.config.min_replicas}: no quorum can form",
            )
        # The plan keeps every node torchft started on, so state.removed also lists nodes lost
        # earlier (and state.joined earlier joiners): the layout's state remembers which.
        lost_before = tuple(n for n in state.layout.state or () if n not in state.alive)  # a rejoined id is alive
        lost = tuple(n for n in state.removed if n not in lost_before)
        reason = f"torchft: the lighthouse re-forms the quorum without nodes {list(lost)}" if lost else ""
        layout = replace(state.layout, state=tuple(sorted({*lost_before, *lost})))
        return Decision(Kind.CONTINUE, layout, reason=reason)

    def services(self, run: RunInfo) -> contextlib.AbstractContextManager[dict[str, Any]]:
        return lighthouse_service(self.config, run)
