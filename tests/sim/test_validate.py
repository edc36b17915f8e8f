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


def _write_run(
    cfg, run_dir: Path, *, slowdown: float, failure_step: int | None = 8, steps: int = 24, victim: int | None = None
) -> Path:
    """A run dir as ``python -m oobleck.run`` writes it, for an ideal runtime slowed by ``slowdown``
    (``cfg``'s own strategy; ``victim``: the node lost, default the plan's last)."""
    from oobleck.sim.charges import decision_downtime
    from oobleck.sim.experiment import build_context, simulated_strategy
    from oobleck.sim.results import EVENT_KIND
    from oobleck.strategy import RunState

    profile = synthetic_profile(12, seed=1)
    run_dir.mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    profile.save(run_dir / "profile.json")
    context = build_context(cfg, profile, 6, named_gpu=False)
    strategy = simulated_strategy(cfg, str(cfg.strategy.name), context)
    layout = strategy.start(list(range(6))).layout
    plan = instantiate(context.templates(), list(range(6)), 64, 1, 1) if strategy.name == "oobleck" else layout.plan
    (run_dir / "plan.json").write_text(pd.Series({"plan": plan.to_dict()}).to_json())
    t, rows, events = 2.0, [], []
    for step in range(1, steps + 1):
        if failure_step is not None and step == failure_step:
            victim = layout.nodes[-1] if victim is None else victim
            # As the controller writes it: ``node`` (read back as a float column with gaps).
            events.append({"time_s": t, "kind": "failure", "generation": 0, "step": step, "node": victim})
            decision = strategy.on_change(
                RunState(layout, tuple(n for n in layout.nodes if n != victim), (victim,), (), step=step)
            )
            layout = decision.layout
            recovery = (decision_downtime(decision, strategy)[0] + layout.iteration_s) * slowdown
            t += recovery
            kind = EVENT_KIND[decision.kind]
            events.append({"time_s": t, "kind": kind, "generation": 1, "step": step, "total_s": recovery})
            rows.append({"step": step, "time_s": t, "samples": 64, "generation": 1})
            continue
        t += layout.iteration_s * slowdown
        rows.append({"step": step, "time_s": t, "samples": 64, "generation": 0 if not events else 1})
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    pd.DataFrame(events, columns=["time_s", "kind", "generation", "step", "node", "total_s"]).to_csv(
        run_dir / "events.csv", index=False
    )
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


def test_a_recycle_run_is_validated_on_its_reroute(tmp_path: Path, make_config):
    # D=2 x P=3 on 6 nodes; node 4 (stage 1 of pipeline 1) lost: its microbatches go through
    # stage 1 of pipeline 0, nothing is copied.
    cfg = make_config(*OVERRIDES, "strategy=recycle", "strategy.pipeline_depth=3")
    validation = validate_run(_write_run(cfg, tmp_path / "recycle", slowdown=1.0, victim=4))
    assert validation.sim.summary["n_reroute"] == 1
    table = validation.table[validation.table["model"] == "planner"].set_index("metric")
    assert {"steady_iteration_s", "later_iteration_s", "reroute_s"} <= set(table.index)
    assert "recovery_s" not in table.index  # no reconfiguration happened
    # The re-routed layout is slower (its op-level makespan) and the simulator charged exactly that.
    assert table.loc["later_iteration_s", "measured"] > table.loc["steady_iteration_s", "measured"]
    assert table.loc["later_iteration_s", "ratio"] == pytest.approx(1.0, rel=1e-6)
    assert table.loc["reroute_s", "ratio"] == pytest.approx(1.0, rel=1e-6)
    slow = validate_run(_write_run(cfg, tmp_path / "slow", slowdown=1.6, victim=4)).table
    slow = slow[slow["model"] == "planner"].set_index("metric")
    assert (
        slow.loc["reroute_s", "ratio"] == pytest.approx(1 / 1.6) and not slow.loc["later_iteration_s", "within_target"]
    )


def test_a_rerouted_layout_counts_the_peers_extra_stage_runs(make_config):
    from simhelpers import make_context, make_strategy

    from oobleck.sim.calibration import step_shape
    from oobleck.strategy import RunState

    context = make_context(memory_gb=4.0, nodes=8)
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    start = strategy.start(list(range(8))).layout
    rerouted = strategy.on_change(RunState(start, (0, 1, 2, 3, 4, 6, 7), (5,), (), 3)).layout
    (reroute,) = rerouted.plan.reroutes
    before, after = step_shape(start, context.profile), step_shape(rerouted, context.profile)
    moved = len(reroute.via)
    layers = context.profile.layers[reroute.start : reroute.end]
    # The same work is done (pipeline 1's stage-1 microbatches now on pipeline 0's stage 1) on one
    # worker fewer; every re-routed microbatch is one more stage run of the peer, not one fewer.
    assert after.compute_s == pytest.approx(before.compute_s)
    assert moved == context.num_microbatches // 2 and sum(l.forward_s for l in layers) > 0
    assert after.workers == before.workers - 1 and after.stage_microbatches == before.stage_microbatches
    assert after.busiest_microbatches == before.busiest_microbatches + moved
    assert after.planner_s == rerouted.iteration_s > before.planner_s


