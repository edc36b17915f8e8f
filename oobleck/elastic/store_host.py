"""Hosting a run's TCPStore: torch's own (C++), bound where the config says.

The store listens on ``cluster.master_addr`` only (loopback for local runs), not on every
interface: the socket is bound here and handed to the C++ server, which owns it from then on.
``master_port=0`` picks a free port. Every worker, and every thread of the controller that blocks
on the store, connects as a client (``client``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck.elastic.agent_port import bind_agent_listener, listening_socket
from oobleck.errors import RunError

LISTEN_BACKLOG = 256  # connections waiting to be accepted: every worker of a large run at once


def bind_listener(cluster: Any) -> socket.socket:
    """The store's listening socket, bound and listening on ``cluster.master_addr``:
    ``master_port`` in use is one clear error, raised before the run starts any process."""
    try:
        return listening_socket(str(cluster.master_addr), int(cluster.master_port), LISTEN_BACKLOG)
    except OSError as error:
        raise _cannot_host(cluster, error) from None


@dataclass
class RunPorts:
    """The run's two listening sockets, bound before it starts any process (``bind_run_ports``):
    the store's (``StoreHost`` takes it over) and the agent port's (``AgentPort``)."""

    store: socket.socket
    agent: socket.socket

    def close(self) -> None:
        """Close what the run did not take over (a socket taken over is closed by its owner)."""
        self.store.close()
        self.agent.close()

    def __enter__(self) -> RunPorts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bind_run_ports(cluster: Any) -> RunPorts:
    """Both of the run's ports, bound now: one in use is one clear error before anything starts."""
    store = bind_listener(cluster)
    try:
        return RunPorts(store, bind_agent_listener(cluster))
    except BaseException:
        store.close()
        raise


def _cannot_host(cluster: Any, error: BaseException) -> RunError:
    return RunError(
        f"cannot host the store on {cluster.master_addr}:{cluster.master_port} ({error}); "
        "the port is probably in use: set cluster.master_port=<free port> or 0 to pick one"
    )


class StoreHost:
    """The run's store server (``store``) and where clients reach it (``address``)."""

    def __init__(self, cluster: Any, listener: socket.socket | None = None) -> None:
        """``listener``: the socket ``bind_listener`` bound earlier (the server takes it over), or
        None to bind one now."""
        self.host = str(cluster.master_addr)
        self.timeout = timedelta(seconds=float(cluster.startup_timeout_s))
        listener = bind_listener(cluster) if listener is None else listener
        try:
            self.store = dist.TCPStore(
                self.host,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=self.timeout,
                master_listen_fd=listener.fileno(),
                use_libuv=True,  # the classic server does not wake waiters on compare_set
            )
        except Exception as error:
            listener.close()
            raise _cannot_host(cluster, error) from None
        listener.detach()  # the server owns the descriptor now (and closes it when the store goes)

    @property
    def port(self) -> int:
        return int(self.store.port)

    @property
    def address(self) -> str:
        """HOST:PORT, as workers and agents are told."""
        return f"{self.host}:{self.port}"

    def client(self) -> dist.TCPStore:
        """A connection of the controller's own to its store, for a thread that blocks on it."""
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False, timeout=self.timeout)
