"""Checks real-run tests end with: ``assert_matches_reference``, the exactness check against
single-process training (``cached_reference``, that training computed once per process), and
``tcp_states``, this host's TCP sockets on a port (from /proc)."""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# cached_reference's results, by everything train_reference reads
_REFERENCES: dict[str, Any] = {}


def cached_reference(
    cfg: Any,
    steps: int | None = None,
    *,
    batches: Sequence[int] | None = None,
    microbatches: Sequence[Sequence[int]] | None = None,
) -> Any:
    """``train_reference(cfg, steps, batches=..., microbatches=...)`` on the CPU, computed once per
    process (a test session, or one xdist worker) for each distinct input: runs of one job on
    different clusters, strategies or failures all compare with the same single-process training,
    which takes as long as a short run. The key is all that training reads: the ``job`` and
    ``model`` sections, the thread count it trains with (``cluster.torch_threads``, or this
    process's when 0) and the arguments. Each caller gets its own copy."""
    import torch
    from omegaconf import OmegaConf

    from oobleck.runtime.reference import train_reference

    threads = int(cfg.cluster.torch_threads) or torch.get_num_threads()
    key = json.dumps(
        {
            "job": OmegaConf.to_container(cfg.job, resolve=True),
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "threads": threads,
            "steps": steps,
            "batches": None if batches is None else [int(b) for b in batches],
            "microbatches": None if microbatches is None else [[int(m) for m in row] for row in microbatches],
        },
        sort_keys=True,
    )
    if key not in _REFERENCES:
        _REFERENCES[key] = train_reference(cfg, steps, batches=batches, microbatches=microbatches)
    return copy.deepcopy(_REFERENCES[key])


def assert_matches_reference(
    cfg: Any, outcome: Any, run_dir: Path, reference: Any = None, *, loss_rtol: float = 1e-5, param_atol: float = 1e-5
) -> float:
    """A real run committed steps 0..steps-1 once each, and its losses and final parameters equal
    single-process training on the same batches (``cached_reference`` unless given).
    The default tolerances are justified in tests/runtime/test_exactness.py. Returns the largest
    parameter difference."""
    import torch

    reference = reference if reference is not None else cached_reference(cfg)
    steps = [row["step"] for row in outcome.steps]
    assert steps == list(range(int(cfg.job.steps))), f"committed steps {steps}: some were skipped or repeated"
    for step, (row, expected) in enumerate(zip(outcome.steps, reference.losses)):
        assert math.isclose(row["loss"], expected, rel_tol=loss_rtol), f"step {step}: loss {row['loss']} vs {expected}"
    final = torch.load(Path(run_dir) / "final_params.pt", weights_only=True)
    worst = 0.0
    for layer, state in reference.layers.items():
        for name, value in state.items():
            worst = max(worst, float((final[str(layer)][name] - value).abs().max()))
    assert worst <= param_atol, f"largest parameter difference {worst} (tolerance {param_atol})"
    return worst


# /proc/net/tcp's state codes (include/net/tcp_states.h)
TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def tcp_states(port: int, this_process: bool = False) -> list[str]:
    """The states of this host's TCP sockets whose local port is ``port`` (IPv4 and IPv6);
    ``this_process``: only sockets this process holds. A run's ports are ephemeral: once closed,
    the kernel may hand the same number to a process of another test (the suite runs on two
    workers), so "this run's port no longer listens" asks about this process's sockets."""
    own = _socket_inodes() if this_process else None
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and (own is None or fields[9] in own):
                states.append(TCP_STATES.get(fields[3], fields[3]))
    return states


def ports_still_listening(ports: Sequence[int], within_s: float) -> tuple[list[int], list[str]]:
    """The ``ports`` this process still listens on after waiting up to ``within_s`` for them to
    close, and the names of the threads alive then (who may hold them). A run's store server lives
    with its object: a helper thread of a run that just returned may hold it a moment longer (seen
    under load in full suites), so its ports are asked about until a bounded deadline."""
    deadline = time.monotonic() + within_s
    while True:
        listening = [port for port in ports if "LISTEN" in tcp_states(port, this_process=True)]
        if not listening or time.monotonic() >= deadline:
            return listening, sorted(t.name for t in threading.enumerate())
        gc.collect()
        time.sleep(0.2)


def _socket_inodes() -> set[str]:
    """The inodes of the sockets this process holds (``/proc/self/fd`` links ``socket:[inode]``)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes
