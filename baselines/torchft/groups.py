"""Replica groups and their shards, for the torchft worker: who trains which part of the batch, where
a group's store is, and when a group of several nodes has lost one of them.

- Shards (``strategy.async_quorum=true``): the step's microbatches are cut into as many fixed shards
  as the run started with replica groups, and each group trains its own, as torchft's examples
  give each replica group its own ``DistributedSampler`` shard (``train_ddp.py``). A group's shard
  is its index in the first plan. A joined node is a new replica group: it takes the lowest shard
  nobody trained in the last committed step (it learns which from the state it heals with), and
  when two replicas end up on one shard (two joiners at once), the commit that shows it moves the
  later one to the lowest shard left vacant (``resolve_shards``); every replica computes the same
  answer from the same all-reduced rows, so no other coordination is needed.
- A group has one TCPStore, hosted by its first node (torchft's Manager keeps its server address
  there, and a group of several its pipeline rendezvous); for a group of several the host
  publishes its address in the run's store (in the run's key space). Each node's Manager is
  built as torchft's ``train_ddp.py`` builds it (``make_manager``).
- ``PeerWatch``: a node of a group watches its peers' heartbeats (``oobleck.runtime.liveness``); one
  silent for ``cluster.heartbeat_timeout_s`` means the group is broken (torchft would have its
  scheduler restart the whole group), so the node leaves even while blocked in one of torchft's
  calls that waits on that peer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from baselines.torchft.config import TorchftConfig
from oobleck.runtime import keys
from oobleck.runtime.store_client import make_store


def group_store_key(group: int) -> str:
    """Where a replica group's first node publishes its store's address."""
    return f"torchft/group/{group}/store"


def host_group_store(addr: str) -> tuple[dist.TCPStore, socket.socket]:
    """A TCPStore for this replica group, listening on ``addr`` only (a free port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((addr, 0))
    listener.listen(64)
    store = dist.TCPStore(
        addr,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        use_libuv=True,
    )
    return store, listener


def read_group_store(store: Any, group: int, timeout_s: float) -> tuple[str, int]:
    """The address the group's first node published (bounded by ``timeout_s``; ``store`` is in the
    run's key space, so only the run can have written it)."""
    key = group_store_key(group)
    store.wait([key], timedelta(seconds=timeout_s))
    host, _, port = store.get(key).decode().rpartition(":")
    return host, int(port)


def group_store(
    store: Any, group: int | None, rank: int, size: int, advertised: str, timeout_s: float
) -> tuple[Any, socket.socket | None, str, int]:
    """This node's handle on its replica group's TCPStore (the group's first node hosts it and, for a
    group of several, publishes where): (store, listener or None, host, port)."""
    if rank == 0:
        hosted, listener = host_group_store(advertised)
        if size > 1:
            assert group is not None  # a group of several nodes is named
            store.set(group_store_key(group), f"{advertised}:{hosted.port}")
        return hosted, listener, advertised, hosted.port
    assert group is not None  # a second node is only in a named group
    host, port = read_group_store(store, group, timeout_s)
    return make_store(host, port, timeout_s), None, host, port


def make_manager(
    config: TorchftConfig,
    *,
    rank: int,
    world_size: int,
    store_host: str,
    store_port: int,
    lighthouse: str,
    replica_id: str,
    hostname: str,
    pg_timeout_s: float,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], None],
) -> Any:
    """torchft's Manager for one node (group rank ``rank``) of a replica group, set up as torchft's
    ``train_ddp.py`` sets it up on CPU, with the strategy's settings."""
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=float(config.timeout_s))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout_s))
    return Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=int(config.min_replicas),
        use_async_quorum=bool(config.async_quorum),
        timeout=timeout,
        quorum_timeout=timedelta(seconds=float(config.quorum_timeout_s)),
        connect_timeout=timedelta(seconds=float(config.connect_timeout_s)),
        rank=rank,
        world_size=world_size,
        store_addr=store_host,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname=hostname,
        heartbeat_interval=timedelta(milliseconds=int(config.heartbeat_interval_ms)),
        # A healing replica receives the state over the same gloo group (as torchft's train_ddp.py).
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
        init_sync=False,  # every replica builds the same seeded initial state
    )


def resolve_shards(rows: Sequence[tuple[int, int]], shards: int) -> dict[int, int]:
    """Replica -> shard after a commit whose participants trained ``rows`` (replica, shard): a shard
    two replicas share stays with the lower replica, the others move, in replica order, to the
    lowest shards nobody trained (or keep theirs when none is left)."""
    holder: dict[int, int] = {}
    movers = []
    for replica, shard in sorted(rows):
        if shard in holder.values():
            movers.append((replica, shard))
        else:
            holder[replica] = shard
    vacant = [s for s in range(shards) if s not in holder.values()]
    for replica, shard in movers:
        holder[replica] = vacant.pop(0) if vacant else shard
    return holder


def vacant_shard(trained: Sequence[int], shards: int, fallback: int) -> int:
    """The lowest shard nobody trained in the last committed step, else ``fallback``."""
    return next((s for s in range(shards) if s not in set(trained)), fallback)


class PeerWatch:
    """Calls ``lost(node)`` once when a peer's heartbeat stops moving (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        peers: dict[int, int],
        timeout_s: float,
        interval_s: float,
        lost: Callable[[int], None],
    ) -> None:
        self._store = store  # this thread's own connection, in the run's key space
        self._peers = peers  # node -> incarnation
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._lost = lost
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="torchft-peer-watch")
        self._thread.start()

    def _run(self) -> None:
        seen: dict[int, tuple[str | None, float]] = {}
        while not self._stopping.wait(self._interval_s):
            now = time.monotonic()
            for node, incarnation in self._peers.items():
                key = keys.heartbeat(node, 0, incarnation)
                try:
                    value = self._store.read(key)  # None: missing, or a value the run did not write
                except Exception:  # the run's store is gone: the run is over
                    return
                text = value.decode() if isinstance(value, bytes) else None
                last = seen.get(node)
                if last is None or (text is not None and text != last[0]):
                    seen[node] = (text, now)
                elif now - last[1] > self._timeout_s and not self._stopping.is_set():
                    self._lost(node)
                    return

    def stop(self) -> None:
        self._stopping.set()
