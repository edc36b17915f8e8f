"""NCCL's own questions: can two processes be ranks of one NCCL group on the one GPU, and how can a
genuinely pending NCCL op be aborted.

- ``backends``: ranks 0 and 1 of one NCCL group in two processes on cuda:0 (NCCL refuses this with
  "Duplicate GPU detected" in the releases we know of; the recovery and peer-death units then use
  gloo on the GPU's tensors, and say so).
- ``lifecycle.absent_peer_*``: a two-rank NCCL group whose second rank never joins (lazy, eager
  and non-blocking communicator init): is the op pending, and does ``abort()`` release it?
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpu_check_units.common import NCCL_ENV, REPO, Settings, local_store, spawn_ranks, tail

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def unit_backends(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    """Two processes, ranks 0 and 1 of one NCCL group, both on cuda:0: does NCCL allow it?"""
    with local_store() as store:
        command = [sys.executable, str(SCRIPT), "--nccl-rank", "{rank}", "--store-port", str(store.port)]
        command += ["--timeout-s", str(s.collective_timeout_s)]
        # Both ranks see one device; NCCL_DEBUG=WARN prints NCCL's own reason if it refuses.
        env = {
            **NCCL_ENV,
            "NCCL_DEBUG": "WARN",
            **os.environ,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        }
        started = time.perf_counter()
        procs = spawn_ranks(command, (0, 1), env)
        ranks, outputs = [], []
        for rank, proc in enumerate(procs):
            timed_out = False
            try:
                output, _ = proc.communicate(timeout=s.experiment_wait_s * 3)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            outputs.append(output or "")
            ranks.append(
                {"rank": rank, "exit_code": proc.returncode, "timed_out": timed_out, "log_tail": tail(output, 12)}
            )
    duplicate = any("Duplicate GPU" in output for output in outputs)
    ran = all(r["exit_code"] == 0 and "RESULT ok" in output for r, output in zip(ranks, outputs))
    return {
        "status": "ok",
        "nccl_version": str(torch.cuda.nccl.version()),
        "nccl_allowed_two_ranks_on_one_gpu": ran,
        "duplicate_gpu_refused": duplicate,
        "wall_s": time.perf_counter() - started,
        "ranks": ranks,
    }


def nccl_rank_main(rank: int, port: int, timeout_s: float) -> int:
    """One rank of ``unit_backends``."""
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("same-gpu", store), rank, 2, options)
    tensor = torch.full((1024,), float(rank + 1), device="cuda")
    try:
        group.allreduce([tensor]).wait()
        torch.cuda.synchronize()
        print(f"RESULT ok sum={float(tensor[0])}", flush=True)
    except Exception as error:
        print(f"RESULT error {type(error).__name__}: {error}", flush=True)
    return 0


# ---------------------------------------------------------------------------- NCCL: a genuinely pending op
def unit_absent_peer(s: Settings, context: dict[str, Any], *, init: str) -> dict[str, Any]:
    """A two-rank NCCL group whose second rank never joins: is the op pending, does ``abort()`` from
    another thread return, and does it release the thread blocked in the op?

    ``init``: ``lazy`` (the communicator is made by the first collective, blocking), ``eager``
    (``eager_connect_single_device`` first), ``nonblocking`` (``options.config.blocking = 0``).
    """
    with local_store() as store:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=s.collective_timeout_s)
        if init == "nonblocking":
            options.config.blocking = 0
            os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"  # torch's own switch, read by the group
        group = dist.ProcessGroupNCCL(dist.PrefixStore("absent", store), 0, 2, options)
        tensor = torch.ones(1024, device="cuda")
        box: dict[str, Any] = {}
        returned = threading.Event()

        def issue() -> None:
            try:
                if init == "eager":
                    group.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
                    box["connected"] = True
                box["work"] = group.allreduce([tensor])
            except Exception as error:  # what the blocked call ended with, if it ended
                box["error"] = f"{type(error).__name__}: {error}"[:2000]
            finally:
                returned.set()

        started = time.perf_counter()
        threading.Thread(target=issue, daemon=True, name="issue").start()
        returned_before_abort = returned.wait(s.issue_wait_s)
        work = box.get("work")
        pending = work is not None and not work.is_completed()
        aborted = threading.Event()
        abort_started = time.perf_counter()

        def abort() -> None:
            try:
                group.abort()
                box["abort"] = "returned"
            except Exception as error:
                box["abort"] = f"{type(error).__name__}: {error}"[:2000]
            aborted.set()

        threading.Thread(target=abort, daemon=True, name="abort").start()
        abort_returned = aborted.wait(s.experiment_wait_s)
        abort_s = time.perf_counter() - abort_started
        released = returned.wait(s.experiment_wait_s)
        result = {
            "init": init,
            "config_blocking": int(options.config.blocking),
            "issue_returned_before_abort": returned_before_abort,
            "op_pending_before_abort": pending,
            "abort_returned": abort_returned,
            "abort_s": abort_s if abort_returned else None,
            "abort_result": box.get("abort"),
            "blocked_thread_released": released,
            "issue_error": box.get("error"),
            "wall_s": time.perf_counter() - started,
        }
        if work is not None and released:
            result["work_completed_after_abort"] = bool(work.is_completed())
            try:
                work.wait()
                result["work_wait"] = "returned"
            except Exception as error:
                result["work_wait"] = f"{type(error).__name__}: {error}"[:2000]
    works = released and abort_returned and (pending or not returned_before_abort)
    return {"status": "ok", "genuinely_pending_and_abortable": works, **result}
