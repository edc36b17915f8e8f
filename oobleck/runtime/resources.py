"""What a worker process holds, read from /proc: threads, descriptors, sockets, memory.

Each generation's establishment reports it (``probe/<g>/<rank>``), and the chaos suite and the GPU
check bound its growth: a count that keeps growing across generations is a leak, and the Python
thread names and gloo thread count say of what.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any


def resource_probe(extra: dict[str, Any]) -> dict[str, Any]:
    """Threads, open file descriptors and resident memory of this process (from /proc), its Python
    threads by name (without a generation suffix) and how many threads are gloo's (one per live
    process group, and its transport loop), which say what a growing count is."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            status[name] = value.strip()
    fds = os.listdir("/proc/self/fd")
    return {
        "threads": int(status.get("Threads", "0")),
        "fds": len(fds),
        "sockets": sum(1 for fd in fds if _is_socket(f"/proc/self/fd/{fd}")),
        "rss_kb": int(status.get("VmRSS", "0 kB").split()[0]),
        "python_threads": dict(collections.Counter(t.name.split("-g")[0] for t in threading.enumerate())),
        "gloo_threads": sum(
            1 for task in os.listdir("/proc/self/task") if _thread_name(task).startswith(("pt_gloo", "gloo"))
        ),
        **extra,
    }


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread ended
        return ""


def _is_socket(path: str) -> bool:
    try:
        return os.readlink(path).startswith("socket:")
    except OSError:  # closed since the listing
        return False
