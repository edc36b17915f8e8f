"""What every worker program shares: its command line, registration, error report and faults.

A node agent starts ``python -m <Strategy.worker_module> --store HOST:PORT --node-id K
--local-rank R --incarnation I --run-id X`` (``oobleck.runtime.worker``, or a baseline's own
worker such as ``baselines.torchft.worker``), or has the run's fork server fork the same command
from a process that already imported torch (``cluster.fork_workers``, local clusters:
``oobleck.elastic.forkserver``). ``run_worker`` parses that, builds the worker,
registers it in the store (``keys.worker_registered``: the controller counts the node up), runs
it, and on an exception writes the traceback to ``keys.worker_error`` (the controller stops the
run and prints it) and returns 1. ``exit_now`` ends the process without interpreter teardown.
``parse_strike`` reads a fault armed for the worker's node (``keys.strike``, which only the
controller can write: ``keys.KeySpace``) and ``carry_out_strike`` fires it at the point of the step
it names; ``stop_requested`` is the controller's ``keys.STOP``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck.faults.kinds import FaultKind
from oobleck.runtime import keys


class InjectedFault(Exception):
    """Raised on purpose by a ``raise`` fault event (tests the error path)."""


STRIKE_KINDS = tuple(kind.value for kind in FaultKind if kind is not FaultKind.JOIN)  # what a node strikes itself with


def parse_strike(value: bytes) -> dict[str, Any]:
    """The armed fault a ``strike/<node>`` value holds ({step, phase, kind}, and the generation of a
    ``reconfigure`` strike); ``ValueError`` for anything else (dropped where it is read)."""
    strike = json.loads(value)
    if (
        not isinstance(strike, dict)
        or strike.get("kind") not in STRIKE_KINDS
        or not isinstance(strike.get("phase"), str)
        or not isinstance(strike.get("step"), int)
        or not isinstance(strike.get("generation", 0), int)
    ):
        raise ValueError(f"not a strike: {value[:80]!r}")
    return strike


def read_strike(store: Any, node: int) -> dict[str, Any] | None:
    """The fault armed for ``node`` (None: none, or a value the run did not write, dropped)."""
    strike = store.read(keys.strike(node), parse_strike)
    return strike if isinstance(strike, dict) else None


def stop_requested(store: Any) -> bool:
    """Whether the controller stopped the run: only its own ``stop`` counts (``keys.KeySpace``); a
    foreign write of the key ends nothing."""
    return store.read(keys.STOP) is not None


def carry_out_strike(strike: dict[str, Any], store: Any, node: int, where: str) -> None:
    """Fire an armed fault now (``strike["kind"]``: a ``FaultKind``): record when
    (``keys.strike_time``), then raise (``raise``) or take the node's whole process group, agent and
    workers, down at once with the kind's signal (SIGKILL; SIGSTOP to freeze)."""
    store.set(keys.strike_time(node), repr(time.time()))
    kind = FaultKind(strike["kind"])
    if kind.in_worker:
        raise InjectedFault(f"injected failure on node {node} at {where}")
    # A node failure: the whole process group of the node (agent and workers) goes at once.
    assert kind.signal is not None, f"a {kind} strike has no signal"
    os.killpg(os.getpgrp(), kind.signal)


@dataclass(frozen=True)
class WorkerArgs:
    host: str
    port: int
    node: int
    local_rank: int
    incarnation: int
    run_id: str


def parse_worker_args(prog: str, description: str, argv: list[str] | None = None) -> WorkerArgs:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--store", required=True, help="HOST:PORT of the controller's TCPStore")
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--incarnation", type=int, default=0, help="how many times this node's workers were restarted")
    parser.add_argument("--run-id", default="", help="a tag of the run (lets tools find its processes)")
    args = parser.parse_args(argv)
    host, _, port = args.store.rpartition(":")
    return WorkerArgs(host, int(port), args.node_id, args.local_rank, args.incarnation, args.run_id)


def run_worker(
    prog: str,
    description: str,
    build: Callable[[WorkerArgs], Any],
    argv: list[str] | None = None,
    *,
    quiet: tuple[type[BaseException], ...] = (),
) -> int:
    """Build (``build(args)``: an object with ``store`` (a ``SealedStore``) and ``run()``, optionally
    ``close()`` and ``registration``, a dict added to its registration record), register and run a
    worker; 0 when it returns or raises one of ``quiet``, 1 on an error."""
    args = parse_worker_args(prog, description, argv)
    store = worker = None
    try:
        worker = build(args)
        store = worker.store
        record = {"pid": os.getpid(), **getattr(worker, "registration", {})}
        store.set(keys.worker_registered(args.node, args.local_rank, args.incarnation), json.dumps(record))
        worker.run()
        return 0
    except quiet:
        return 0
    except BaseException:
        text = traceback.format_exc()
        try:
            if store is None:
                from oobleck.runtime.store_client import connect

                store = connect(args.host, args.port, 10.0, keys.KeySpace.from_environment())
            store.set(keys.worker_error(args.node, args.local_rank, args.incarnation), text)
        except Exception:
            pass
        print(text, file=sys.stderr, flush=True)
        return 1
    finally:
        if worker is not None and hasattr(worker, "close"):
            worker.close()


def exit_now(code: int) -> None:
    """Flush and exit without interpreter teardown: abandoned process groups and communication
    libraries' threads may still hold sockets, and their destructors can block."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
