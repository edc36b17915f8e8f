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

Detection: torchft drops a replica from the quorum when the lighthouse has not heard its heartbeat
for ``heartbeat_timeout_ms``, and its gloo group fails a collective a hung peer never answers after
``pg_timeout_s``. Both default (null) to the run's ``cluster.heartbeat_timeout_s``, the timeout the
harness detects hung workers with, so a comparison uses one detection timeout; a value set here
overrides it and the run says so (``detection``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from oobleck.errors import ConfigError, PlanningError
from oobleck.planning.inputs import GB
from oobleck.planning.instantiate import build_plan
from oobleck.planning.pipeline_cost import stage_memory_bytes
from oobleck.strategy import Decision, Kind, Layout, RunInfo, RunState, Strategy, StrategyConfig, StrategyContext

TORCHFT_VERSION = "0.2.0"
MB = 1e6  # as oobleck.planning.inputs.GB = 1e9
LOG_LEVELS = ("error", "warn", "info", "debug")


def require_torchft(log_level: str = "warn") -> Any:
    """The torchft module, or one clear error naming the extra that installs it. ``log_level``
    quiets torchft's Rust side (read once, at its first import) and its Python loggers."""
    import logging
    import os

    os.environ.setdefault("RUST_LOG", log_level)
    logging.getLogger("torchft").setLevel(log_level.upper())
    try:
        import torchft
    except ImportError as error:
        raise ConfigError(
            f"strategy=torchft needs the torchft package ({error}); install the peers extra: "
            f"pip install -e '.[peers]' (torchft=={TORCHFT_VERSION})"
        ) from None
    return torchft


@dataclass
class TorchftConfig(StrategyConfig):
    """torchft's knobs (conf/strategy/torchft.yaml says where each default comes from)."""

    _target_: str = "baselines.torchft.policy.Torchft"
    name: str = "torchft"
    checkpoint_every_steps: int = 0  # torchft heals from live peers, not from checkpoints
    # true (the Manager's default): the quorum overlaps the forward pass and each replica group
    # trains its own fixed shard of the step's batch; false: the quorum first, then the batch is
    # split over its members (every committed update trains the whole batch).
    async_quorum: bool = True
    nodes_per_replica: int = 1  # nodes of one replica group (a pipeline of that many stages)
    min_replicas: int = 1  # lighthouse min_replicas and Manager min_replica_size
    join_timeout_ms: int = 10000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int | None = None  # null: cluster.heartbeat_timeout_s
    heartbeat_interval_ms: int = 100
    timeout_s: float = 30.0  # Manager: should_commit, state transfer, futures
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 60.0
    pg_timeout_s: float | None = None  # ProcessGroupGloo operations; null: cluster.heartbeat_timeout_s
    log_level: str = "error"  # torchft's own logs: error | warn | info | debug
    # false: like torchft's training loops, a step that did not commit drops its batch (the data
    # loader moves on); true: the batch is trained again, as the harness's own strategies do.
    redo_uncommitted_batches: bool = False


@dataclass(frozen=True)
class Detection:
    """The timeouts that decide how fast torchft notices a lost or hung replica."""

    heartbeat_timeout_ms: int  # the lighthouse drops a replica this long silent
    pg_timeout_s: float  # a collective a peer never answers fails after this
    overrides: tuple[str, ...] = ()  # strategy keys set apart from cluster.heartbeat_timeout_s

    def describe(self, cluster_timeout_s: float) -> str:
        if not self.overrides:
            return f"cluster.heartbeat_timeout_s={cluster_timeout_s:g} (the harness's own detection timeout)"
        return (
            f"strategy override ({', '.join(self.overrides)}) of cluster.heartbeat_timeout_s={cluster_timeout_s:g}: "
            "torchft and the harness detect hung nodes with different timeouts"
        )

    def to_dict(self, cluster_timeout_s: float) -> dict[str, Any]:
        return {
            "heartbeat_timeout_s": self.heartbeat_timeout_ms / 1000,
            "pg_timeout_s": self.pg_timeout_s,
            "cluster_heartbeat_timeout_s": cluster_timeout_s,
            "overrides": list(self.overrides),
            "source": self.describe(cluster_timeout_s),
        }


def detection(config: TorchftConfig, cluster_heartbeat_timeout_s: float) -> Detection:
    """torchft's detection timeouts: the run's heartbeat timeout unless the strategy overrides them."""
    overrides = tuple(
        f"strategy.{key}={getattr(config, key)}"
        for key in ("heartbeat_timeout_ms", "pg_timeout_s")
        if getattr(config, key) is not None
    )
    return Detection(
        heartbeat_timeout_ms=int(config.heartbeat_timeout_ms)
        if config.heartbeat_timeout_ms is not None
        else round(float(cluster_heartbeat_timeout_s) * 1000),
        pg_timeout_s=float(config.pg_timeout_s)
        if config.pg_timeout_s is not None
        else float(cluster_heartbeat_timeout_s),
        overrides=overrides,
    )


def run_detection(config: TorchftConfig, run_config: Mapping[str, Any]) -> tuple[Detection, float]:
    """``detection`` of a run's resolved config, with the cluster timeout it derives from."""
    cluster_timeout_s = float((run_config.get("cluster") or {}).get("heartbeat_timeout_s"))
    return detection(config, cluster_timeout_s), cluster_timeout_s


def replica_shards(microbatches: int, shards: int, shard: int) -> range:
    """The microbatches of fixed shard ``shard`` of ``shards`` (async quorum: a replica group's own)."""
    per = microbatches // shards
    return range(shard * per, (shard + 1) * per)


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
        alive = len(state.alive)
        if alive // k < self.config.min_replicas:
            return Decision(
                Kind.STOP,
                reason=f"{alive} live node(s) hold fewer than strategy.min_replicas={self.config.min_replicas} "
                "replica groups: no quorum can form",
            )
        # The plan keeps every node torchft started on, so state.removed also lists nodes lost
        # earlier (and state.joined earlier joiners): the layout's state remembers which.
        lost_before = tuple(n for n in state.layout.state or () if n not in state.alive)  # a rejoined id is alive
        lost = tuple(n for n in state.removed if n not in lost_before and n not in state.layout.standby)
        reason = f"torchft: the lighthouse re-forms the quorum without nodes {list(lost)}" if lost else ""
        working = set(state.layout.nodes)
        # One-node groups: a joiner is a replica group of its own (it heals and trains). Larger ones:
        # it stands by, as do nodes left over at the start.
        standby = tuple(sorted(n for n in state.alive if n not in working)) if k > 1 else ()
        standby = tuple(n for n in standby if n in state.alive)
        layout = replace(state.layout, state=tuple(sorted({*lost_before, *lost})), standby=standby)
        if not lost and set(standby) - set(state.layout.standby):
            reason = f"nodes {sorted(set(standby) - set(state.layout.standby))} stand by: groups of {k} nodes take no joiners"
        return Decision(Kind.CONTINUE, layout, reason=reason)

    def services(self, run: RunInfo) -> contextlib.AbstractContextManager[dict[str, Any]]:
        from baselines.torchft.service import lighthouse_service

        return lighthouse_service(self.config, run)
