"""The controller's side of torchft: the lighthouse, and the run's torchft.json at the end.

``lighthouse_service`` is what ``Torchft.services`` returns: the controller enters it before any
node starts (it first refuses the harness's checkpoints, which torchft neither writes nor resumes;
then it starts a ``torchft._torchft.LighthouseServer`` bound to ``cluster.master_addr``, loopback on a
local cluster, on a free port, with the run's detection timeout: ``config.detection``, said on the
console when the strategy overrides it) and leaves it after the workers are gone. It yields the
address the workers' Managers dial. On the way out it reads the final record each worker left in
the store (``FINAL_COUNT``/``final_record``: its checksums, attempts, votes, heals) and writes
``torchft.json`` in the run dir: per worker, whether every finished holder of a layer holds it
bit-identical, and the detection timeouts the run used.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

from baselines.torchft.config import require_torchft, run_detection
from oobleck.errors import ConfigError
from oobleck.strategy import RunInfo

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
    timeouts, cluster_timeout_s = run_detection(config, run.config)
    if timeouts.overrides:
        print(f"torchft: detection timeouts from a {timeouts.describe(cluster_timeout_s)}", flush=True)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{run.host}:0",
        min_replicas=int(config.min_replicas),
        join_timeout_ms=int(config.join_timeout_ms),
        quorum_tick_ms=int(config.quorum_tick_ms),
        heartbeat_timeout_ms=timeouts.heartbeat_timeout_ms,
    )
    # address() names this machine's hostname; the workers dial the address it is bound to.
    address = f"http://{run.host}:{int(server.address().rsplit(':', 1)[1])}"
    try:
        yield {"lighthouse": address}
    finally:
        try:
            summary = {
                "lighthouse": address,
                "detection": timeouts.to_dict(cluster_timeout_s),
                **summarize_replicas(read_final_records(run.store_address, run.secret)),
            }
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "torchft.json").write_text(json.dumps(summary, indent=1))
        finally:
            server.shutdown()


def read_final_records(store_address: str, secret: str) -> list[dict[str, Any]]:
    """The workers' final records, read in the run's key space (a value the run did not write is
    dropped with one log line)."""
    import torch.distributed as dist

    from oobleck.runtime import keys
    from oobleck.runtime.sealed_store import SealedStore

    host, _, port = store_address.rpartition(":")
    raw = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = SealedStore(raw, keys.KeySpace(secret))
    count = int(store.add(FINAL_COUNT, 0))
    records = (store.read(final_record(i), _record) for i in range(1, count + 1))
    return [record for record in records if isinstance(record, dict)]


def _record(value: bytes) -> dict[str, Any]:
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError(f"not a final record: {value[:80]!r}")
    return record


def summarize_replicas(records: list[dict[str, Any]]) -> dict[str, Any]:
    """torchft.json: each worker's record and whether the finished holders of every layer hold it
    bit-identical (a worker holds the whole model, or its stage's layers in a group of several)."""
    finished = [r for r in records if r.get("finished")]
    by_layer: dict[str, set[int]] = {}
    for record in finished:
        for layer, checksum in record["checksums"].items():
            by_layer.setdefault(layer, set()).add(checksum)
    return {
        "replicas_finished": len({r.get("replica", r["node"]) for r in finished}),
        "replicas_identical": all(len(c) == 1 for c in by_layer.values()) if finished else None,
        "nodes": sorted(r["node"] for r in finished),
        "failed_votes": sum(r["failed_votes"] for r in records if r.get("stage_last", True)),
        "replicas": sorted(records, key=lambda r: (r["node"], r["incarnation"])),
    }
