"""A restart's parts on the device (``restart_probe.py`` is the restarted worker): process start
and torch import, CUDA context, process-group creation (gloo, and NCCL on a GPU), the model's
layers built, a checkpoint of known size read from local disk (bytes/s, out of the page cache),
the first step beyond a steady one; also a fresh start's seeded initialisation (seconds per
billion parameters) and the device-to-host copy rate of a checkpoint snapshot."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_units.common import Settings, cuda_reason, tail
from oobleck.checkpoint.shard import Shard, shard_meta, write_shard
from oobleck.config import load_model_config
from oobleck.models import model_spec
from oobleck.runtime.state import layer_state
from testing import tiny_config

PROBE = Path(__file__).resolve().parent / "restart_probe.py"
CHECKPOINT_STEP = 1


def write_checkpoint(model_cfg: Any, step_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The model's seeded layers (parameters and zero AdamW moments) as the runtime's shards."""
    spec, job = model_spec(model_cfg, 0), tiny_config().job
    records = []
    for index in range(spec.num_layers):
        layer = layer_state(spec, job, index, "cpu")
        records.append(write_shard(step_dir, Shard(shard_meta(layer), layer.flat)).to_dict())
        del layer
    return records, sum(r["bytes"] for r in records)


def evict(step_dir: Path) -> None:
    """Drop the checkpoint's pages from the page cache (written and synced: clean pages go)."""
    for path in step_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def unit_restart(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    reason = cuda_reason()
    device = "cuda" if reason is None else "cpu"
    name, overrides = s.restart_model if reason is None else s.cpu_restart_model
    first_step_model = s.first_step_model if reason is None else s.cpu_first_step_model
    model_cfg = load_model_config(name, **dict(overrides))
    params = model_spec(model_cfg, 0).architecture.total_params()
    probes, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = Path(tmp) / "step"
        started = time.perf_counter()
        records, nbytes = write_checkpoint(model_cfg, step_dir)
        write_s = time.perf_counter() - started
        plan = {
            "model": name,
            "overrides": dict(overrides),
            "step_dir": str(step_dir),
            "step": CHECKPOINT_STEP,
            "records": records,
            "first_step_model": first_step_model,
            "host_copy_mib": s.host_copy_mib,
        }
        (Path(tmp) / "plan.json").write_text(json.dumps(plan))
        probes_wanted = s.restart_probes if device == "cuda" else s.cpu_restart_probes
        for probe in range(probes_wanted):
            evict(step_dir)
            out = Path(tmp) / f"probe{probe}.json"
            command = [sys.executable, str(PROBE), "--device", device, "--plan", f"{tmp}/plan.json", "--out", str(out)]
            spawned = time.time()
            done = subprocess.run(
                [*command, "--spawned-at", repr(spawned)],
                capture_output=True,
                text=True,
                timeout=s.timeout("restart") / (probes_wanted + 1),
            )
            if done.returncode != 0 or not out.exists():
                logs.append(tail(done.stderr))
                continue
            probes.append(json.loads(out.read_text()))
    if not probes:
        return {"status": "failed", "reason": "no restart probe finished", "log_tail": "\n".join(logs)}

    def median(key: str, *inner: str) -> float | None:
        values = []
        for probe in probes:
            value: Any = probe.get(key)
            for part in inner:
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                values.append(float(value))
        return statistics.median(values) if values else None

    read_s = median("checkpoint_read_s")
    init_s = median("model_init_s")
    first, steady = median("first_step", "first_s"), median("first_step", "steady_s")
    result: dict[str, Any] = {
        "status": "ok",
        "device": device,
        "model": name,
        "overrides": dict(overrides),
        "params": params,
        "probes": len(probes),
        "process_start_s": median("process_start_s"),
        "torch_import_s": median("torch_import_s"),
        "harness_import_s": median("harness_import_s"),
        "group_init_s": {b: median("group_init_s", b) for b in ("gloo", "nccl") if median("group_init_s", b)},
        "model_build_s": median("model_build_s"),
        "model_init": {"s": init_s, "s_per_gparam": init_s / (params / 1e9) if init_s else None},
        "checkpoint": {
            "bytes": nbytes,
            "write_s": write_s,
            "read_s": read_s,
            "read_gbps": nbytes / read_s / 1e9 if read_s else None,
            "page_cache": "evicted before each probe (posix_fadvise DONTNEED after fsync)",
        },
        "first_step": {
            "model": first_step_model,
            "first_s": first,
            "steady_s": steady,
            "extra_s": first - steady if first is not None and steady is not None else None,
        },
        "runs": probes,
    }
    if reason:
        result["skipped_parts"] = dict.fromkeys(("cuda_context_s", "group_init_s.nccl", "host_copy_gbps"), reason)
    else:
        result.update(cuda_context_s=median("cuda_context_s"), host_copy_gbps=median("host_copy_gbps"))
    return result
