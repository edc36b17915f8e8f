"""Simulator accuracy against real runs of every strategy the paper experiments simulate, out of
sample (issues 6, 13 and 26: throughput within 15%, recovery, failover, re-route, restart and
checkpoint times within 50%).

    python benchmarks/bench_validation.py [--out DIR] [--only oobleck varuna bamboo recycle] [--repeats N]

Runs the protocol of analysis/README.md back to back on this machine: calibration runs, on which
``oobleck.sim.validate.calibrate_runs`` measures the runtime's terms (step overhead, the fixed
parts of reconfigurations, failovers and restarts, checkpoint and restore bandwidths, Bamboo's
exposed redundant forward), and other runs (different node counts, failure steps, layouts),
which the simulator then predicts with those terms: exactly what each real run did (its nodes,
its membership changes at their times, its measured profile, its own strategy config and
checkpoint interval). It prints the ``predicted`` rows of ``analysis.validation`` and how many are
within target. It is a benchmark, not a test: the runtime's step time follows other jobs' load on
the shared cores (up to 2-3x), so the figures are only meaningful when every run saw the same
load; the load average before and after is printed with them. ``--repeats N`` runs the whole
protocol N times, interleaved (every calibration and predicted run once, then again), pools all
the calibration runs into one calibration, predicts every run, and judges each row by the
median ratio over its repeats (``analysis.validation.across_repeats``, written to
``repeats.csv``): a load that comes and goes then moves one repeat, not the row.

Three sets: the calibration runs (the model's terms are measured on them only), the development
set (the runs the model's form was developed on, scored again and again) and the pre-registered
held-out set (``benchmarks/validation_holdout.yaml``: fixed before the model last changed, never
used to choose its form, run once: ``--holdout-repeats``). The held-out set's score is printed
apart from the development set's (``oobleck.sim.holdout.scores``); ``table.csv`` has a ``set`` column.

Calibration: C1 Oobleck, 3 nodes, 20 steps, a node killed at step 5; C2 Oobleck, 3 nodes,
batch 8, no failure; C3 Oobleck, 7 nodes, 24 steps, a node killed at step 12; VC Varuna, 3
nodes, a checkpoint every 5 steps, a node killed at step 30; BC Bamboo (lazy, its default), 4
nodes of depth 2, a stage killed at step 10 (failover). Predicted: D the default job (30 steps,
kill at 10); E Oobleck 5 nodes, 30 steps, kill at 10; F Oobleck 4 nodes, 28 steps, kill at 8; VP
Varuna 4 nodes, a checkpoint every 4 steps, a node killed at step 38; BP Bamboo lazy, 6 nodes of
depth 3, a stage killed at step 14; BPE the same in eager mode (the redundant forward in the
bubbles); RP ReCycle, 6 nodes of D=2 x P=3, stage 1 of pipeline 1 killed at step 12 (re-routed
through pipeline 0). ReCycle has no calibration run of its own: a re-route is charged as a
reconfiguration's fixed part, measured on the Oobleck runs. BC, BP, BPE and RP are not in the
pre-registered held-out set (their cases and modes came after it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOLDOUT_FILE = Path(__file__).resolve().parent / "validation_holdout.yaml"

CALIBRATION = {
    "C1": (
        "oobleck",
        ["cluster.nodes=3", "job.steps=20", "failures=explicit", "failures.events=[{action:remove,step:5,count:1}]"],
    ),
    "C2": ("oobleck", ["cluster.nodes=3", "job.steps=12", "job.global_batch_size=8", "failures=none"]),
    # Deeper pipelines than C1's (3 + 2 + 2 stages, then 2 + 1 + 1 + 1 + 1): the per-microbatch and
    # per-worker terms are told apart by layouts of many stage runs, not by C1's 2 + 1 alone.
    "C3": (
        "oobleck",
        ["cluster.nodes=7", "job.steps=24", "failures=explicit", "failures.events=[{action:remove,step:12,count:1}]"],
    ),
    # A restarted worker boots for several seconds here: keep steps after the restart.
    "VC": (
        "varuna",
        [
            "strategy=varuna",
            "cluster.nodes=3",
            "job.steps=60",
            "checkpoint.every_steps=5",
            "failures=explicit",
            "failures.events=[{action:remove,step:30,count:1}]",
        ],
    ),
    "BC": (
        "bamboo",
        [
            "strategy=bamboo",
            "strategy.redundancy=lazy",
            "strategy.pipeline_depth=2",
            "cluster.nodes=4",
            "job.steps=30",
            "checkpoint.every_steps=10",
            "failures=explicit",
            "failures.events=[{action:remove,step:10,nodes:[1]}]",
        ],
    ),
}
PREDICTED = {
    "D": ("oobleck", ["failures=demo"]),
    # 20 steps after the failure, as D has: the throughput window is then mostly steady steps,
    # not the one recovery (whose error, held to 50%, a short window inherits one for one).
    "E": (
        "oobleck",
        ["cluster.nodes=5", "job.steps=30", "failures=explicit", "failures.events=[{action:remove,step:10,count:1}]"],
    ),
    "F": (
        "oobleck",
        ["cluster.nodes=4", "job.steps=28", "failures=explicit", "failures.events=[{action:remove,step:8,count:1}]"],
    ),
    "VP": (
        "varuna",
        [
            "strategy=varuna",
            "cluster.nodes=4",
            "job.steps=70",
            "checkpoint.every_steps=4",
            "failures=explicit",
            "failures.events=[{action:remove,step:38,count:1}]",
        ],
    ),
    "BP": (
        "bamboo",
        [
            "strategy=bamboo",
            "strategy.redundancy=lazy",
            "strategy.pipeline_depth=3",
            "cluster.nodes=6",
            "job.steps=36",
            "checkpoint.every_steps=12",
            "failures=explicit",
            "failures.events=[{action:remove,step:14,nodes:[4]}]",
        ],
    ),
    "BPE": (
        "bamboo",
        [
            "strategy=bamboo",
            "strategy.redundancy=eager",
            "strategy.pipeline_depth=3",
            "cluster.nodes=6",
            "job.steps=36",
            "checkpoint.every_steps=12",
            "failures=explicit",
            "failures.events=[{action:remove,step:14,nodes:[4]}]",
        ],
    ),
    # Node 4 is stage 1 of pipeline 1: a middle stage, re-routed through pipeline 0's.
    "RP": (
        "recycle",
        [
            "strategy=recycle",
            "strategy.pipeline_depth=3",
            "cluster.nodes=6",
            "job.steps=36",
            "checkpoint.every_steps=12",
            "failures=explicit",
            "failures.events=[{action:remove,step:12,nodes:[4]}]",
        ],
    ),
}


def holdout_cases(path: Path = HOLDOUT_FILE) -> dict[str, tuple[str, list[str]]]:
    """The pre-registered held-out cases, as ``PREDICTED`` holds the development set's."""
    from oobleck.sim.holdout import read_holdout

    cases = read_holdout(path)
    clash = sorted(set(cases) & (set(CALIBRATION) | set(PREDICTED)))
    if clash:
        raise SystemExit(f"{path}: cases {clash} reuse a calibration or development name")
    return {name: (case.strategy, list(case.overrides)) for name, case in cases.items()}


