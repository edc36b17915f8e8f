"""Process groups across generations: the build / abort / release cycle (25 generations; threads,
fds and memory flat) and the time from a peer's death to a usable new group.

- ``lifecycle.loop``: in one process, 25 times: a generation's groups built by the runtime's
  ``Communicator`` over ``PrefixStore("g<g>", TCPStore)``, collectives, an op left pending, the
  generation aborted through the store key the controller sets (the ``AbortWatch`` thread wakes
  the waiting ``Waiter``), the groups released (NCCL: aborted) and parked in the ``Reaper``, and
  the next generation under a new prefix: time per cycle, abort latency, threads, fds and CUDA
  memory. The pending op: gloo, a receive from an in-process peer that never sends; NCCL (one
  GPU cannot hold two ranks of one communicator), an all-reduce queued behind a GPU spin.
- ``lifecycle.peer_death``: ranks in processes of their own all-reduce in a loop; one is SIGKILLed;
  this process plays the agent (sees the exit) and the controller (sets the abort, publishes the
  survivors); the survivors abort, release, build the next generation's group and all-reduce on
  it: the time from the kill to each of those, measured on one clock. Several ranks share the one
  GPU: NCCL when the ``backends`` unit found that it allows it (``gpu_check_units.nccl``),
  gloo on the GPU's tensors otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpu_check_units.common import (
    MEMORY_FLAT_MIB,
    NCCL_ENV,
    REPO,
    SPACE,
    Settings,
    cuda_reason,
    growth,
    local_store,
    process_resources,
    spawn_ranks,
    spread,
    tail,
)
from oobleck.runtime import keys
from oobleck.runtime.backend import GlooBackend, NcclBackend
from oobleck.runtime.comm import Communicator, GroupSpec, run_in_thread
from oobleck.runtime.reaper import Reaper
from oobleck.runtime.sealed_store import SealedStore
from oobleck.runtime.waits import Aborted, AbortWatch, Waiter

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SURVIVORS_KEY = "peer_death/survivors"


def spin_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (calibrated here)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000.0 / max(start.elapsed_time(end), 1e-3))


def shared_gpu_backend(context: dict[str, Any]) -> tuple[str, str]:
    """The backend for several ranks on the one GPU, and why (from the ``backends`` unit)."""
    if context.get("backends", {}).get("nccl_allowed_two_ranks_on_one_gpu"):
        return "nccl", "NCCL ran two ranks on one GPU (backends unit)"
    return "gloo", "NCCL refused two ranks on one GPU, or was not probed (backends unit): gloo on CUDA tensors"


# ---------------------------------------------------------------------------- the 25-generation loop
class Lifecycle:
    """Generations of the runtime's Communicator in one process, each aborted with an op pending."""

    def __init__(self, s: Settings, store: Any, cuda: bool) -> None:
        self.s, self.store, self.cuda = s, store, cuda
        self.device = "cuda" if cuda else "cpu"
        self.gloo_device = None if cuda else dist.ProcessGroupGloo.create_default_device()
        self.timeout_s = timeout = s.group_timeout(cuda)
        self.watch = AbortWatch("127.0.0.1", store.port, timeout, SPACE)
        backend = NcclBackend(device="cuda") if cuda else GlooBackend(self.gloo_device)
        self.waiter = Waiter(self.watch, timeout, peer_grace_s=1.0, backend=backend)
        self.reaper = Reaper(delay_s=timeout + 1.0)
        # NCCL: one rank per GPU, so a one-rank group; gloo: plus a pair with an in-process peer.
        self.specs = [GroupSpec("solo", (0,))] + ([] if cuda else [GroupSpec("pair", (0, 1))])
        self.spin = spin_cycles(s.spin_s) if cuda else 0
        self.tensor = lambda value: torch.full((1024,), float(value), device=self.device)

    def communicator(self, generation: int, rank: int) -> Any:
        return Communicator(
            generation,
            rank,
            self.specs,
            host="127.0.0.1",
            port=self.store.port,
            timeout_s=self.timeout_s,
            waiter=self.waiter,
            space=SPACE,
        )

    def cycle(self, generation: int) -> dict[str, Any]:
        started = time.perf_counter()
        self.watch.watch(generation)
        comm = self.communicator(generation, 0)
        peer = None if self.cuda else self.communicator(generation, 1)
        peer_built = run_in_thread(peer.build, "peer-build") if peer is not None else None
        comm.build()
        if peer_built is not None:
            peer_built.result(timeout=self.timeout_s)
        built = time.perf_counter()
        x = self.tensor(3)
        comm.allreduce_wait("solo", x, "all-reducing on the one-rank group")
        y = self.tensor(generation)
        self.waiter.work(comm.broadcast("solo", y, 0), "broadcasting on the one-rank group")
        correct = bool(torch.equal(x, self.tensor(3)) and torch.equal(y, self.tensor(generation)))
        if peer is not None:
            mine, theirs = self.tensor(1), self.tensor(2)
            works = [comm.allreduce("pair", mine), peer.allreduce("pair", theirs)]
            for work in works:
                self.waiter.work(work, "all-reducing on the pair")
            correct = correct and bool(torch.equal(mine, self.tensor(3)) and torch.equal(theirs, self.tensor(3)))
        collectives = time.perf_counter()
        # An op that cannot complete before the abort.
        if self.cuda:
            torch.cuda._sleep(self.spin)
            pending = comm.allreduce("solo", self.tensor(1))
        else:
            pending = comm.broadcast("pair", self.tensor(0), 1)  # the peer never sends
        was_pending = not pending.is_completed()
        abort_at: list[float] = []

        def abort() -> None:
            abort_at.append(time.perf_counter())
            SealedStore(self.store, SPACE).set(keys.abort(generation), "1")

        threading.Timer(self.s.abort_after_s, abort).start()
        try:
            self.waiter.work(pending, "the pending op")
            outcome = "completed" if pending.is_completed() else "returned_while_pending"
        except Aborted:
            outcome = "aborted"
        woke = time.perf_counter()
        # Each group parked with its own pending works, as the worker parks them.
        for owner in (peer, comm):
            for items, works in owner.release() if owner is not None else ():
                self.reaper.park(items, works)
        released = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()  # the spin ends; nothing of the aborted generation may hang
        return {
            "generation": generation,
            "correct": correct,
            "was_pending": was_pending,
            "outcome": outcome,
            "abort_latency_s": woke - abort_at[0] if abort_at else None,
            "build_s": built - started,
            "collectives_s": collectives - built,
            "release_s": released - woke,
            "cycle_s": time.perf_counter() - started,
            "parked": self.reaper.parked(),
            **process_resources(),
        }

    def drain(self) -> None:
        """Wait for the reaper to drop every parked group, then let their threads end."""
        deadline = time.monotonic() + self.reaper.delay_s + 3.0
        while self.reaper.parked() and time.monotonic() < deadline:
            time.sleep(0.1)
        gc.collect()
        time.sleep(0.5)


