"""torchft's settings and what follows from them, shared by the policy, the lighthouse service and
the worker (so that none of them imports another to read them): the typed ``TorchftConfig``, the
import of torchft itself, the detection timeouts and the replica groups' fixed shards.

Detection: torchft drops a replica from the quorum when the lighthouse has not heard its heartbeat
for ``heartbeat_timeout_ms``, and its gloo group fails a collective a hung peer never answers after
``pg_timeout_s``. Both default (null) to the run's ``cluster.heartbeat_timeout_s``, the timeout the
harness detects hung workers with, so a comparison uses one detection timeout; a value set here
overrides it and the run says so (``Detection``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oobleck.errors import ConfigError
from oobleck.strategy import StrategyConfig

TORCHFT_VERSION = "0.2.0"
MB = 1e6  # as oobleck.planning.inputs.GB = 1e9
LOG_LEVELS = ("error", "warn", "info", "debug")
DEPLOYMENTS = ("harness", "torchft")


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
    # Nodes of one replica group (a pipeline of that many stages), "min": the planner's fewest
    # nodes that hold the model (n0), or "fastest": the template size whose groups train the most
    # samples per second; resolved by the policy (the simulator only: the worker reads a number,
    # so a real run is refused with the size named).
    nodes_per_replica: Any = 1
    # harness: what the harness's runtime runs (equal fixed shards; joiners of multi-node groups
    # stand by). torchft: what torchft's own deployment does, for the simulator only (see
    # conf/strategy/torchft.yaml and baselines.torchft.policy).
    deployment: str = "harness"
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
    cluster_timeout_s = float((run_config.get("cluster") or {})["heartbeat_timeout_s"])
    return detection(config, cluster_timeout_s), cluster_timeout_s


def replica_shards(microbatches: int, shards: int, shard: int) -> range:
    """The microbatches of fixed shard ``shard`` of ``shards`` (async quorum: a replica group's own)."""
    per = microbatches // shards
    return range(shard * per, (shard + 1) * per)
