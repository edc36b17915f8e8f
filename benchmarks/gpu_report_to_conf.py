"""Put what a GPU check measured into ``conf/``: the measured point of each uncertain constant.

    python benchmarks/gpu_report_to_conf.py REPORT.json [--out conf/measured/<device>.yaml] [--allow-cpu]

Reads the JSON report of ``benchmarks/gpu_check.py`` and writes one YAML file with a ``source``
(the report, the device's name, torch, CUDA, NCCL and driver versions, the commit, when) and, for
every row of ``MAPPING`` the report measured, the config key, its value, unit and the report field
it came from; a row the report could not measure (a unit skipped, failed or out of budget) is
listed under ``not_measured`` with the reason. A report measured without CUDA (the CPU rehearsal)
is refused unless ``--allow-cpu``: its figures are a CPU's, not a GPU's.

``MAPPING`` is the seam to the simulator's declared uncertain constants: each row names the report
field(s) and the config key whose range the value is the measured point of. The keys follow
``oobleck/recovery_costs.py``'s ``CostConstants`` where it has the constant (``host_copy_gbps``,
``storage_read_gbps``, ``restart_warmup_s``) and ``cluster.gpu.achieved_flop_fraction``; the
others name the restart components and the group rebuild the simulator's constants are split into.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Measured:
    """Config key <- report field(s): ``fields`` (dotted paths into the report) combined by ``combine``."""

    key: str
    fields: tuple[str, ...]
    unit: str
    what: str
    combine: Callable[[list[float]], float] = sum


MAPPING = (
    Measured(
        "cluster.gpu.achieved_flop_fraction",
        ("profile.summary.achieved_flop_fraction_bf16_autocast",),
        "fraction of the dense bf16 peak",
        "what the analytic profiles assume a layer achieves (median over gpt2_medium, gpt3_medium, llama3_8b and "
        "microbatch sizes, compute-bound layers, bf16 autocast)",
    ),
    Measured(
        "sim.costs.process_start_s",
        ("restart.process_start_s", "restart.torch_import_s", "restart.harness_import_s"),
        "s",
        "a worker process from spawn to ready: interpreter, torch and harness imports",
    ),
    Measured("sim.costs.cuda_context_s", ("restart.cuda_context_s",), "s", "a worker's CUDA context"),
    Measured(
        "sim.costs.group_init_s",
        ("restart.group_init_s.nccl",),
        "s",
        "a process group's creation and first collective (NCCL, one rank: the part that does not grow with nodes)",
    ),
    Measured(
        "sim.costs.model_build_s_per_gparam",
        ("restart.model_build_s", "restart.params"),
        "s per 1e9 parameters",
        "a restarted worker's layers and AdamW state allocated on the device, to be filled from a checkpoint",
        lambda values: values[0] / (values[1] / 1e9),
    ),
    Measured(
        "sim.costs.model_init_s_per_gparam",
        ("restart.model_init.s_per_gparam",),
        "s per 1e9 parameters",
        "a fresh start's seeded initialisation (drawn on the host, copied to the device)",
    ),
    Measured(
        "sim.costs.storage_read_gbps",
        ("restart.checkpoint.read_gbps",),
        "GB/s",
        "one node reading the runtime's checkpoint shards from local disk into the device, page cache evicted",
    ),
    Measured(
        "sim.costs.host_copy_gbps", ("restart.host_copy_gbps",), "GB/s", "device to pinned host memory (snapshot)"
    ),
    Measured(
        "sim.costs.restart_warmup_s",
        ("restart.first_step.extra_s",),
        "s",
        "a new worker's first step beyond a steady step",
    ),
    Measured(
        "sim.costs.reconfigure_groups_s",
        ("lifecycle.peer_death.kill_to_usable_group_s",),
        "s",
        "from a peer's SIGKILL to the survivors' first collective on a new group (detection by the exit)",
    ),
)


class ReportError(Exception):
    """A report this tool cannot use (one message: what and how to fix it)."""


def lookup(report: dict[str, Any], path: str) -> tuple[float | None, str | None]:
    """The number at ``path``, or None and why not (its unit's status and reason, or the reason
    the unit gives for the part it skipped: ``skipped_parts``, keyed by paths inside the unit)."""
    node: Any = report
    parts = path.split(".")
    unit: dict[str, Any] = {}
    unit_depth = 0
    for depth, part in enumerate(parts):
        if isinstance(node, dict) and "status" in node:
            if node["status"] != "ok":
                return None, f"{'.'.join(parts[:depth])}: {node['status']} ({node.get('reason', '')})"
            unit, unit_depth = node, depth
        if not isinstance(node, dict) or part not in node:
            inside = ".".join(parts[unit_depth:])
            why = next((r for name, r in unit.get("skipped_parts", {}).items() if inside.startswith(name)), None)
            return None, f"{path}: {why}" if why else f"{path} is not in the report"
        node = node[part]
    if node is None:
        return None, f"{path} was not measured (null in the report)"
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None, f"{path} is {node!r}, not a number"
    return float(node), None


def slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") or "device"


def measured_points(report: dict[str, Any], source: str, *, allow_cpu: bool = False) -> dict[str, Any]:
    """The YAML document: ``source``, ``measured`` (key -> value, unit, from, what), ``not_measured``."""
    meta = report.get("meta")
    if not isinstance(meta, dict):
        raise ReportError(f"{source} has no meta section: not a report of benchmarks/gpu_check.py")
    cuda = bool(meta.get("cuda_available"))
    if not cuda and not allow_cpu:
        raise ReportError(
            f"{source} was measured without CUDA (a CPU rehearsal): its figures are not a GPU's; run "
            "benchmarks/gpu_check.py on the GPU, or pass --allow-cpu to write them anyway"
        )
    document: dict[str, Any] = {
        "source": {
            "report": source,
            "device": meta.get("device", "cpu (rehearsal)") if cuda else "cpu (rehearsal)",
            "torch": meta.get("torch"),
            "cuda": meta.get("torch_cuda"),
            "nccl": meta.get("nccl"),
            "driver": meta.get("driver"),
            "commit": meta.get("commit"),
            "started": meta.get("started"),
            "quick": meta.get("settings", {}).get("quick"),
        },
        "measured": {},
        "not_measured": {},
    }
    for row in MAPPING:
        found = [lookup(report, field) for field in row.fields]
        missing = [str(why) for value, why in found if value is None]
        if missing:
            document["not_measured"][row.key] = "; ".join(missing)
            continue
        document["measured"][row.key] = {
            "value": row.combine([value for value, _ in found if value is not None]),
            "unit": row.unit,
            "from": " + ".join(row.fields) if len(row.fields) > 1 and row.combine is sum else ", ".join(row.fields),
            "what": row.what,
        }
    return document


def render(document: dict[str, Any]) -> str:
    src = document["source"]
    header = (
        "# The measured point of each uncertain constant, from a run of benchmarks/gpu_check.py on\n"
        f"# {src['device']}: torch {src['torch']}, CUDA {src['cuda']}, NCCL {src['nccl']}, driver {src['driver']},\n"
        f"# commit {src['commit']}, {src['started']}. Written by benchmarks/gpu_report_to_conf.py:\n"
        "# each key is a constant's config key, ``from`` the report field it was measured as.\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("report", type=Path, help="a JSON report of benchmarks/gpu_check.py")
    parser.add_argument("--out", type=Path, help="the YAML to write (default: conf/measured/<device>.yaml)")
    parser.add_argument("--allow-cpu", action="store_true", help="accept a CPU rehearsal's report")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        document = measured_points(report, str(args.report), allow_cpu=args.allow_cpu)
    except (OSError, json.JSONDecodeError, ReportError) as error:
        print(f"gpu_report_to_conf: error: {error}", file=sys.stderr)
        return 2
    out = args.out or REPO / "conf" / "measured" / f"{slug(document['source']['device'])}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(document))
    print(f"{len(document['measured'])} measured, {len(document['not_measured'])} not measured: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
