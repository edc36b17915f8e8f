"""The one place where gloo (CPU) and NCCL (CUDA) differ: process set-up, group creation, waiting
on an operation, and releasing an aborted generation's groups.

A worker opens its backend once (``open_backend``); everything else in the runtime asks the
backend instead of branching on ``cluster.device``:

- ``device``: where this process's tensors live (``cpu`` or ``cuda:<local rank>``);
- ``new_group(store, rank, size, timeout_s)``: a raw process group over a (prefixed) store;
- ``wait(waiter, work, what)``: how to know an issued operation has *run*. A gloo work's future
  completes when the op is done, so the wait sleeps on the future; ProcessGroupNCCL completes the
  future as soon as the op is *enqueued* on its CUDA stream (``work->future_->markCompleted``
  right after the launch in ``ProcessGroupNCCL::collective``), so the wait polls
  ``is_completed()``, which queries the op's CUDA end event without blocking;
- ``release(groups)``: what to do with an abandoned generation's groups before they are parked.
  gloo: nothing (its destructor waits for pending ops until the timeout, so the reaper drops them
  later; ``abort()`` does not cancel a pending gloo op, see /work/shared/notes). NCCL: abort the
  communicators together so kernels of the aborted generation free the stream.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.launcher import launcher_class

if TYPE_CHECKING:
    from oobleck.runtime.waits import Waiter


class Backend(abc.ABC):
    """A collective backend as the runtime uses it (see the module docstring)."""

    name = ""
    device = "cpu"

    @abc.abstractmethod
    def new_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        """A process group of ``size`` ranks (this one ``rank``) rendezvousing through ``store``."""

    @abc.abstractmethod
    def wait(self, waiter: Waiter, work: Any, what: str) -> None:
        """Return once ``work`` has run (``Aborted`` on an abort, ``RunError`` on the timeout)."""

    @abc.abstractmethod
    def release(self, groups: list[Any]) -> None:
        """Make an abandoned generation's groups safe to park (see the module docstring)."""


@dataclass(frozen=True)
class GlooBackend(Backend):
    """gloo over TCP; ``transport`` is gloo's device (the interface its pairs bind to).

    On ``device="cuda:<i>"`` tensors stay on the GPU and gloo stages each collective through host
    memory (its CUDA broadcast and all-reduce copy on a side stream), so several workers can share
    one GPU; its future completes once the result is copied back, and ``wait`` then orders the
    current stream after that copy."""

    transport: Any = None
    device: str = "cpu"
    name = "gloo"

    def new_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        # torch's stub names gloo's options class ``Options`` (at run time that is the base
        # Backend.Options, without a timeout or devices) and omits the real one, ``_Options``.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [
            self.transport if self.transport is not None else dist.ProcessGroupGloo.create_default_device()
        ]
        options._threads = 1  # ops of one group run in order; groups are many and small
        return dist.ProcessGroupGloo(store, rank, size, options)

    def wait(self, waiter: Waiter, work: Any, what: str) -> None:
        waiter.wait_future_of(work, what)
        if self.device != "cpu":
            work.wait()  # done already: orders the current CUDA stream after the copy back

    def release(self, groups: list[Any]) -> None:
        return None  # parked as they are: see the module docstring


@dataclass(frozen=True)
class NcclBackend(Backend):
    """NCCL on the CUDA device ``device`` (one per worker process)."""

    device: str = "cuda:0"
    name = "nccl"

    def new_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)

    def wait(self, waiter: Waiter, work: Any, what: str) -> None:
        waiter.poll(work, what)

    def release(self, groups: list[Any]) -> None:
        if groups:
            abort_nccl_groups(groups)


def abort_nccl_groups(groups: list[Any]) -> None:
    """Abort NCCL process groups together, so kernels of an aborted generation free the stream.

    One ``ncclCommAbort`` after another can deadlock when ops are pending on several
    communicators (a recv on one P2P channel, a send on another): an abort may wait on the device
    for a kernel of a communicator not yet aborted. NCCL >= 2.22 aborts them together inside
    ``ncclGroupStart``/``ncclGroupEnd`` (pytorch/pytorch#119797, #150690), which is what
    ``torch.distributed.distributed_c10d._abort_process_group`` does with ``_group_start`` and
    ``_group_end``; the groups here are raw backends outside torch's registry, so do the same.
    """
    groups[0]._group_start()
    try:
        for group in groups:
            try:
                group.abort()
            except Exception:  # an already failed communicator: nothing left to abort
                pass
    finally:
        groups[0]._group_end()


def open_backend(cluster: Any, node: int, local_rank: int) -> Backend:
    """Prepare this worker process for ``cluster.device`` and return its backend.

    cuda: each worker owns the GPU of its local rank; with NCCL (``cluster.backend`` auto or
    nccl) in-process recovery needs communicator errors not to kill the process (an inherited
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` of 1 or 3 would kill the survivors; aborted generations'
    communicators are aborted explicitly by ``release``); ``cluster.backend=gloo`` runs gloo on
    the GPU's tensors. cpu (and gloo on the GPU): gloo binds to the address the cluster's launcher
    gives the node (``Launcher.worker_address``: on a local cluster the controller's, loopback,
    unless ``cluster.node_address_base`` gives each node its own; elsewhere the host's default
    interface).
    """
    device = "cpu"
    if cluster.device == "cuda":
        if not torch.cuda.is_available():
            raise RunError("cluster.device=cuda but this worker sees no CUDA device; set cluster.device=cpu")
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        if cluster.backend != "gloo":
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
            return NcclBackend(device=device)
    hostname = launcher_class(cluster).worker_address(cluster, node)
    transport = (
        dist.ProcessGroupGloo.create_device(hostname=hostname)
        if hostname
        else dist.ProcessGroupGloo.create_default_device()
    )
    return GlooBackend(transport=transport, device=device)