def unit_lifecycle_loop(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    cuda = cuda_reason() is None
    with local_store() as store:
        life = Lifecycle(s, store, cuda)
        life.cycle(0)  # one-time initialisations (CUDA context, NCCL, gloo device) before the baseline
        life.drain()
        before = process_resources()
        samples = [life.cycle(g) for g in range(1, s.cycles + 1)]
        life.drain()
        after = process_resources()
    outcomes: dict[str, int] = {}
    for sample in samples:
        outcomes[sample["outcome"]] = outcomes.get(sample["outcome"], 0) + 1
    result: dict[str, Any] = {
        "backend": "nccl" if cuda else "gloo",
        "cycles": s.cycles,
        "group_timeout_s": life.timeout_s,
        "pending_op": f"all-reduce queued behind a {s.spin_s} s GPU spin"
        if cuda
        else "receive from an in-process peer that never sends",
        "outcomes": outcomes,
        "cycle_s": spread([x["cycle_s"] for x in samples]),
        "build_s": spread([x["build_s"] for x in samples]),
        "abort_latency_s": spread([x["abort_latency_s"] for x in samples if x["abort_latency_s"] is not None]),
        "release_s": spread([x["release_s"] for x in samples]),
        "threads": growth(before, after, samples, "threads"),
        "fds": growth(before, after, samples, "fds"),
        "rss_kb": growth(before, after, samples, "rss_kb"),
        "parked_after_drain": life.reaper.parked(),
    }
    checks = {
        "collectives_correct": all(x["correct"] for x in samples),
        "op_was_pending_at_abort": all(x["was_pending"] for x in samples),
        "every_abort_woke_the_waiter": outcomes.get("aborted", 0) == s.cycles,
        "no_thread_growth": result["threads"]["growth"] <= 0,
        "no_fd_growth": result["fds"]["growth"] <= 0,
    }
    if cuda:
        for key in ("cuda_reserved_mib", "cuda_used_mib"):
            result[key] = growth(before, after, samples, key)
            span = result[key]["max"] - result[key]["min"]
            result[key]["span"] = span
            checks[f"{key.removesuffix('_mib')}_flat_within_{MEMORY_FLAT_MIB}_mib"] = (
                span <= MEMORY_FLAT_MIB and result[key]["growth"] <= MEMORY_FLAT_MIB
            )
    result["checks"] = checks
    result["passed"] = all(checks.values())
    result["samples"] = samples
    return {"status": "ok", **result}


# ---------------------------------------------------------------------------- a peer's death
def unit_peer_death(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    cuda = cuda_reason() is None
    device = "cuda" if cuda else "cpu"
    backend, why = shared_gpu_backend(context) if cuda else ("gloo", "CPU rehearsal: gloo on CPU tensors")
    n, victim = s.peer_death_ranks, s.peer_death_ranks - 1
    with local_store() as store:
        command = [sys.executable, str(SCRIPT), "--peer-rank", "{rank}", "--store-port", str(store.port)]
        command += ["--peer-ranks", str(n), "--backend", backend, "--device", device]
        command += ["--timeout-s", str(s.collective_timeout_s)]
        env = {**NCCL_ENV, **os.environ}
        procs = spawn_ranks(command, range(n), env)
        try:
            store.wait([f"peer_death/ready/{r}" for r in range(n)], timedelta(seconds=s.experiment_wait_s * 6))
            time.sleep(0.3)  # every rank is in its all-reduce loop
            killed_at = time.time()
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(timeout=s.experiment_wait_s)  # what the node's agent sees and reports
            seen_at = time.time()
            SealedStore(store, SPACE).set(keys.abort(0), "1")  # the controller's abort of generation 0
            aborted_at = time.time()
            store.set(SURVIVORS_KEY, json.dumps(list(range(victim))))
            survivors = [f"peer_death/result/{r}" for r in range(victim)]
            store.wait(survivors, timedelta(seconds=s.experiment_wait_s * 3))
            results = [json.loads(store.get(key)) for key in survivors]
        finally:
            logs = []
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                logs.append(tail(output, 8))

    def since_kill(key: str) -> float:
        return max(r[key] for r in results) - killed_at

    correct = all(r["correct"] for r in results)
    return {
        "status": "ok",
        "backend": backend,
        "backend_why": why,
        "device": device,
        "ranks": n,
        "killed_rank": victim,
        "kill_to_exit_seen_s": seen_at - killed_at,
        "kill_to_abort_set_s": aborted_at - killed_at,
        "kill_to_survivors_aborted_s": since_kill("aborted_at"),
        "kill_to_new_group_built_s": since_kill("built_at"),
        "kill_to_usable_group_s": since_kill("usable_at"),
        "survivors": results,
        "passed": correct,
        "note": "detection here is the exit this process sees (an agent's report: milliseconds); a frozen node "
        "is found by the heartbeat timeout (cluster.heartbeat_timeout_s) instead",
        "log_tails": logs,
    }


def peer_main(rank: int, ranks: int, port: int, backend_name: str, device: str, timeout_s: float) -> int:
    """One rank of ``unit_peer_death``: all-reduce until generation 0 is aborted, then join the
    survivors' generation 1 and all-reduce once on it."""
    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    loopback = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    backend = GlooBackend(loopback, device=device) if backend_name == "gloo" else NcclBackend(device=device)
    watch = AbortWatch("127.0.0.1", port, timeout_s, SPACE)
    waiter = Waiter(watch, timeout_s, peer_grace_s=timeout_s, backend=backend)
    reaper = Reaper(delay_s=timeout_s + 1.0)

    def communicator(generation: int, my_rank: int, size: int) -> Communicator:
        group = GroupSpec("all", tuple(range(size)))
        return Communicator(
            generation, my_rank, [group], host="127.0.0.1", port=port, timeout_s=timeout_s, waiter=waiter, space=SPACE
        )

    watch.watch(0)
    comm = communicator(0, rank, ranks)
    comm.build()
    store.set(f"peer_death/ready/{rank}", "1")
    tensor = torch.ones(1 << 16, device=device)
    try:
        while True:
            comm.allreduce_wait("all", tensor, "all-reducing in generation 0")
    except Aborted:
        aborted_at = time.time()
    for items, works in comm.release():
        reaper.park(items, works)
    store.wait([SURVIVORS_KEY], timedelta(seconds=timeout_s))
    survivors = json.loads(store.get(SURVIVORS_KEY))
    watch.watch(1)
    comm = communicator(1, survivors.index(rank), len(survivors))
    comm.build()
    built_at = time.time()
    check = torch.full((1 << 16,), float(rank + 1), device=device)
    comm.allreduce_wait("all", check, "all-reducing in generation 1")
    usable_at = time.time()
    expected = float(sum(r + 1 for r in survivors))
    result = {
        "rank": rank,
        "aborted_at": aborted_at,
        "built_at": built_at,
        "usable_at": usable_at,
        "correct": bool(torch.all(check == expected)),
    }
    store.set(f"peer_death/result/{rank}", json.dumps(result))
    return 0