def run(out: Path, name: str, overrides: list[str], repeats: int) -> None:
    # Every run plans with one profile, measured by the first run into this benchmark's own cache
    # (a profile measured earlier under other load would skew every prediction alike).
    command = [
        sys.executable,
        "-m",
        "oobleck.run",
        f"hydra.run.dir={out / name}",
        "logger.progress_bar=false",
        "logger.wandb.mode=disabled",
        f"profile.cache_dir={out / 'profiles'}",
        f"profile.repeats={repeats}",
        *overrides,
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        raise SystemExit(result.returncode)
    # The 1-minute load average after each run: the model assumes one load for the whole protocol
    # (RuntimeOverhead.background_load), so a load that moved between runs explains misses.
    print(f"ran {name}; load average {os.getloadavg()[0]:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="outputs/bench_validation", help="directory for the run dirs and table.csv")
    parser.add_argument(
        "--only",
        nargs="+",
        default=["oobleck", "varuna", "bamboo", "recycle"],
        help="strategies whose runs to predict",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="do not rerun run dirs that exist already (only re-validate)"
    )
    parser.add_argument(
        "--profile-repeats",
        type=int,
        default=21,
        help="timed repeats per layer of the shared measured profile (median)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the whole protocol, interleaved; rows judged by the median ratio",
    )
    parser.add_argument(
        "--holdout-repeats",
        type=int,
        default=1,
        help="runs of the pre-registered held-out set (0: leave it out); its own repeats, after the others",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run the protocol at least once")
    if args.holdout_repeats < 0:
        parser.error(f"--holdout-repeats {args.holdout_repeats}: 0 leaves the held-out set out")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    # Calibration runs of the strategies predicted (Oobleck's always: it measures the step overhead).
    calibration = {k: v for k, v in CALIBRATION.items() if v[0] in {"oobleck", *args.only}}
    predicted = {k: v for k, v in PREDICTED.items() if v[0] in args.only}
    holdout = {k: v for k, v in holdout_cases().items() if v[0] in args.only} if args.holdout_repeats else {}

    def run_dir(name: str, repeat: int) -> Path:  # repeat 0 keeps the single run's layout
        return out / (name if repeat == 0 else f"{name}-r{repeat}")

    def ensure(name: str, overrides: list[str], repeat: int) -> None:
        if not (args.reuse and (run_dir(name, repeat) / "summary.json").is_file()):
            run(out, run_dir(name, repeat).name, overrides, args.profile_repeats)

    for repeat in range(args.repeats):
        for name, (_, overrides) in {**calibration, **predicted}.items():
            ensure(name, overrides, repeat)
    for repeat in range(args.holdout_repeats):
        for name, (_, overrides) in holdout.items():
            ensure(name, overrides, repeat)
    print(f"load average after: {os.getloadavg()}")
    from analysis.validation import across_repeats, validation_table
    from oobleck.sim.holdout import DEVELOPMENT, HOLDOUT, scores

    runs = [run_dir(n, k) for k in range(args.repeats) for n in predicted]
    runs += [run_dir(n, k) for k in range(args.holdout_repeats) for n in holdout]
    table = validation_table([run_dir(n, k) for k in range(args.repeats) for n in calibration], runs)
    table["run"] = [Path(run).name for run in table["run"]]
    table["case"] = [run.split("-r")[0] for run in table["run"]]
    cases = {**predicted, **holdout}
    table["strategy"] = table["case"].map({name: strategy for name, (strategy, _) in cases.items()})
    table["set"] = [HOLDOUT if case in holdout else DEVELOPMENT for case in table["case"]]
    print(f"runtime overhead: {table.attrs['runtime']}")
    print(table.drop(columns=["calibration"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    table.to_csv(out / "table.csv", index=False)
    print(f"written {out / 'table.csv'}")
    for _, row in scores(table).iterrows():
        name = "held-out (pre-registered)" if row["set"] == HOLDOUT else str(row["set"])
        print(f"{name}: {row['within_target']} of {row['rows']} rows within target")
    if args.repeats > 1:
        development = table[table["set"] == DEVELOPMENT]
        summary = across_repeats(development)
        print(summary.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        summary.to_csv(out / "repeats.csv", index=False)
        print(
            f"development set, by the median over {args.repeats} repeats: {int(summary['within_target'].sum())} of "
            f"{len(summary)} rows within target; written {out / 'repeats.csv'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
