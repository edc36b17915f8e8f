"""The CUDA / NCCL check: one command that writes one JSON report, on any CUDA machine (issues 17, 31).

    python benchmarks/gpu_check.py --out report.json [--quick] [--only UNIT ...] [--budget-s S]
    python benchmarks/gpu_report_to_conf.py report.json      # the measured values into conf/

Every unit runs in its own subprocess with its own timeout (and all of them within ``--budget-s``),
so a hang or a crash in one leaves the others' results; the report is rewritten after each unit
and the script exits 0 whenever it was written. Without CUDA (the rehearsal) each CUDA-only unit
is an entry ``{"status": "skipped", "reason": ...}`` and every other unit runs for real on the CPU
with gloo and CPU tensors (smaller models where the GPU's would not fit a CPU's minutes). The units
live in ``benchmarks/gpu_check_units/``, one module per part:

1. ``backends`` (CUDA): can two processes be ranks of one NCCL group on the one GPU? The recovery
   and peer-death units use NCCL if so, gloo on the GPU's tensors (``cluster.backend=gloo``) if not.
2. ``exactness``: the runtime's executor on one rank against the single-process reference for a
   model of each family (gpt3_tiny, llama_tiny), on the CPU (the reduction-order floor) and on the
   GPU with TF32 off beside a plain PyTorch loop; and a real one-node ``python -m oobleck.run
   cluster.device=cuda`` (``exactness.py`` argues the tolerances).
3. ``recovery``: a real ``python -m oobleck.run`` of several local nodes on the one device (llama_tiny,
   f=1), node 1 SIGKILLed during a backward pass and recovered in place, its losses and final
   parameters against the CPU reference; the backend it used and why.
4. ``profile``: per-layer forward, backward, and backward split into input and weight passes, of
   gpt2_medium, gpt3_medium and llama3_8b (one block each) by microbatch size, fp32 and bf16
   autocast, against the analytic profile of this GPU's ``conf/gpu/`` entry: the achieved fraction
   of peak per layer type and pass, and the ``achieved_flop_fraction`` the measurement implies.
5. ``restart``: a restarted worker's parts, each timed in a fresh process: process start and torch
   import, CUDA context, group creation (gloo; NCCL), the model's layers built, a checkpoint of
   known size read from local disk (bytes/s, page cache evicted), the first step beyond a steady
   one; a fresh start's seeded initialisation; the device-to-host copy rate.
6. ``lifecycle.loop``: 25 generations of group build, pending op, abort and release; threads, fds
   and memory flat. ``lifecycle.peer_death``: from a peer's SIGKILL to a usable new group.
7. ``throughput``: executor against a plain loop, samples/s.
8. ``lifecycle.absent_peer_*`` (CUDA): ways of getting a genuinely pending NCCL op and aborting it.

``--quick`` keeps the whole run within about six minutes on an H200 (a 15-minute device lease
with room for a rerun of a part) and a few minutes on a small CPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_units, beside this script
# The test helpers (testing/) come from the checkout, which `python benchmarks/gpu_check.py` does
# not put on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from gpu_check_units import exactness, layers, lifecycle, nccl, restart, throughput
from gpu_check_units.common import FULL, NCCL_ENV, QUICK, REPO, Settings, cuda_reason, scrub, spawn, tail


@dataclass(frozen=True)
class Unit:
    name: str  # report path: "part" or "part.sub"
    run: Callable[[Settings, dict[str, Any]], dict[str, Any]]
    needs_cuda: bool
    timeout: str  # key of Settings.unit_timeout_s


UNITS = (  # in order of importance: a spent budget skips the last ones
    Unit("backends", nccl.unit_backends, needs_cuda=True, timeout="backends"),
    Unit("exactness", exactness.unit_exactness, needs_cuda=False, timeout="exactness"),
    Unit("recovery", exactness.unit_recovery, needs_cuda=False, timeout="recovery"),
    Unit("profile", layers.unit_layers, needs_cuda=False, timeout="profile"),
    Unit("restart", restart.unit_restart, needs_cuda=False, timeout="restart"),
    Unit("lifecycle.loop", lifecycle.unit_lifecycle_loop, needs_cuda=False, timeout="lifecycle"),
    Unit("lifecycle.peer_death", lifecycle.unit_peer_death, needs_cuda=False, timeout="lifecycle"),
    Unit("throughput", throughput.unit_throughput, needs_cuda=False, timeout="throughput"),
    *(
        Unit(
            f"lifecycle.absent_peer_{init}_init",
            functools.partial(nccl.unit_absent_peer, init=init),
            needs_cuda=True,
            timeout="experiment",
        )
        for init in ("lazy", "eager", "nonblocking")
    ),
)
UNIT_NAMES = tuple(u.name for u in UNITS)


def run_unit(unit: Unit, quick: bool, timeout_s: float, report: dict[str, Any]) -> dict[str, Any]:
    """Run ``unit`` in a fresh process (its own CUDA context, threads and fds), bounded by
    ``timeout_s``; it reads the report so far (a later unit uses an earlier one's answer)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, context = Path(tmp) / "unit.json", Path(tmp) / "context.json"
        context.write_text(json.dumps(scrub(report), default=str))
        command = [sys.executable, __file__, "--unit", unit.name, "--unit-out", str(out), "--context", str(context)]
        command += ["--quick"] if quick else []
        env = {**NCCL_ENV, **os.environ}  # as a worker sets it for NCCL (harmless for gloo)
        started = time.perf_counter()
        proc = spawn(command, env)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return {
                "status": "timeout",
                "reason": f"did not finish within its {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - started,
                "log_tail": tail(output),
            }
        wall_s = time.perf_counter() - started
        if not out.exists():
            return {
                "status": "failed",
                "reason": f"exited with {proc.returncode} without a result",
                "wall_s": wall_s,
                "log_tail": tail(output),
            }
        result = json.loads(out.read_text())
        result["wall_s"] = wall_s
        if result.get("status") == "failed":
            result["log_tail"] = tail(output)
        return result


def unit_main(name: str, out: Path, context: Path | None, settings: Settings) -> None:
    """Inside a unit's process: run it and write its result (a failure becomes a result too)."""
    unit = next(u for u in UNITS if u.name == name)
    try:
        result = unit.run(settings, json.loads(context.read_text()) if context else {})
    except Exception as error:
        result = {
            "status": "failed",
            "reason": f"{type(error).__name__}: {error}"[:4000],
            "traceback": traceback.format_exc()[-6000:],
        }
    out.write_text(json.dumps(scrub(result), indent=1, default=str))


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where there is none."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    return None


def meta(settings: Settings) -> dict[str, Any]:
    info: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "driver": driver_version(),
        "settings": asdict(settings),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_", "CUDA_VISIBLE"))},
    }
    with contextlib.suppress(Exception):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            device_memory_gib=props.total_memory / (1 << 30),
            nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None,
        )
    return info


