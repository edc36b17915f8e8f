"""Validation against a real run, exercised on run dirs written from files (no runtime needed):
a run that behaves exactly as simulated validates, a 30% slower one does not."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from oobleck.errors import RunError
from oobleck.planning.instantiate import instantiate
from oobleck.planning.synthetic import synthetic_profile
from oobleck.sim.validate import compare, validate_run

OVERRIDES = (
    "cluster.nodes=6",
    "cluster.device_memory_gb=2.0",
    "cluster.intra_node_bandwidth_gbps=10",
    "cluster.inter_node_bandwidth_gbps=1",
    "job.global_batch_size=64",
    "job.microbatch_size=1",
    "job.fault_tolerance=1",
)


def _write_run(cfg, run_dir: Path, *, slowdown: float, failure_step: int | None = 8, steps: int = 24) -> Path:
    """A run dir as ``python -m oobleck.run`` writes it, for an ideal runtime slowed by ``slowdown``."""
    from oobleck.sim.engine import decision_downtime
    from oobleck.sim.experiment import build_context, simulated_strategy
    from oobleck.strategy import RunState

    profile = synthetic_profile(12, seed=1)
    run_dir.mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    profile.save(run_dir / "profile.json")
    context = build_context(cfg, profile, 6, named_gpu=False)
    plan = instantiate(context.templates(), list(range(6)), 64, 1, 1)
    (run_dir / "plan.json").write_text(pd.Series({"plan": plan.to_dict()}).to_json())
    strategy = simulated_strategy(cfg, "oobleck", context)
    t, rows, events = 2.0, [], []
    layout = strategy.start(list(range(6))).layout
    for step in range(1, steps + 1):
        if failure_step is not None and step == failure_step:
            victim = layout.nodes[-1]
            # As the controller writes it: ``node`` (read back as a float column with gaps).
            events.append({"time_s": t, "kind": "failure", "generation": 0, "step": step, "node": victim})
            decision = strategy.on_change(RunState(layout, tuple(n for n in layout.nodes if n != victim), (victim,), (), step=step))
            layout = decision.layout
            recovery = (decision_downtime(decision, strategy)[0] + layout.iteration_s) * slowdown
            t += recovery
            events.append({"time_s": t, "kind": "reconfiguration", "generation": 1, "step": step, "total_s": recovery})
            rows.append({"step": step, "time_s": t, "samples": 64, "generation": 1})
            continue
        t += layout.iteration_s * slowdown
        rows.append({"step": step, "time_s": t, "samples": 64, "generation": 0 if not events else 1})
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    pd.DataFrame(events, columns=["time_s", "kind", "generation", "step", "node", "total_s"]).to_csv(run_dir / "events.csv", index=False)
    return run_dir


def test_a_run_that_matches_the_model_validates(tmp_path: Path, make_config):
    validation = validate_run(_write_run(make_config(*OVERRIDES), tmp_path / "exact", slowdown=1.0))
    table = validation.table[validation.table["model"] == "planner"].set_index("metric")
    assert set(table.index) == {"steady_iteration_s", "later_iteration_s", "throughput", "recovery_s"}
    assert table.loc["steady_iteration_s", "ratio"] == pytest.approx(1.0, rel=1e-6)
    assert table.loc["later_iteration_s", "ratio"] == pytest.approx(1.0, rel=1e-6)
    assert table.loc["recovery_s", "ratio"] == pytest.approx(1.0, rel=1e-6)
    # Throughput differs only by the partial iteration at the window's end.
    assert table.loc["throughput", "ratio"] == pytest.approx(1.0, rel=0.08)
    assert validation.table["within_target"].all()
    assert validation.overhead_s == pytest.approx(0.0, abs=1e-9)  # nothing to calibrate
    assert validation.sim.summary["n_reconfiguration"] == 1


def test_a_slower_run_fails_the_targets(tmp_path: Path, make_config):
    validation = validate_run(_write_run(make_config(*OVERRIDES), tmp_path / "slow", slowdown=1.6))
    table = validation.table[validation.table["model"] == "planner"].set_index("metric")
    assert table.loc["throughput", "ratio"] > 1.5
    assert not table.loc["throughput", "within_target"] and not table.loc["steady_iteration_s", "within_target"]
    # Simulated/measured recovery = 1/1.6 = 0.625: inside the looser 50% band for recovery time.
    assert table.loc["recovery_s", "ratio"] == pytest.approx(1 / 1.6, rel=1e-6)
    assert bool(table.loc["recovery_s", "within_target"])
    # The calibrated model fits generation 0's step time exactly (the fitted row) and, with steps
    # uniformly slower, then also predicts the later generation's step time within 15%.
    calibrated = validation.table[validation.table["model"] == "calibrated"].set_index("metric")
    assert validation.overhead_s > 0 and calibrated.loc["steady_iteration_s", "ratio"] == pytest.approx(1.0)
    assert bool(calibrated.loc["later_iteration_s", "within_target"])


def test_run_dirs_without_what_validation_needs_are_named(tmp_path: Path, make_config):
    run = _write_run(make_config(*OVERRIDES), tmp_path / "run", slowdown=1.0, failure_step=None, steps=3)
    (run / "plan.json").write_text('{"templates": {}}')
    with pytest.raises(RunError, match="no execution plan"):
        validate_run(run)
    with pytest.raises(RunError, match="at least two steps"):
        compare(None, pd.DataFrame({"time_s": [1.0], "samples": [64]}), pd.DataFrame(), None)  # type: ignore[arg-type]


def test_runtime_overhead_model_and_fit(tmp_path: Path):
    from oobleck.errors import ConfigError
    from oobleck.sim.costs import RuntimeOverhead, fit_step_overhead

    # Two microbatch counts on an exact line: both terms come back.
    samples = [(0.01, 4, 0.01 + 4 * 0.002 + 0.005), (0.02, 8, 0.02 + 8 * 0.002 + 0.005)]
    per_mb, per_step = fit_step_overhead(samples)
    assert per_mb == pytest.approx(0.002) and per_step == pytest.approx(0.005)
    # A line that would need a negative per-step term: all of it is charged per microbatch.
    per_mb, per_step = fit_step_overhead([(0.0, 4, 0.004), (0.0, 8, 0.012)])
    assert per_step == 0.0 and per_mb == pytest.approx((4 * 0.004 + 8 * 0.012) / 80)
    runtime = RuntimeOverhead(per_microbatch_s=0.002, per_step_s=0.01, cores=2, reconfigure_fixed_s=0.1, warmup_s=0.02, source="x")
    assert runtime.step_s(0.02, 4, workers=2) == pytest.approx(0.038)
    assert runtime.step_s(0.02, 4, workers=5) == pytest.approx(0.038 * 2.5)  # 5 CPU-bound workers on 2 cores
    runtime.save(tmp_path / "o.json")
    assert RuntimeOverhead.load(tmp_path / "o.json") == runtime
    # A failover's fixed part is measured apart from a reconfiguration's (it plans nothing).
    from dataclasses import replace

    from oobleck.sim.costs import CostConstants

    assert runtime.costs(CostConstants(), 2).failover_s == 0.1
    assert replace(runtime, failover_fixed_s=0.03).costs(CostConstants(), 2).failover_s == 0.03
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="bad.json"):
        RuntimeOverhead.load(tmp_path / "bad.json")


def test_a_zero_overhead_prediction_is_the_planner(tmp_path: Path, make_config):
    from oobleck.sim.costs import RuntimeOverhead

    # No overhead, cores to spare, and the reconfiguration's fixed part the planner model's own.
    runtime = RuntimeOverhead(per_microbatch_s=0.0, per_step_s=0.0, cores=1000, reconfigure_fixed_s=2.0, warmup_s=0.0)
    table = validate_run(_write_run(make_config(*OVERRIDES), tmp_path / "run", slowdown=1.0), runtime=runtime).table
    planner = table[table["model"] == "planner"].set_index("metric")
    predicted = table[table["model"] == "predicted"].set_index("metric")
    assert list(predicted.index) == list(planner.index)
    assert predicted["simulated"].to_numpy() == pytest.approx(planner["simulated"].to_numpy())
