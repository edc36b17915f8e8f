"""Client connections to the controller's TCPStore: a plain one (``make_store``) and one in the
run's key space (``connect``, a ``SealedStore``).

A connection serves one thread at a time: the runtime opens one for each thread that waits on the
store (the abort watch, the heartbeat, a group build an abort may abandon), so no abandoned wait
holds a connection another thread uses.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from oobleck.runtime import keys
from oobleck.runtime.sealed_store import SealedStore


def make_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A plain client connection to a TCPStore."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connect(host: str, port: int, timeout_s: float, space: keys.KeySpace) -> SealedStore:
    """A client connection to the controller's TCPStore, in the run's key space."""
    return SealedStore(make_store(host, port, timeout_s), space)
