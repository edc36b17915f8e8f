"""The measurement protocol of every real strategy comparison (bench_strategies, bench_attribution).

A ratio between two strategies measured on this small shared machine is set as much by the
schedule, the host's load and chance as by the strategies, unless each of these is the same for
both and the measurement is repeated. So a comparison here is:

- **repeats, interleaved**: ``repeats`` rounds (at least ``MIN_REPEATS``); each round runs every
  configuration once, in an order rotated by one per round, so a slow spell of the host falls on
  a different configuration each time instead of on the same one;
- **failure steps at seeded random offsets**: each round draws its failure steps with
  ``random.Random(seed + round)``, one per equal window of the run's middle, never on a step that
  is a multiple of any compared strategy's checkpoint interval (a loss right at a boundary is one
  strategy's best or worst case, not a typical one); every configuration of a round gets the
  same draws;
- **the same detection for every strategy**: one ``cluster.heartbeat_timeout_s`` (it also governs
  torchft's lighthouse) and one schedule;
- **crash and hang apart**: the same draws run once as crashes (``remove``: SIGKILL, seen at once
  from the agent's closed socket) and once as hangs (``freeze``: SIGSTOP, seen after the
  heartbeat timeout), reported in separate rows;
- **the host recorded**: every run's summary.json ``host`` object (cores, load at start and end,
  the run's processes); ``analysis.comparison`` warns on load above the cores and flags ratios
  measured with more training processes than cores.

Each run's place in the protocol goes to ``protocol.json`` beside the run dirs (``Manifest``),
which ``python -m analysis.comparison DIR`` reads to pair each run with its round's reference.
Pure except ``run_protocol`` (it launches the runs), ``tiny_launcher`` (what it returns launches
one) and ``checkpoint_interval`` (it composes a config). A benchmark that reads more of a run than
protocol.json and the run dir hold (its ``Outcome``) hands ``tiny_launcher`` a ``results`` dict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIN_REPEATS = 3
# The schedule's actions for each fault type (oobleck.faults.schedule); "none" is the steady state.
FAULT_ACTIONS = {"crash": "remove", "hang": "freeze", "none": None}
MANIFEST = "protocol.json"
GLOBAL_BATCH = 48  # samples per step; each strategy splits it over its pipelines its own way
# Failures strike inside this part of the run: after the warm-up and the first checkpoint, and
# early enough that every strategy runs steadily again before the end.
FAILURE_SPAN = (0.2, 0.8)


@dataclass(frozen=True)
class Variant:
    """One configuration compared: a strategy with its settings (``overrides``: dotted config keys)."""

    name: str
    strategy: str
    overrides: tuple[tuple[str, Any], ...] = ()
    switch: str = ""  # the fairness switch this variant turns, for the attribution table
    notice_s: float = 0.0  # seconds of preemption notice on every removal of its schedule

    def settings(self) -> dict[str, Any]:
        return dict(self.overrides)


@dataclass(frozen=True)
class Round:
    """One repeat: its index, the order its configurations run in, and its failure steps."""

    index: int
    order: tuple[str, ...]
    failure_steps: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """protocol.json: the protocol's parameters and one entry per run."""

    seed: int
    steps: int
    nodes: int
    heartbeat_timeout_s: float
    checkpoint_intervals: dict[str, int]
    reference: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def write(self, out: Path) -> None:
        (out / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")


def rotated(names: Sequence[str], index: int) -> tuple[str, ...]:
    """``names`` rotated left by ``index``: round k starts with the k-th configuration."""
    if not names:
        return ()
    shift = index % len(names)
    return tuple(names[shift:]) + tuple(names[:shift])


def on_boundary(step: int, intervals: Sequence[int]) -> bool:
    """Whether ``step`` is a multiple of any positive checkpoint interval."""
    return any(k > 0 and step % k == 0 for k in intervals)


def draw_failure_steps(rng: random.Random, steps: int, count: int, intervals: Sequence[int]) -> tuple[int, ...]:
    """``count`` increasing failure steps, one drawn uniformly from each of ``count`` equal windows
    of ``FAILURE_SPAN`` of the run, none on a checkpoint boundary of ``intervals``."""
    low, high = int(steps * FAILURE_SPAN[0]), int(steps * FAILURE_SPAN[1])
    width = (high - low) // max(count, 1)
    if count < 1 or width < 2:
        raise ValueError(f"steps={steps}: too few for {count} failure(s) in windows of >=2 steps; raise --steps")
    drawn = []
    for window in range(count):
        start = low + window * width
        choices = [s for s in range(start, start + width) if s > 0 and not on_boundary(s, intervals)]
        if not choices:
            raise ValueError(
                f"steps={steps}: window {start}..{start + width - 1} holds only checkpoint boundaries of "
                f"{list(intervals)}; raise --steps"
            )
        drawn.append(rng.choice(choices))
    return tuple(drawn)


def plan_rounds(
    names: Sequence[str], *, steps: int, failures: int, intervals: Sequence[int], repeats: int, seed: int
) -> list[Round]:
    """The protocol's rounds (module docstring)."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats}: a spread needs at least {MIN_REPEATS} repeats")
    return [
        Round(i, rotated(names, i), draw_failure_steps(random.Random(seed + i), steps, failures, intervals))
        for i in range(repeats)
    ]


def fault_events(fault: str, failure_steps: Sequence[int], notice_s: float = 0.0) -> list[dict[str, Any]]:
    """The schedule of one run: one node lost (``crash``) or hung (``hang``) at each step."""
    if fault not in FAULT_ACTIONS:
        raise ValueError(f"fault={fault!r}: use one of {sorted(FAULT_ACTIONS)}")
    action = FAULT_ACTIONS[fault]
    if action is None:
        return []
    events = []
    for step in failure_steps:
        event: dict[str, Any] = {"action": action, "step": int(step), "count": 1}
        if notice_s > 0 and action == "remove":
            event["notice_s"] = float(notice_s)
        events.append(event)
    return events


def checkpoint_interval(variant: Variant) -> int:
    """The variant's effective checkpoint interval, as a run of it decides it."""
    from oobleck.strategy import checkpoint_every_steps
    from testing import tiny_config

    return checkpoint_every_steps(tiny_config(f"strategy={variant.strategy}", **variant.settings()))


@dataclass(frozen=True)
class RunResult:
    """One finished run, for a benchmark that reads more than its run dir: the dir, its config, its
    ``oobleck.elastic.ledger.Outcome`` and the host's load average at its start and end."""

    run_dir: Path
    cfg: Any
    outcome: Any
    load: tuple[float, float]


def tiny_run_config(
    variant: Variant,
    events: list[dict[str, Any]],
    *,
    steps: int,
    nodes: int,
    heartbeat_timeout_s: float,
    profiles: Path,
    fault_tolerance: int = 2,
) -> Any:
    """The config of one run of ``variant``: gpt3_tiny on ``nodes`` local nodes, the failure
    schedule ``events``, the profile measured once into ``profiles``."""
    from testing import tiny_config

    return tiny_config(
        f"strategy={variant.strategy}",
        **{
            "profile.cache_dir": str(profiles),
            "cluster.nodes": nodes,
            "cluster.heartbeat_timeout_s": heartbeat_timeout_s,
            "job.fault_tolerance": fault_tolerance,
            "job.steps": steps,
            "job.global_batch_size": GLOBAL_BATCH,
            "runtime.save_final_params": False,
            "failures.kind": "explicit" if events else "none",
            "failures.events": events,
            **variant.settings(),
        },
    )


def tiny_launcher(
    *,
    steps: int,
    nodes: int,
    heartbeat_timeout_s: float,
    profiles: Path,
    fault_tolerance: int = 2,
    results: dict[Path, RunResult] | None = None,
) -> Callable[[Variant, list[dict[str, Any]], Path], None]:
    """Launches one run (``tiny_run_config``): every variant plans with the same measured profile
    (the first run measures it into ``profiles``) and detects with the same heartbeat timeout.
    With ``results``, each finished run's ``RunResult`` goes there under its run dir."""

    def launch_run(variant: Variant, events: list[dict[str, Any]], run_dir: Path) -> None:
        from oobleck.elastic.job import launch

        cfg = tiny_run_config(
            variant,
            events,
            steps=steps,
            nodes=nodes,
            heartbeat_timeout_s=heartbeat_timeout_s,
            profiles=profiles,
            fault_tolerance=fault_tolerance,
        )
        before = os.getloadavg()[0]
        outcome, _ = launch(cfg, run_dir)
        if results is not None:
            results[run_dir] = RunResult(run_dir, cfg, outcome, (before, os.getloadavg()[0]))

    return launch_run


def runs_by_repeat(
    manifest: Manifest, out: Path, fault: str, results: dict[Path, RunResult]
) -> list[dict[str, RunResult]]:
    """Per repeat, variant name -> the result of its run under ``fault`` (runs that failed left out)."""
    rounds: dict[int, dict[str, RunResult]] = {}
    for run in manifest.runs:
        result = results.get(out / run["path"])
        if run["fault"] == fault and result is not None:
            rounds.setdefault(run["repeat"], {})[run["variant"]] = result
    return [rounds[repeat] for repeat in sorted(rounds)]


def run_protocol(
    variants: Sequence[Variant],
    *,
    faults: Sequence[str],
    steps: int,
    failures: int,
    repeats: int,
    seed: int,
    out: Path,
    launch_run: Callable[[Variant, list[dict[str, Any]], Path], None],
    reference: str,
    nodes: int,
    heartbeat_timeout_s: float,
    crash_only: frozenset[str] | set[str] = frozenset(),
) -> Manifest:
    """Run every variant under every fault type in interleaved rounds (the variants named in
    ``crash_only`` not under the others); write protocol.json as the runs finish (a stopped
    benchmark leaves the finished runs readable)."""
    by_name: Mapping[str, Variant] = {v.name: v for v in variants}
    intervals = {v.name: checkpoint_interval(v) for v in variants}
    rounds = plan_rounds(
        list(by_name),
        steps=steps,
        failures=failures,
        intervals=sorted(set(intervals.values())),
        repeats=repeats,
        seed=seed,
    )
    manifest = Manifest(seed, steps, nodes, heartbeat_timeout_s, intervals, reference)
    for rnd in rounds:
        for fault in faults:
            for position, name in enumerate(n for n in rnd.order if fault == "crash" or n not in crash_only):
                variant = by_name[name]
                run_dir = out / f"r{rnd.index}-{fault}" / name
                events = fault_events(fault, rnd.failure_steps, variant.notice_s)
                started = time.time()
                where = f"at steps {list(rnd.failure_steps)}" if events else "(no failures)"
                print(f"round {rnd.index} {fault:5s} {name:24s} {where}", flush=True)
                error = ""
                try:
                    launch_run(variant, events, run_dir)
                except Exception as failure:  # record it and go on: one broken run must not void the rest
                    error = f"{type(failure).__name__}: {failure}"
                    print(f"  failed: {error}", flush=True)
                manifest.runs.append(
                    {
                        "path": str(run_dir.relative_to(out)),
                        "variant": name,
                        "strategy": variant.strategy,
                        "switch": variant.switch,
                        "settings": {k: v for k, v in variant.overrides},
                        "notice_s": variant.notice_s,
                        "fault": fault,
                        "repeat": rnd.index,
                        "position": position,
                        "failure_steps": list(rnd.failure_steps),
                        "wall_s": round(time.time() - started, 2),
                        "error": error,
                    }
                )
                manifest.write(out)
    return manifest


def add_protocol_arguments(parser: argparse.ArgumentParser, *, steps: int, nodes: int, failures: int) -> None:
    """The arguments of every benchmark that runs the protocol with ``tiny_launcher``."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--nodes", type=int, default=nodes)
    parser.add_argument("--failures", type=int, default=failures, help="failures per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="keep the run dirs here (default: a temporary dir)")


def protocol_out(out: str | None, prefix: str) -> Path:
    """The benchmark's dir (``--out``, else a new temporary one), created; wandb stays off unless
    the environment turns it on."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    path = (Path(out) if out else Path(tempfile.mkdtemp(prefix=f"{prefix}-"))).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_tiny_protocol(
    variants: Sequence[Variant],
    args: argparse.Namespace,
    out: Path,
    *,
    faults: Sequence[str],
    fault_tolerance: int = 2,
    results: dict[Path, RunResult] | None = None,
    crash_only: frozenset[str] | set[str] = frozenset(),
) -> Manifest:
    """``run_protocol`` of ``variants`` launched by ``tiny_launcher``, sized by the arguments
    ``add_protocol_arguments`` added; Oobleck is the reference."""
    launch_run = tiny_launcher(
        steps=args.steps,
        nodes=args.nodes,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        profiles=out / "profiles",
        fault_tolerance=fault_tolerance,
        results=results,
    )
    return run_protocol(
        variants,
        faults=faults,
        steps=args.steps,
        failures=args.failures,
        repeats=args.repeats,
        seed=args.seed,
        out=out,
        launch_run=launch_run,
        reference="oobleck",
        nodes=args.nodes,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        crash_only=crash_only,
    )