def test_bamboo_modes_count_only_the_redundant_work_they_run():
    from simhelpers import make_context, make_strategy

    from oobleck.sim.calibration import _measure, step_shape
    from oobleck.sim.validate import redundant_share

    context = make_context(memory_gb=8.0)  # eager keeps every microbatch's redundant activations
    shapes, shares = {}, {}
    for mode in ("lazy", "eager", "inline"):
        strategy = make_strategy(context, "bamboo", pipeline_depth=2, redundancy=mode)
        layout = strategy.start(list(range(8))).layout
        assert layout.plan.redundancy == mode and layout.plan.shadows
        shapes[mode] = step_shape(layout, context.profile)
        shares[mode] = redundant_share(layout.plan, context.profile, layout.iteration_s, 1.0)
    # Lazy runs no redundant forward in steady state: neither its CPU nor its share has one.
    assert shares["lazy"] == 0.0 and shares["eager"] > 0 and shares["inline"] > 0
    assert shapes["lazy"].compute_s < shapes["eager"].compute_s == pytest.approx(shapes["inline"].compute_s)
    # The exposed share is fitted on inline generations only; the others are step samples.
    metrics = pd.DataFrame({"step": range(1, 7), "time_s": [0.1 * k for k in range(1, 7)], "generation": 0})
    for mode, exposed in (("lazy", 0), ("eager", 0), ("inline", 1)):
        strategy = make_strategy(context, "bamboo", pipeline_depth=2, redundancy=mode)
        plan = strategy.start(list(range(8))).layout.plan
        found = _measure(plan, metrics, pd.DataFrame(), strategy, mode, 2)
        assert (len(found.exposed), len(found.samples)) == (exposed, 1 - exposed), mode


def test_run_dirs_without_what_validation_needs_are_named(tmp_path: Path, make_config):
    run = _write_run(make_config(*OVERRIDES), tmp_path / "run", slowdown=1.0, failure_step=None, steps=3)
    (run / "plan.json").write_text('{"templates": {}}')
    with pytest.raises(RunError, match="no execution plan"):
        validate_run(run)
    with pytest.raises(RunError, match="at least two steps"):
        compare(None, pd.DataFrame({"time_s": [1.0], "samples": [64]}), pd.DataFrame(), None)  # type: ignore[arg-type]


