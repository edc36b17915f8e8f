"""The measurement protocol (``benchmarks/protocol.py``) and its reading (``analysis.comparison``).

The pure parts: failure steps drawn from the seed, one per window, never on any strategy's
checkpoint boundary, the same for every configuration of a round; orders rotated per round; crash
and hang schedules from the same draws. Then a real protocol (Oobleck and Varuna, three rounds of
crashes on three local nodes, real SIGKILLs) read back: every run paired with Oobleck's of its
round, medians and ranges over three repeats, each run's host in its row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.comparison import fault_type, host_warnings, protocol_summary, protocol_table, strategy_table

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]


def _protocol():
    spec = importlib.util.spec_from_file_location("protocol", REPO / "benchmarks" / "protocol.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["protocol"] = module
    spec.loader.exec_module(module)
    return module


protocol = _protocol()


@pytest.mark.parametrize("seed", range(20))
def test_draws_avoid_every_checkpoint_boundary_and_follow_the_seed(seed):
    intervals = [10, 4, 0]
    steps = protocol.draw_failure_steps(random.Random(seed), 100, 3, intervals)
    assert steps == protocol.draw_failure_steps(random.Random(seed), 100, 3, intervals)
    assert list(steps) == sorted(steps) and len(set(steps)) == 3
    assert all(20 <= s < 80 for s in steps)
    assert not any(s % 10 == 0 or s % 4 == 0 for s in steps)


def test_draws_vary_over_rounds_and_rounds_rotate_the_order():
    rounds = protocol.plan_rounds(["a", "b", "c"], steps=60, failures=2, intervals=[10], repeats=4, seed=7)
    assert [r.order for r in rounds] == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]
    assert len({r.failure_steps for r in rounds}) > 1
    assert rounds == protocol.plan_rounds(["a", "b", "c"], steps=60, failures=2, intervals=[10], repeats=4, seed=7)


def test_too_few_repeats_or_steps_are_refused():
    with pytest.raises(ValueError, match="repeats=2"):
        protocol.plan_rounds(["a"], steps=60, failures=1, intervals=[], repeats=2, seed=0)
    with pytest.raises(ValueError, match="steps=5"):
        protocol.draw_failure_steps(random.Random(0), 5, 2, [])
    with pytest.raises(ValueError, match="only checkpoint boundaries"):
        protocol.draw_failure_steps(random.Random(0), 10, 1, [1])


def test_crash_and_hang_schedules_share_the_draws():
    crash = protocol.fault_events("crash", (13, 27), notice_s=3.0)
    hang = protocol.fault_events("hang", (13, 27), notice_s=3.0)
    assert crash == [
        {"action": "remove", "step": 13, "count": 1, "notice_s": 3.0},
        {"action": "remove", "step": 27, "count": 1, "notice_s": 3.0},
    ]
    assert hang == [{"action": "freeze", "step": 13, "count": 1}, {"action": "freeze", "step": 27, "count": 1}]
    assert protocol.fault_events("none", (13,)) == []
    with pytest.raises(ValueError, match="fault='kill'"):
        protocol.fault_events("kill", (13,))


def test_host_warnings_name_load_and_oversubscription():
    table = pd.DataFrame(
        {
            "cpus": [2, 2],
            "load_start": [1.0, 3.5],
            "load_end": [1.5, 2.0],
            "training_processes": [2, 4],
            "overloaded": [False, True],
            "oversubscribed": [False, True],
        }
    )
    warnings = host_warnings(table)
    assert len(warnings) == 2
    assert "1 of 2 runs" in warnings[0] and "peak 3.5 on 2 cores" in warnings[0]
    assert "up to 4 on 2" in warnings[1]
    assert host_warnings(table.iloc[:1]) == []


def test_a_real_protocol_pairs_every_run_with_its_rounds_reference(tmp_path):
    variants = [protocol.Variant("oobleck", "oobleck"), protocol.Variant("varuna", "varuna")]
    parser = argparse.ArgumentParser()
    protocol.add_protocol_arguments(parser, steps=12, nodes=3, failures=2)
    args = parser.parse_args(["--failures", "1", "--seed", "3", "--out", str(tmp_path)])
    assert (args.steps, args.nodes, args.repeats, args.heartbeat_timeout_s) == (12, 3, protocol.MIN_REPEATS, 5.0)
    out = protocol.protocol_out(args.out, "unused")
    assert out == tmp_path.resolve()
    manifest = protocol.run_tiny_protocol(variants, args, out, faults=["crash"], fault_tolerance=1)
    written = json.loads((tmp_path / "protocol.json").read_text())
    assert written["checkpoint_intervals"] == {"oobleck": 0, "varuna": 10}
    assert [r["error"] for r in written["runs"]] == [""] * 6
    assert [(r["repeat"], r["variant"]) for r in manifest.runs] == [
        (0, "oobleck"), (0, "varuna"), (1, "varuna"), (1, "oobleck"), (2, "oobleck"), (2, "varuna")
    ]  # fmt: skip
    table = protocol_table(tmp_path)
    assert len(table) == 6
    for run in manifest.runs:
        events = pd.read_csv(tmp_path / run["path"] / "events.csv")
        killed = events[events["kind"] == "fault_injected"]
        assert list(killed["step"]) == run["failure_steps"] and run["failure_steps"][0] % 10 != 0
    ours = table[table["variant"] == "oobleck"]
    assert (ours["goodput_ratio"] == 1.0).all() and (ours["recovery_ratio"] == 1.0).all()
    theirs = table[table["variant"] == "varuna"].set_index("repeat")
    for repeat, row in ours.set_index("repeat").iterrows():
        assert theirs.loc[repeat, "goodput_ratio"] == pytest.approx(row["goodput"] / theirs.loc[repeat, "goodput"])
    assert (table["cpus"] >= 1).all() and table["training_processes"].notna().all()
    from analysis.load import load_run_set

    one_round = strategy_table(load_run_set([tmp_path / "r0-crash" / "oobleck", tmp_path / "r0-crash" / "varuna"]))
    assert list(one_round["fault"]) == ["crash", "crash"]
    assert one_round.set_index("strategy").loc["oobleck", "oobleck_over_this"] == 1.0
    summary = protocol_summary(table).set_index("variant")
    assert list(summary["repeats"]) == [3, 3]
    low, high = theirs["goodput_ratio"].min(), theirs["goodput_ratio"].max()
    assert summary.loc["varuna", "goodput_ratio"].startswith(f"{theirs['goodput_ratio'].median():.3g} [{low:.3g}-")
    assert f"-{high:.3g}]" in summary.loc["varuna", "goodput_ratio"]


def test_fault_type_reads_the_injected_faults():
    def events(*faults):
        return pd.DataFrame({"kind": ["fault_injected"] * len(faults) + ["checkpoint"], "fault": [*faults, None]})

    assert fault_type(events("remove", "remove")) == "crash"
    assert fault_type(events("freeze")) == "hang"
    assert fault_type(events("remove", "freeze")) == "crash+hang"
    assert fault_type(events()) == "none"
    assert fault_type(pd.DataFrame()) == "none"


def _bench_attribution():
    spec = importlib.util.spec_from_file_location("bench_attribution", REPO / "benchmarks" / "bench_attribution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_attribution_variant_is_a_valid_run_under_both_faults():
    """A renamed strategy key would otherwise surface as a failed run in the middle of the table."""
    from oobleck.config import validate
    from testing import tiny_config

    bench = _bench_attribution()
    chosen = bench.variants(3.0)
    names = [v.name for v in chosen]
    assert len(set(names)) == len(names) and names[0] == "oobleck"
    assert set(bench.HANG_VARIANTS) | set(bench.EXTRA_VARIANTS) <= set(names)
    for variant in chosen:
        for fault in ("crash", "hang"):
            events = protocol.fault_events(fault, (9,), variant.notice_s)
            cfg = tiny_config(
                f"strategy={variant.strategy}",
                **{"cluster.nodes": 4, "job.fault_tolerance": 2, "job.steps": 24, "failures.kind": "explicit"},
                **{"failures.events": events, "job.global_batch_size": protocol.GLOBAL_BATCH, **variant.settings()},
            )
            validate(cfg)
            assert cfg.strategy.name == variant.strategy
            for key, value in variant.overrides:
                assert cfg.strategy[key.removeprefix("strategy.")] == value


def test_a_notices_restart_counts_as_a_recovery_and_a_join_does_not():
    from analysis.comparison import _recovery_s

    events = pd.DataFrame(
        {
            "kind": ["restart", "reconfiguration", "continue", "checkpoint"],
            "total_s": [0.8, 9.0, 2.0, 0.1],
            "removed": ["[]", "[]", "[1]", None],
            "joined": ["[]", "[4]", "[]", None],
        }
    )
    assert _recovery_s(events) == pytest.approx(1.4)  # the notice's restart and torchft's continue


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("bench", "faults"), [("bench_bamboo_modes", ("none",)), ("bench_recycle", ("none", "crash"))])
def test_every_variant_of_the_protocol_benches_is_a_valid_run(bench, faults):
    """What bench_bamboo_modes and bench_recycle hand the protocol composes, validates and sets
    the keys it names (a renamed key would otherwise fail every run of the benchmark)."""
    from oobleck.config import validate

    module = _bench(bench)
    variants = module.VARIANTS
    assert len({v.name for v in variants}) == len(variants) and variants[0].name == "oobleck"
    for variant in variants:
        for fault in faults:
            events = protocol.fault_events(fault, (9,), variant.notice_s)
            cfg = protocol.tiny_run_config(
                variant,
                events,
                steps=24,
                nodes=4,
                heartbeat_timeout_s=5.0,
                profiles=Path("profiles"),
                fault_tolerance=1,
            )
            validate(cfg)
            assert cfg.strategy.name == variant.strategy and cfg.job.global_batch_size == protocol.GLOBAL_BATCH
            assert len(cfg.failures.events) == len(events)
            for written, event in zip(cfg.failures.events, events):
                assert {key: written[key] for key in event} == event
            for key, value in variant.overrides:
                assert cfg.strategy[key.removeprefix("strategy.")] == value
            if fault == "crash":  # bench_recycle reads the step back from the run's config
                assert module.failure_step(protocol.RunResult(Path("run"), cfg, None, (0.0, 0.0))) == 9


def test_runs_by_repeat_pairs_each_rounds_runs_and_leaves_failed_ones_out(tmp_path):
    manifest = protocol.Manifest(0, 10, 2, 5.0, {"a": 0, "b": 0}, "a")
    for repeat in (0, 1):
        for fault in ("none", "crash"):
            for name in ("b", "a") if repeat else ("a", "b"):
                manifest.runs.append(
                    {"path": f"r{repeat}-{fault}/{name}", "variant": name, "fault": fault, "repeat": repeat}
                )
    results = {
        tmp_path / run["path"]: protocol.RunResult(tmp_path / run["path"], None, run["path"], (0.0, 0.0))
        for run in manifest.runs
        if run["path"] != "r1-crash/a"  # that run failed: no result
    }
    steady = protocol.runs_by_repeat(manifest, tmp_path, "none", results)
    assert [{k: r.outcome for k, r in runs.items()} for runs in steady] == [
        {"a": "r0-none/a", "b": "r0-none/b"},
        {"a": "r1-none/a", "b": "r1-none/b"},
    ]
    crashed = protocol.runs_by_repeat(manifest, tmp_path, "crash", results)
    assert [sorted(runs) for runs in crashed] == [["a", "b"], ["b"]]
