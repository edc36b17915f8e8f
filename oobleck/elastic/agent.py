"""The node agent: starts and watches the node's worker processes and reports to the controller.

``python -m oobleck.elastic.agent --controller HOST:PORT --node-id K`` (what ``srun`` runs on each
node; ``cluster.kind=local`` starts one per simulated node). It imports no torch: it connects to the
controller with the run's secret (environment variable ``OOBLECK_AGENT_SECRET``), receives the
store address and the number of workers, starts them (``python -m <worker module>``, or forked by
the run's fork server when the controller names one: ``oobleck.elastic.forkserver``), reports
each worker's exit the moment it happens (one waiting thread per worker) and heartbeats. On
``restart`` it kills its workers (a real restart: the processes exit) and starts fresh ones of a
new incarnation. The agent is the leader of its own process group, so killing a node is one
``killpg``. If the controller goes away, or asks it to shut down, it stops its workers and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from oobleck.elastic.forked_worker import ForkedWorker
from oobleck.elastic.protocol import SECRET_ENV, Channel, ProtocolError

CONNECT_TIMEOUT_S = 30.0
STOP_GRACE_S = 3.0
# Bounds a fork request: the server may still be importing torch when the first agents ask (it
# starts with the run, ~1.5 s of CPU; on a loaded 2-core machine several times that).
FORK_TIMEOUT_S = 120.0


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=5.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Agent:
    def __init__(self, channel: Channel, node: int) -> None:
        self.channel = channel
        self.node = node
        self.workers: list[Any] = []  # subprocess.Popen, or ForkedWorker (the same methods)
        self.stopping = threading.Event()
        self.store = ""
        self.gpus = 0
        self.run_id = ""
        self.module = ""  # the worker program (the strategy's: oobleck.runtime.worker by default)
        self.fork_server = ""  # where to ask for forked workers; "" to exec them
        self.incarnation = 0

    def start_workers(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self.workers = []
        for local_rank in range(self.gpus):
            arguments = [
                "--store",
                self.store,
                "--node-id",
                str(self.node),
                "--local-rank",
                str(local_rank),
                "--incarnation",
                str(incarnation),
                "--run-id",
                self.run_id,
            ]
            if self.fork_server:
                process: Any = ForkedWorker(self.fork_server, ["-m", self.module, *arguments], FORK_TIMEOUT_S)
            else:
                process = subprocess.Popen([sys.executable, "-m", self.module, *arguments], stdin=subprocess.DEVNULL)
            self.workers.append(process)
            threading.Thread(target=self._watch, args=(local_rank, process, incarnation), daemon=True).start()

    def try_start_workers(self, incarnation: int) -> bool:
        """``start_workers``, or one line saying why none could start (the agent then exits, and
        the controller sees its node fail)."""
        try:
            self.start_workers(incarnation)
            return True
        except OSError as error:  # the executable, or the fork server, is not there
            print(
                f"oobleck.elastic.agent: error: node {self.node} cannot start its workers: {error}",
                file=sys.stderr,
                flush=True,
            )
            return False

    def _watch(self, local_rank: int, process: Any, incarnation: int) -> None:
        code = process.wait()
        self.channel.send(
            {"type": "exit", "node": self.node, "local_rank": local_rank, "code": code, "incarnation": incarnation}
        )

    def heartbeat(self, interval_s: float) -> None:
        while not self.stopping.wait(interval_s):
            if not self.channel.send({"type": "hb", "node": self.node, "time": time.time()}):
                return

    def kill_workers(self) -> None:
        """A restart: every worker of this incarnation is killed and reaped (bounded)."""
        for process in self.workers:
            if process.poll() is None:
                process.kill()
        for process in self.workers:
            try:
                process.wait(timeout=STOP_GRACE_S * 10)
            except subprocess.TimeoutExpired:  # unkillable (e.g. in uninterruptible I/O): give up on it
                pass

    def stop_workers(self) -> None:
        for process in self.workers:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.workers:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                try:
                    process.wait(timeout=STOP_GRACE_S * 10)
                except subprocess.TimeoutExpired:  # unkillable (e.g. in uninterruptible I/O): give up on it
                    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oobleck.elastic.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--controller", required=True, help="HOST:PORT of the controller's agent port")
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--run-id", default="", help="a tag of the run (lets tools find its processes)")
    args = parser.parse_args(argv)
    if os.getpgrp() != os.getpid():
        os.setpgid(
            0, 0
        )  # under srun (or locally on Python 3.10): lead the node's process group, so a node kill is one killpg
    host, _, port = args.controller.rpartition(":")
    try:
        sock = connect(host, int(port), CONNECT_TIMEOUT_S)
    except OSError as error:
        print(
            f"oobleck.elastic.agent: error: cannot reach the controller at {args.controller}: {error}", file=sys.stderr
        )
        return 2
    sock.settimeout(None)
    channel = Channel(sock)
    agent = Agent(channel, args.node_id)
    secret = os.environ.get(SECRET_ENV, "")
    channel.send(
        {"type": "hello", "node": args.node_id, "pid": os.getpid(), "host": socket.gethostname(), "secret": secret}
    )
    code = 0
    while True:
        try:
            message = channel.recv()
        except ProtocolError as error:
            print(f"oobleck.elastic.agent: error: bad message from the controller ({error})", file=sys.stderr)
            code = 1
            break
        if message is None:  # the controller is gone: never leave orphaned workers behind
            code = 1
            break
        if message["type"] == "start":
            agent.store, agent.gpus, agent.run_id = (
                message["store"],
                int(message["gpus"]),
                message["run_id"] or args.run_id,
            )
            agent.module = message["worker_module"]
            agent.fork_server = message["fork_server"]
            if not agent.try_start_workers(int(message["incarnation"])):
                code = 1
                break
            threading.Thread(target=agent.heartbeat, args=(float(message["heartbeat_s"]),), daemon=True).start()
        elif message["type"] == "restart":
            agent.kill_workers()
            if not agent.try_start_workers(int(message["incarnation"])):
                code = 1
                break
        elif message["type"] == "shutdown":
            break
        elif message["type"] == "kill":  # fault injection where the controller cannot killpg us
            os.killpg(os.getpgrp(), getattr(signal, message["signal"], signal.SIGKILL))
    agent.stopping.set()
    agent.stop_workers()
    channel.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