def test_runtime_overhead_model_and_fit(tmp_path: Path):
    from oobleck.errors import ConfigError
    from oobleck.sim.runtime_model import RuntimeOverhead, StepShape, fit_step_model, step_model

    # The step is the longer of the critical path and the CPU every worker needs over the cores.
    shape = StepShape(planner_s=0.02, busiest_microbatches=4, stage_microbatches=10, workers=5, compute_s=0.1)
    critical = 1.5 * 0.02 + 4 * 0.002 + 0.01  # the planner's compute slowed by the same scale as the CPU's
    cpu = 1.5 * 0.1 + 10 * 0.002 + 5 * 0.004
    assert step_model(shape, 1000, 0.002, 0.01, 0.004, 1.5) == pytest.approx(critical)  # cores to spare
    assert step_model(shape, 2, 0.002, 0.01, 0.004, 1.5) == pytest.approx(cpu / 2)  # 5 busy workers on 2 cores
    # Workers waiting in a bubble use no CPU: more workers on the same compute cost only their own
    # per-worker seconds, not a uniform workers / cores slow-down of the whole step.
    wider = StepShape(planner_s=0.02, busiest_microbatches=4, stage_microbatches=10, workers=6, compute_s=0.1)
    assert step_model(wider, 2, 0.002, 0.01, 0.004, 1.5) == pytest.approx((cpu + 0.004) / 2)
    # A re-route (ReCycle) or failover lengthens the critical path, not the CPU work: on a loaded host
    # (compute scale 3.55, two cores) the re-routed step is predicted slower, as it was measured,
    # where the profile's unscaled critical path hid below the CPU floor.
    intact = StepShape(planner_s=0.15, busiest_microbatches=8, stage_microbatches=48, workers=6, compute_s=0.5)
    rerouted = StepShape(planner_s=0.3, busiest_microbatches=16, stage_microbatches=48, workers=5, compute_s=0.5)
    loaded = (0.0022, 0.106, 0.0, 3.55)
    floor = (3.55 * 0.5 + 48 * 0.0022) / 2
    assert step_model(intact, 2, *loaded) == pytest.approx(floor)
    assert step_model(rerouted, 2, *loaded) == pytest.approx(3.55 * 0.3 + 16 * 0.0022 + 0.106)
    assert step_model(rerouted, 2, *loaded) > 1.25 * step_model(intact, 2, *loaded)
    assert 0.3 + 16 * 0.0022 + 0.106 < floor  # unscaled, the re-routed step read as the intact one

    # The fit recovers the terms from layouts that tell them apart: some bound by their critical
    # path (one long pipeline), some by the CPU (many workers), with different microbatch counts.
    truth = {"per_microbatch_s": 0.0015, "per_step_s": 0.006, "per_worker_s": 0.005, "compute_scale": 1.2}
    shapes = [
        StepShape(0.08, 8, 16, 2, 0.06),
        StepShape(0.05, 4, 8, 2, 0.05),
        StepShape(0.03, 2, 8, 4, 0.05),
        StepShape(0.02, 4, 16, 4, 0.075),
        StepShape(0.03, 6, 16, 3, 0.075),
        StepShape(0.02, 12, 52, 5, 0.075),
        StepShape(0.12, 16, 32, 2, 0.08),
        StepShape(0.01, 2, 24, 6, 0.04),
    ]
    samples = [(s, step_model(s, 2, **truth)) for s in shapes]
    terms = fit_step_model(samples, 2)
    assert terms == pytest.approx(truth, rel=0.02)
    for s, measured in samples:
        assert step_model(s, 2, **terms) == pytest.approx(measured, rel=1e-3)
    with pytest.raises(ValueError, match="no step samples"):
        fit_step_model([], 2)
    with pytest.raises(ValueError, match="positive"):
        fit_step_model([(shapes[0], 0.0)], 2)

    runtime = RuntimeOverhead(
        per_microbatch_s=0.002, per_step_s=0.01, cores=2, reconfigure_fixed_s=0.1, warmup_s=0.02, source="x"
    )
    assert runtime.step_s(StepShape(0.02, 4, 4, 2, 0.0)) == pytest.approx(0.038)
    runtime.save(tmp_path / "o.json")
    assert RuntimeOverhead.load(tmp_path / "o.json") == runtime
    # A failover's fixed part is measured apart from a reconfiguration's (it plans nothing).
    from dataclasses import replace

    from oobleck.recovery_costs import CostConstants

    assert runtime.costs(CostConstants(), 2).failover_s == 0.1
    assert replace(runtime, failover_fixed_s=0.03).costs(CostConstants(), 2).failover_s == 0.03
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="bad.json"):
        RuntimeOverhead.load(tmp_path / "bad.json")


def test_a_zero_overhead_prediction_is_the_planner(tmp_path: Path, make_config):
    from oobleck.sim.runtime_model import RuntimeOverhead

    # No overhead, cores to spare, and the reconfiguration's fixed part the planner model's own.
    runtime = RuntimeOverhead(per_microbatch_s=0.0, per_step_s=0.0, cores=1000, reconfigure_fixed_s=2.0, warmup_s=0.0)
    table = validate_run(_write_run(make_config(*OVERRIDES), tmp_path / "run", slowdown=1.0), runtime=runtime).table
    planner = table[table["model"] == "planner"].set_index("metric")
    predicted = table[table["model"] == "predicted"].set_index("metric")
    assert list(predicted.index) == list(planner.index)
    assert predicted["simulated"].to_numpy() == pytest.approx(planner["simulated"].to_numpy())


def test_bamboo_exposure_is_fitted_where_the_steps_show_it(context):
    from dataclasses import replace

    from simhelpers import make_strategy

    from oobleck.sim.calibration import _fit_exposure, step_shape
    from oobleck.sim.runtime_model import step_model

    strategy = make_strategy(context, "bamboo", pipeline_depth=4, redundancy="inline")
    layout = strategy.start(list(range(8))).layout
    terms = {"per_microbatch_s": 0.001, "per_step_s": 0.002, "per_worker_s": 0.0, "compute_scale": 1.0}
    shape = step_shape(layout, context.profile)
    assert shape.compute_s > sum(  # the CPU runs the redundant forward whether or not it is exposed
        (context.profile.layers[layer].forward_s + context.profile.layers[layer].backward_s)
        * layout.plan.pipelines[a.pipeline].microbatches
        for a in layout.plan.assignments()
        for layer in a.layers
    )

    def step_with(exposed: float, cores: int, **more) -> float:
        variant = make_strategy(
            context, "bamboo", pipeline_depth=4, redundancy="inline", redundant_forward_exposed=exposed
        )
        return step_model(replace(shape, planner_s=variant.iteration_s(layout.state)), cores, **{**terms, **more})

    assert step_with(0.0, 1000) < step_with(1.0, 1000)
    measured = step_with(0.25, 1000)  # the critical path sets the step: the share shows in it
    fitted = _fit_exposure([(strategy, layout, measured)], terms, 1000)
    assert fitted < 1.0 and step_with(fitted, 1000) == pytest.approx(measured)
    # Where the CPU floor sets the step, the share changes nothing and the runtime's schedule (1.0) stands.
    floor = {**terms, "compute_scale": 100.0}
    assert _fit_exposure([(strategy, layout, step_with(0.25, 1, compute_scale=100.0))], floor, 1) == 1.0


