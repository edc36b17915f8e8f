"""The node agent: torch-free, speaks line-JSON to the controller, heartbeats, dies as a node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from oobleck.elastic.protocol import SECRET_ENV, Channel

pytestmark = pytest.mark.slow  # starts processes


def test_agent_does_not_import_torch():
    code = "import sys, oobleck.elastic.agent, oobleck.elastic.protocol; assert 'torch' not in sys.modules, 'torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_agent_hello_heartbeat_and_node_kill():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "oobleck.elastic.agent", "--controller", f"127.0.0.1:{port}", "--node-id", "3"],
            start_new_session=True,
            env={**os.environ, SECRET_ENV: "s3cret"},
        )
        try:
            server.settimeout(30)
            conn, _ = server.accept()
            conn.settimeout(30)
            channel = Channel(conn)
            hello = channel.recv()
            assert hello["type"] == "hello" and hello["node"] == 3 and hello["pid"] == agent.pid
            assert hello["secret"] == "s3cret"  # the launcher's per-run secret, from the environment
            channel.send(
                {
                    "type": "start",
                    "store": "127.0.0.1:1",
                    "gpus": 0,
                    "run_id": "t",
                    "heartbeat_s": 0.05,
                    "incarnation": 0,
                    "worker_module": "oobleck.runtime.worker",
                    "fork_server": "",
                }
            )
            beats = [channel.recv() for _ in range(3)]
            assert all(b["type"] == "hb" and b["node"] == 3 for b in beats)
            channel.send({"type": "kill", "signal": "SIGKILL"})
            assert agent.wait(timeout=30) == -9  # the node's whole process group went at once
            while True:  # the controller sees the connection close
                message = channel.recv()
                if message is None:
                    break
            channel.close()
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def test_agent_without_controller_fails_clearly():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import oobleck.elastic.agent as a; a.CONNECT_TIMEOUT_S = 0.5; raise SystemExit(a.main(['--controller', '127.0.0.1:{port}', '--node-id', '0']))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot reach the controller" in result.stderr
