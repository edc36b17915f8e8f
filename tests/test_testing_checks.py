"""The suite's own socket check (``testing.tcp_states``): a port another process listens on is not
this process's (the suite runs on two workers, and a closed run's ephemeral port may be reused)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from testing import ports_still_listening, tcp_states

LISTENER = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
    "print(s.getsockname()[1], flush=True); sys.stdin.read()\n"
)


def test_this_process_sees_only_its_own_listeners():
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen(1)
        port = mine.getsockname()[1]
        assert tcp_states(port) == ["LISTEN"] and tcp_states(port, this_process=True) == ["LISTEN"]
    other = subprocess.Popen([sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(other.stdout.readline())
        assert tcp_states(theirs) == ["LISTEN"] and tcp_states(theirs, this_process=True) == []
    finally:
        other.communicate(timeout=30)


def test_a_port_closed_while_waiting_is_not_reported_and_one_held_is():
    held, closing = socket.socket(), socket.socket()
    for s in (held, closing):
        s.bind(("127.0.0.1", 0))
        s.listen(1)
    ports = [held.getsockname()[1], closing.getsockname()[1]]
    timer = threading.Timer(0.3, closing.close)  # a run's helper thread letting go a moment later
    timer.start()
    try:
        listening, threads = ports_still_listening(ports, within_s=5.0)
    finally:
        timer.join()
        held.close()
    assert listening == [ports[0]] and threading.current_thread().name in threads
    assert ports_still_listening(ports, within_s=0.0)[0] == []