def test_calibration_fits_the_cadence_and_the_whole_fixed_part(tmp_path: Path, make_config):
    """The step terms are fitted on the commit-to-commit cadence (what the throughput pays), not
    on ``step_time_s`` (which ends at the commit vote); a reconfiguration's fixed part is all of it
    up to the new generation, not only the phases the controller names."""
    from oobleck.sim.calibration import step_shape
    from oobleck.sim.validate import _load, calibrate_runs

    run = _write_run(make_config(*OVERRIDES), tmp_path / "run", slowdown=1.6, steps=30)
    metrics = pd.read_csv(run / "metrics.csv")
    metrics["step_time_s"] = metrics["time_s"].diff().fillna(0.1) * 0.5  # the vote comes before the optimizer
    metrics.to_csv(run / "metrics.csv", index=False)
    events = pd.read_csv(run / "events.csv")
    after = metrics[metrics["generation"] == 1]["time_s"].diff().median()
    recovery = events["kind"] == "reconfiguration"
    events.loc[recovery, ["detect_s", "plan_s", "groups_s", "state_copy_s"]] = 0.001, 0.001, 0.001, 0.0
    events.loc[recovery, "first_step_s"] = after
    events.to_csv(run / "events.csv", index=False)

    runtime = calibrate_runs([run])
    plan, data, strategy, _ = _load(run, None)
    layout = strategy.start(list(plan.nodes)).layout
    cadence = metrics[metrics["generation"] == 0]["time_s"].diff().median()
    assert runtime.step_s(step_shape(layout, strategy.context.profile)) == pytest.approx(cadence, rel=0.1)
    total = float(events.loc[recovery, "total_s"].iloc[0])
    assert runtime.reconfigure_fixed_s == pytest.approx(total - after) and runtime.reconfigure_fixed_s > 0.003


def _bench_validation():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_validation.py"
    spec = importlib.util.spec_from_file_location("bench_validation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_protocol_reads_the_preregistered_holdout(make_config):
    from oobleck.config import validate
    from oobleck.sim.holdout import read_holdout

    bench = _bench_validation()
    registered = read_holdout(bench.HOLDOUT_FILE)
    cases = bench.holdout_cases()
    assert sorted(cases) == ["H1", "H2", "H3", "H4", "H5", "H6"]
    assert cases == {name: (case.strategy, list(case.overrides)) for name, case in registered.items()}
    assert not set(cases) & (set(bench.CALIBRATION) | set(bench.PREDICTED))
    for name, (strategy, overrides) in cases.items():
        cfg = make_config(*overrides)
        validate(cfg)  # every case is a valid run, with the strategy it says
        assert cfg.strategy.name == strategy, name


def test_the_protocol_predicts_recycle_and_both_bamboo_modes(make_config):
    from oobleck.config import validate

    bench = _bench_validation()
    cases = {**bench.CALIBRATION, **bench.PREDICTED}
    modes = {}
    for name, (strategy, overrides) in cases.items():
        cfg = make_config(*overrides)
        validate(cfg)
        assert cfg.strategy.name == strategy, name
        if strategy == "bamboo":
            modes[name] = cfg.strategy.redundancy
    assert modes == {"BC": "lazy", "BP": "lazy", "BPE": "eager"}
    assert [name for name, (strategy, _) in bench.PREDICTED.items() if strategy == "recycle"] == ["RP"]


def test_scores_are_reported_per_set_and_a_bad_holdout_is_named(tmp_path):
    from oobleck.sim.holdout import read_holdout, scores

    table = pd.DataFrame(
        {"set": ["holdout", "development", "development", "holdout"], "within_target": [True, True, False, False]}
    )
    assert scores(table).to_dict("records") == [
        {"set": "development", "rows": 2, "within_target": 1, "share": 0.5},
        {"set": "holdout", "rows": 2, "within_target": 1, "share": 0.5},
    ]
    bad = tmp_path / "holdout.yaml"
    bad.write_text("holdout:\n  X1: {strategy: oobleck, overrides: [cluster.nodes=4]}\n")
    with pytest.raises(RunError, match="case X1 must have exactly strategy, what, overrides"):
        read_holdout(bad)
