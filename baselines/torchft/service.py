"""The controller's side of torchft: the lighthouse, and the run's torchft.json at the end.

``lighthouse_service`` is what ``Torchft.services`` returns: the controller enters it before any
node starts (it first refuses the harness's checkpoints, which torchft neither writes nor resumes;
then it starts a ``torchft._torchft.LighthouseServer`` bound to ``cluster.master_addr``, loopback on a
local cluster, on a free port) and leaves it after the workers are gone. It yields the address the
workers' Managers dial. On the way out it reads the final record each replica left in the store
(``FINAL_COUNT``/``final_record``: its checksums, attempts, votes, heals) and writes
``torchft.json`` in the run dir: per replica, and whether every replica that finished holds
bit-identical state. ``require_torchft`` (the policy, this service and the worker call it) imports
torchft or names the extra that installs it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

from oobleck.errors import ConfigError
from oobleck.strategy import RunInfo

TORCHFT_VERSION = "0.2.0"


def require_torchft(log_level: str = "warn") -> Any:
    """The torchft module, or one clear error naming the extra that installs it. ``log_level``
    quiets torchft's Rust side (read once, at its first import) and its Python loggers."""
    import logging
    import os

    os.environ.setdefault("RUST_LOG", log_level)
    logging.getLogger("torchft").setLevel(log_level.upper())
    try:
        import torchft
    except ImportError as error:
        raise ConfigError(
            f"strategy=torchft needs the torchft package ({error}); install the peers extra: "
            f"pip install -e '.[peers]' (torchft=={TORCHFT_VERSION})"
        ) from None
    return torchft


# Store keys of the replicas' final records (one namespace, away from oobleck.runtime.keys).
FINAL_COUNT = "torchft/final/count"


def final_record(index: int) -> str:
    """The final record (JSON) of the index-th replica to finish (1-based, from ``FINAL_COUNT``)."""
    return f"torchft/final/{index}"


def refuse_checkpoints(run_config: Mapping[str, Any]) -> None:
    """torchft heals from live peers: the harness's checkpoints (writing or resuming) do not apply."""
    checkpoint, job = run_config.get("checkpoint") or {}, run_config.get("job") or {}
    settings = {
        "checkpoint.every_steps": checkpoint.get("every_steps"),
        "checkpoint.every_s": checkpoint.get("every_s"),
        "job.resume": job.get("resume"),
    }
    for key, value in settings.items():
        if value:
            raise ConfigError(
                f"strategy=torchft neither writes nor resumes the harness's checkpoints (torchft heals from live peers), "
                f"but {key}={value}; set {key}=null"
            )


@contextlib.contextmanager
def lighthouse_service(config: Any, run: RunInfo) -> Iterator[dict[str, Any]]:
    refuse_checkpoints(run.config)
    require_torchft(config.log_level)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{run.host}:0",
        min_replicas=int(config.min_replicas),
        join_timeout_ms=int(config.join_timeout_ms),
        quorum_tick_ms=int(config.quorum_tick_ms),
        heartbeat_timeout_ms=int(config.heartbeat_timeout_ms),
    )
    # address() names this machine's hostname; the workers dial the address it is bound to.
    address = f"http://{run.host}:{int(server.address().rsplit(':', 1)[1])}"
    try:
        yield {"lighthouse": address}
    finally:
        try:
            summary = {"lighthouse": address, **summarize_replicas(read_final_records(run.store_address))}
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "torchft.json").write_text(json.dumps(summary, indent=1))
        finally:
            server.shutdown()


def read_final_records(store_address: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    host, _, port = store_address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    count = int(store.add(FINAL_COUNT, 0))
    return [json.loads(store.get(final_record(i))) for i in range(1, count + 1) if store.check([final_record(i)])]


def summarize_replicas(records: list[dict[str, Any]]) -> dict[str, Any]:
    """torchft.json: each finished replica's record and whether their states are bit-identical."""
    finished = [r for r in records if r.get("finished")]
    checksums = {json.dumps(r["checksums"], sort_keys=True) for r in finished}
    return {
        "replicas_finished": len(finished),
        "replicas_identical": len(checksums) == 1 if finished else None,
        "nodes": sorted(r["node"] for r in finished),
        "failed_votes": sum(r["failed_votes"] for r in records),
        "replicas": sorted(records, key=lambda r: (r["node"], r["incarnation"])),
    }
