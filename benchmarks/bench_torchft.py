"""Oobleck against torchft (PyTorch's fault-tolerance library) on the same local cluster and schedule.

    python benchmarks/bench_torchft.py [--nodes 5] [--steps 300] [--out results.json] [--fault crash|hang]
        [--torchft strategy.heartbeat_timeout_ms=1000 ...] [--only oobleck|torchft|torchft_sync]

1. failures: gpt3_tiny on ``--nodes`` local nodes (f=2 for Oobleck), a global batch of 40 (20
   microbatches: 4 per replica group on 5 nodes, as torchft's fixed shards need), one run each of
   ``strategy=oobleck``, ``strategy=torchft`` in torchft's default mode (asynchronous quorum: the
   quorum overlaps the forward pass, each replica group trains its own shard) and with
   ``strategy.async_quorum=false`` (quorum first, the batch split over it), plus any ``--torchft``
   overrides; the same schedule: node 1 SIGKILLed in the backward pass of step 20, node 3
   SIGKILLed as step 40 starts, a new node joining at step 60; one heartbeat timeout
   (``cluster.heartbeat_timeout_s``, 10 s) for the harness and torchft's lighthouse and gloo
   timeout unless overridden. Side by side: throughput (committed samples over the training
   window, from the first to the last commit, and the median per-step rate), samples lost
   (torchft: batches of failed votes it drops and the shards of lost replicas; Oobleck:
   rolled-back steps), attempts thrown away, recovery time per failure (kill to the next
   committed step) and healing time per join (the joined node ready to the first step it trains).
2. too big for one node: the same cluster with cluster.device_memory_gb=0.006, where gpt3_tiny
   needs two nodes per replica (n0=2), no failures, 20 steps: Oobleck's pipelines (f=1) against
   torchft's replica groups of two nodes (``strategy.nodes_per_replica=2``, default mode).

``--fault hang`` runs the same schedule with the two nodes frozen (SIGSTOP) instead of killed: every
strategy then waits the heartbeat timeout, where a crash is seen at once by the harness and after
the timeout by torchft's lighthouse; the two are separate measurements, never one table. One run
of each column: for ratios with their spread over repeats use benchmarks/bench_attribution.py.

All columns are measured in the same invocation on the same machine, with the load average
printed before and after; the ratios are Oobleck / torchft. Under load from other jobs the
absolute numbers swing; compare within one run, and not at all when the load exceeds the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

# The test helpers (testing/) come from the checkout, which `python benchmarks/<name>.py` does not
# put on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEDULE = [
    {"action": "remove", "step": 20, "nodes": [1], "phase": "backward"},
    {"action": "remove", "step": 40, "nodes": [3]},
    {"action": "join", "step": 60, "count": 1},
]
COLUMNS = {
    "oobleck": ("oobleck", {}),
    "torchft": ("torchft", {}),
    "torchft_sync": ("torchft", {"strategy.async_quorum": False}),
}


def schedule(fault: str) -> list[dict[str, Any]]:
    """``SCHEDULE`` with its removals as crashes (SIGKILL) or hangs (``freeze``: SIGSTOP)."""
    action = {"crash": "remove", "hang": "freeze"}[fault]
    return [{**e, "action": action} if e["action"] == "remove" else e for e in SCHEDULE]


def bench_config(strategy: str, nodes: int, steps: int, overrides: dict[str, Any], fault: str = "crash"):
    from testing import tiny_config

    cfg = tiny_config(
        f"strategy={strategy}",
        **{
            "cluster.nodes": nodes,
            "job.steps": steps,
            "job.global_batch_size": 40,
            "job.microbatch_size": 2,
            "job.fault_tolerance": 2,
            "failures.kind": "explicit",
            "failures.events": schedule(fault),
            "cluster.heartbeat_timeout_s": 10.0,
            "cluster.collective_timeout_s": 60.0,
            **overrides,
        },
    )
    cfg.runtime.save_final_params = False
    return cfg


def measure(strategy: str, cfg: Any) -> dict[str, Any]:
    """One run: its throughput, losses, recoveries and heals from its own outputs."""
    from oobleck.elastic.job import launch

    with tempfile.TemporaryDirectory() as tmp:
        outcome, summary = launch(cfg, Path(tmp) / "run")
        metrics = pd.read_csv(Path(tmp) / "run" / "metrics.csv")
        torchft_report = Path(tmp) / "run" / "torchft.json"
        detection = json.loads(torchft_report.read_text())["detection"] if torchft_report.exists() else None
    window = float(metrics["time_s"].iloc[-1] - metrics["time_s"].iloc[0])
    samples = int(metrics["samples"].iloc[1:].sum())
    batch = int(cfg.job.global_batch_size)
    failures = [r for r in outcome.recoveries if r["removed"]]
    joins = [r for r in outcome.recoveries if r["joined"] and not r["removed"]]
    result: dict[str, Any] = {
        "strategy": strategy,
        "steps": len(metrics),
        "samples_per_s": round(samples / window, 1) if window > 0 else 0.0,
        "median_step_samples_per_s": summary["median_samples_per_s"],
        "samples_lost": int(metrics.get("skipped_samples", pd.Series([0])).sum())
        + int(summary.get("samples_rolled_back", 0)),
        "attempts_thrown_away": int((metrics["attempts"] - 1).sum()),
        "recovery_s": [round(r["total_s"], 3) for r in failures],
        "recovery_kinds": [r["kind"] for r in failures],
        "heal_s": [round(r["total_s"], 3) for r in joins],
        "joins_not_absorbed": summary.get("joins_not_absorbed", []),
        "generations": summary["generations"],
        "detection": detection["source"]
        if detection
        else f"cluster.heartbeat_timeout_s={cfg.cluster.heartbeat_timeout_s:g}",
    }
    if "join_to_heal_s" in metrics:  # torchft: the joiner reports its own heal (no new generation)
        healed = metrics[metrics["healed"].astype(str) != "[]"]
        result["heal_s"] = [round(float(v), 3) for v in healed["join_to_heal_s"]]
        result["heal_transfer_s"] = [round(float(v), 3) for v in healed["heal_s"]]
        result["samples_lost_batches"] = int(metrics["skipped_batches"].sum())
    result["attempt_samples_thrown_away"] = result["attempts_thrown_away"] * batch
    # Where the workers' step time went (summed over the workers that finished), in shares.
    phases: dict[str, float] = {}
    for seconds in outcome.phase_seconds.values():
        for name, value in seconds.items():
            phases[name] = phases.get(name, 0.0) + value
    total = sum(phases.values())
    result["phase_share"] = {name: round(value / total, 3) for name, value in phases.items()} if total else {}
    return result


def too_big(nodes: int) -> dict[str, Any]:
    from oobleck.elastic.job import make_strategy

    small = {"cluster.device_memory_gb": 0.006, "job.fault_tolerance": 1, "failures.events": [], "job.steps": 20}
    pairs = {**small, "strategy.nodes_per_replica": 2}
    oobleck = measure("oobleck", bench_config("oobleck", nodes, 20, small))
    torchft = measure("torchft", bench_config("torchft", nodes, 20, pairs))
    return {
        "oobleck_layout": make_strategy(bench_config("oobleck", nodes, 20, small))
        .start(range(nodes))
        .layout.description,
        "oobleck_samples_per_s": oobleck["samples_per_s"],
        "torchft_layout": make_strategy(bench_config("torchft", nodes, 20, pairs))
        .start(range(nodes))
        .layout.description,
        "torchft_samples_per_s": torchft["samples_per_s"],
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, list):
            return ", ".join(str(v) for v in value) or "-"
        if isinstance(value, dict):
            return (
                ", ".join(f"{k} {v:.0%}" for k, v in sorted(value.items(), key=lambda kv: -kv[1]) if v >= 0.01) or "-"
            )
        return "-" if value is None else str(value)

    rows = [
        ("committed samples/s (training window)", "samples_per_s"),
        ("median per-step samples/s", "median_step_samples_per_s"),
        ("samples lost (never trained)", "samples_lost"),
        ("attempts thrown away (redone / dropped)", "attempts_thrown_away"),
        ("recovery per failure, failure to next commit (s)", "recovery_s"),
        ("recovery kind", "recovery_kinds"),
        ("healing per join, node ready to training (s)", "heal_s"),
        ("detection timeout", "detection"),
        ("generations (new plans)", "generations"),
        ("share of worker step time per phase", "phase_share"),
    ]
    names = list(results)
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    lines += [f"| {label} | " + " | ".join(cell(results[n].get(key)) for n in names) + " |" for label, key in rows]
    return "\n".join(lines)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--torchft {item!r}: expected key=value, e.g. strategy.heartbeat_timeout_ms=1000")
        overrides[key] = yaml.safe_load(value)
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="long enough for the joining node to boot and heal")
    parser.add_argument("--torchft", nargs="*", default=[], help="overrides of both torchft runs, key=value")
    parser.add_argument("--only", choices=tuple(COLUMNS), help="run one column (no ratio)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--fault", choices=("crash", "hang"), default="crash", help="kill or freeze the two nodes")
    args = parser.parse_args()
    extra = parse_overrides(args.torchft)
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    results = {}
    for column, (strategy, overrides) in COLUMNS.items():
        if args.only in (None, column):
            more = extra if strategy == "torchft" else {}
            cfg = bench_config(strategy, args.nodes, args.steps, {**overrides, **more}, args.fault)
            results[column] = measure(column, cfg)
    print(
        f"\ngpt3_tiny, {args.nodes} local nodes, {args.steps} steps, global batch 40; {args.fault}: "
        f"{'kill' if args.fault == 'crash' else 'freeze'} node 1 (backward, step 20) and node 3 (step 40), "
        "one node joins (step 60)"
    )
    print(table(results))
    if "oobleck" in results:
        ours = results["oobleck"]
        for column in (c for c in results if c != "oobleck"):
            theirs = results[column]
            ratio = ours["samples_per_s"] / theirs["samples_per_s"] if theirs["samples_per_s"] else float("inf")
            recovery = (
                statistics.median(theirs["recovery_s"]) / statistics.median(ours["recovery_s"])
                if ours["recovery_s"] and theirs["recovery_s"]
                else None
            )
            print(
                f"oobleck / {column}: {ratio:.2f}x throughput"
                + (f"; median recovery {column} / oobleck: {recovery:.1f}x ({args.fault} faults)" if recovery else "")
            )
    big = too_big(args.nodes) if args.only is None else None
    if big:
        print("\ncluster.device_memory_gb=0.006 (gpt3_tiny needs 2 nodes per replica), 20 steps, no failures:")
        print(f"  oobleck: {big['oobleck_layout']}, {big['oobleck_samples_per_s']} samples/s")
        print(f"  torchft: {big['torchft_layout']}, {big['torchft_samples_per_s']} samples/s")
    print(f"load average after: {os.getloadavg()}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({**results, "too_big": big}, indent=1))


if __name__ == "__main__":
    main()
