"""Forked workers (cluster.fork_workers): each is a real process that lives as an exec'd worker
would: its agent's process group, environment, working directory, streams and command line, and
its exit status as Popen reports it. The server goes when its launcher does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from oobleck.elastic.forked_worker import ForkedWorker
from oobleck.elastic.forkserver import ForkServer
from oobleck.elastic.local import node_processes, run_processes

pytestmark = pytest.mark.slow  # starts processes

PROGRAMS = Path(__file__).resolve().parent / "forkprogs"
TIMEOUT_S = 60.0
RUN_ID = f"forktest-{uuid.uuid4().hex[:8]}"  # this session's: a leftover of another cannot count


@pytest.fixture(scope="module")
def server():
    with ForkServer(RUN_ID) as fork_server:
        yield fork_server


def _fork(server, tmp_path, *args, marker="m"):
    """Fork forkprog with ``args`` as a worker of node 7; returns the handle and its stdout file."""
    out = tmp_path / "out.txt"
    env = {**os.environ, "PYTHONPATH": str(PROGRAMS), "FORKPROG_MARKER": marker}
    argv = ["-m", "forkprog", *args, "--node-id", "7", "--local-rank", "0", "--run-id", RUN_ID]
    with out.open("w") as stdout:
        saved = os.dup(1)
        os.dup2(stdout.fileno(), 1)  # the requester's stdout is what the worker gets
        try:
            worker = ForkedWorker(server.address, argv, TIMEOUT_S, env=env)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return worker, out


def _described(out: Path) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while not out.read_text().strip():
        assert time.monotonic() < deadline, "the forked worker printed nothing"
        time.sleep(0.05)
    return json.loads(out.read_text().splitlines()[0])


def test_a_forked_worker_is_what_an_execd_one_would_be(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    worker, out = _fork(server, tmp_path, "exit", "3", marker="env-from-the-agent")
    assert worker.wait(timeout=TIMEOUT_S) == 3 and worker.poll() == 3
    seen = _described(out)
    assert seen["pid"] == worker.pid and seen["pid"] != server.process.pid
    assert seen["pgid"] == os.getpgrp()  # the requester's (an agent's) process group
    assert seen["cwd"] == str(tmp_path) and seen["marker"] == "env-from-the-agent"
    assert seen["name"] == "__main__" and seen["argv"][:2] == ["exit", "3"]
    assert seen["cmdline"] == f"python -m forkprog exit 3 --node-id 7 --local-rank 0 --run-id {RUN_ID}"


def test_signals_and_failures_give_popens_exit_status(server, tmp_path):
    for sig in (signal.SIGKILL, signal.SIGTERM):
        worker, out = _fork(server, tmp_path, "sleep")
        _described(out)
        assert node_processes(RUN_ID)[7]["workers"] == [worker.pid]  # found by its command line
        worker.send_signal(sig)
        assert worker.wait(timeout=TIMEOUT_S) == -sig
    worker, out = _fork(server, tmp_path, "raise")
    assert worker.wait(timeout=TIMEOUT_S) == 1  # an exception: the traceback on stderr, status 1
    sleeper, _ = _fork(server, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    sleeper.kill()
    assert sleeper.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    assert run_processes(RUN_ID) == [server.process.pid]  # nothing of the tests' is left but the server


def _agents_line(stdout) -> int:
    """The worker pid the stand-in agent reports on the pipe it shares with that worker (whose own
    line may come first, or around it)."""
    for line in stdout:
        found = re.search(r"PID (\d+)$", line.rstrip("\n"))
        if found:
            return int(found.group(1))
    raise AssertionError("the stand-in agent reported no worker")


def test_a_node_kill_takes_its_forked_workers(tmp_path):
    # A stand-in agent in its own process group asks for a worker; killpg of that group (what a
    # node kill is) takes the worker too, although the worker is the server's child.
    with ForkServer(RUN_ID) as fork_server:
        code = (
            "import os, sys, time\n"
            "from oobleck.elastic.forked_worker import ForkedWorker\n"
            f"argv = ['-m', 'forkprog', 'sleep', '--run-id', {RUN_ID!r}]\n"
            f"w = ForkedWorker({fork_server.address!r}, argv, 60.0, env={{**os.environ, 'PYTHONPATH': {str(PROGRAMS)!r}}})\n"
            "os.write(1, f'PID {w.pid}\\n'.encode())\n"  # one write: the worker prints to this pipe too
            "time.sleep(600)\n"
        )
        agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, process_group=0)
        worker_pid = _agents_line(agent.stdout)
        assert os.getpgid(worker_pid) == agent.pid
        os.killpg(agent.pid, signal.SIGKILL)
        assert agent.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        deadline = time.monotonic() + TIMEOUT_S
        while worker_pid in run_processes(RUN_ID):  # reaped by the server: no zombie left
            assert time.monotonic() < deadline, "the worker outlived its node"
            time.sleep(0.05)


def test_the_server_goes_with_its_launcher(tmp_path):
    fork_server = ForkServer(RUN_ID)
    directory = Path(fork_server.directory)
    os.close(fork_server._alive)  # the launcher's end of the pipe closes, as when it dies
    fork_server._alive = -1
    assert fork_server.process.wait(timeout=TIMEOUT_S) == 0  # it exits by itself, once ready
    fork_server.close()
    assert not directory.exists()
    with pytest.raises(OSError):
        ForkedWorker(fork_server.address, ["-m", "forkprog", "sleep"], 1.0)


def test_a_bad_request_is_refused_and_the_server_keeps_serving(server, tmp_path):
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(TIMEOUT_S)
        client.connect(server.address)
        client.sendall(b'{"argv": ["-m", "forkprog"]}\n')  # no standard streams passed along
        reply = json.loads(client.makefile("rb").readline())
    assert "stdin, stdout and stderr" in reply["error"]
    worker, _ = _fork(server, tmp_path, "exit", "0")
    assert worker.wait(timeout=TIMEOUT_S) == 0


def test_only_local_cpu_workers_are_forked(make_config):
    from oobleck.elastic.forkserver import forks_workers

    assert forks_workers(make_config())  # the local default
    assert not forks_workers(make_config("cluster.fork_workers=false"))
    # a process forked after CUDA was initialised cannot use it: CUDA workers are exec'd
    assert not forks_workers(make_config("cluster.device=cuda"))
    assert not forks_workers(make_config("cluster=slurm"))


def test_a_server_forked_from_its_launcher_keeps_nothing_of_the_launchers(tmp_path):
    """``oobleck.run`` forks its server from itself once torch is imported (``from_this_process``):
    the server and its workers must be what an exec'd server's are, with none of the launcher's
    logging handlers, stream wrappers (its console log), exit functions or descriptors."""
    launcher_log, tee = tmp_path / "launcher.log", tmp_path / "tee.txt"
    run_id = f"{RUN_ID}-forked"  # not the module's server's
    code = f"""