def put(report: dict[str, Any], name: str, value: dict[str, Any]) -> None:
    part, _, sub = name.partition(".")
    if sub:
        report.setdefault(part, {})[sub] = value
    else:
        report[part] = value


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(scrub(report), indent=1, default=str))
    temporary.replace(path)


def summary_line(name: str, result: dict[str, Any]) -> str:
    status = result.get("status")
    if status != "ok":
        return f"{name}: {status} ({result.get('reason', '')})"
    keys = (
        "passed",
        "backend",
        "ratio",
        "summary",
        "kill_to_usable_group_s",
        "genuinely_pending_and_abortable",
        "nccl_allowed_two_ranks_on_one_gpu",
        "outcomes",
    )
    shown = {k: result[k] for k in keys if k in result}
    return f"{name}: ok {json.dumps(scrub(shown), default=str)} in {result.get('wall_s', 0):.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"), help="the JSON report to write")
    parser.add_argument(
        "--quick", action="store_true", help="sizes for a 15-minute device lease (about six minutes on an H200)"
    )
    parser.add_argument("--only", nargs="+", choices=UNIT_NAMES, help="run only these units")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget of all units (default: 360 quick, 1200 full)")
    hidden = argparse.SUPPRESS
    parser.add_argument("--unit", choices=UNIT_NAMES, help=hidden)
    parser.add_argument("--unit-out", type=Path, help=hidden)
    parser.add_argument("--context", type=Path, help=hidden)
    parser.add_argument("--nccl-rank", type=int, help=hidden)
    parser.add_argument("--peer-rank", type=int, help=hidden)
    parser.add_argument("--peer-ranks", type=int, help=hidden)
    parser.add_argument("--backend", help=hidden)
    parser.add_argument("--device", help=hidden)
    parser.add_argument("--store-port", type=int, help=hidden)
    parser.add_argument("--timeout-s", type=float, default=10.0, help=hidden)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.nccl_rank is not None:
        return nccl.nccl_rank_main(args.nccl_rank, args.store_port, args.timeout_s)
    if args.peer_rank is not None:
        return lifecycle.peer_main(
            args.peer_rank, args.peer_ranks, args.store_port, args.backend, args.device, args.timeout_s
        )
    if args.unit:
        unit_main(args.unit, args.unit_out, args.context, settings)
        return 0
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be > 0")
    budget = args.budget_s if args.budget_s is not None else settings.budget_s
    report: dict[str, Any] = {"meta": meta(settings)}
    reason = cuda_reason()
    deadline = time.monotonic() + budget
    for unit in UNITS:
        if args.only and unit.name not in args.only:
            continue
        left = deadline - time.monotonic()
        if unit.needs_cuda and reason:
            result: dict[str, Any] = {"status": "skipped", "reason": reason}
        elif left < 1.0:
            result = {
                "status": "skipped",
                "reason": f"the --budget-s={budget:.0f} s of this run was spent before this unit",
            }
        else:
            result = run_unit(unit, settings.quick, min(settings.timeout(unit.timeout), left), report)
        put(report, unit.name, result)
        report["meta"]["wall_s"] = budget - (deadline - time.monotonic())
        write_report(args.out, report)
        print(summary_line(unit.name, result), flush=True)
    write_report(args.out, report)
    print(f"report: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A unit may leave threads blocked in NCCL or gloo (that is what some of them probe): do not
    # wait for them at interpreter exit.
    os._exit(code)