import atexit, json, logging, os, sys
from oobleck.elastic.forked_worker import ForkedWorker
from oobleck.elastic.forkserver import ForkServer
from oobleck.elastic.local import run_processes
logging.basicConfig(filename={str(launcher_log)!r})
atexit.register(lambda: open({str(tee)!r} + ".atexit", "a").write("x"))
real = sys.stdout
sys.stdout = open({str(tee)!r}, "w")  # the launcher's console log wraps its streams
with ForkServer({run_id!r}, from_this_process=True) as server:
    argv = ["-m", "forkprog", "exit", "4", "--run-id", {run_id!r}]
    worker = ForkedWorker(server.address, argv, 60.0, env={{**os.environ, "PYTHONPATH": {str(PROGRAMS)!r}}})
    code = worker.wait(timeout=60.0)
    listed = run_processes({run_id!r})
    print(json.dumps({{"forked": server.forked, "code": code, "server": server.process.pid, "listed": listed,
                      "group": os.getpgid(server.process.pid)}}), file=real, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    worker_line, launcher_line = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert launcher_line["forked"] and launcher_line["code"] == 4
    assert launcher_line["listed"] == [launcher_line["server"]]  # found by its title, as an exec'd one
    assert launcher_line["group"] == launcher_line["server"]  # a group of its own: Ctrl-C is the launcher's
    assert worker_line["argv"] == ["exit", "4", "--run-id", run_id] and worker_line["name"] == "__main__"
    assert worker_line["root_handlers"] == 0 and worker_line["stdout_fd"] == 1
    assert worker_line["fds"] == [0, 1, 2, 3]  # 3: the listing's own
    assert tee.read_text() == ""  # nothing of the worker's went through the launcher's wrapper
    assert (tmp_path / "tee.txt.atexit").read_text() == "x"  # the launcher's exit function ran once


def test_a_workers_child_before_its_exec_is_not_a_second_worker():
    # A child forked by a worker (``subprocess`` before its ``exec``) carries the worker's command
    # line; a scan of the node's processes must still see one worker, the parent.
    run_id = f"forkchild-{uuid.uuid4().hex[:8]}"
    # One write each (print writes the number and the newline apart where stdout is unbuffered,
    # PYTHONUNBUFFERED, and the two processes' writes then interleave).
    code = "import os, sys, time; os.fork(); os.write(1, b'%d\\n' % os.getpid()); time.sleep(60)"
    argv = [sys.executable, "-c", code, "--node-id", "7", "--local-rank", "0", "--run-id", run_id]
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = {int(worker.stdout.readline()), int(worker.stdout.readline())}  # the worker and its child
        assert worker.pid in pids and len(pids) == 2
        assert node_processes(run_id) == {7: {"agent": [], "workers": [worker.pid]}}
        assert run_processes(run_id) == [worker.pid]
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the worker's session: it and its child
        worker.wait(timeout=TIMEOUT_S)
