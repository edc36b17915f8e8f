"""Uncertain constants: declared with range and source, sampled into bands, the cliff marked."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from oobleck.errors import ConfigError
from oobleck.sim.ratios import band_of
from oobleck.uncertainty import band_samples, declared, with_values


def test_every_testbed_declares_its_unmeasured_constants_with_a_source(make_config):
    for testbed in ("a100_analytic", "paper_testbed"):
        cfg = make_config("experiment=paper_failure_frequency", f"testbed={testbed}")
        constants = {c.name: c for c in declared(cfg)}
        wanted = {
            "achieved_flop_fraction",
            "inter_node_bandwidth",
            "storage_write",
            "storage_read",
            "storage_aggregate",
            "detect",
            "process_start",
            "group_init",
            "group_init_per_node",
            "model_build",
        }
        assert set(constants) == wanted, testbed
        for c in constants.values():
            assert c.low <= c.nominal <= c.high and len(c.source) > 40
        assert {c.name for c in constants.values() if c.changes_timing} == {
            "achieved_flop_fraction",
            "inter_node_bandwidth",
        }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+sim.uncertain.x={key:sim.costs.detect_s,low:1,high:60,scale:log}", "sim.uncertain.x has no"),
        ("+sim.uncertain.x={key:sim.costs.detect_s,low:60,high:1,scale:log,source:s}", "low=60 must be below high=1"),
        (
            "+sim.uncertain.x={key:sim.costs.detect_s,low:20,high:60,scale:log,source:s}",
            "nominal sim.costs.detect_s=10",
        ),
        ("+sim.uncertain.x={key:sim.costs.group_init_s,low:0,high:60,scale:log,source:s}", "a log scale needs low > 0"),
        ("+sim.uncertain.x={key:sim.costs.nothing,low:0,high:60,scale:linear,source:s}", "has no nominal value"),
        ("+sim.uncertain.x={key:job.steps,low:0,high:60,scale:linear,source:s}", "only sim.costs.*, sim.params.*"),
        ("+sim.uncertain.x={key:sim.costs.detect_s,low:1,high:60,scale:cubic,source:s}", "scale='cubic'"),
    ],
)
def test_a_bad_declaration_is_named(make_config, override, message):
    from oobleck.config import validate

    cfg = make_config("experiment=paper_failure_frequency", override)
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("(", r"\(")):
        validate(cfg)


def test_the_band_is_three_grid_points_with_a_latin_hypercube_at_each(make_config):
    cfg = make_config("experiment=paper_failure_frequency")
    constants = declared(cfg)
    samples = band_samples(constants, 4, seed=0)
    assert samples[0].index == 0 and samples[0].values == {c.key: c.nominal for c in constants}
    assert len(samples) == 1 + 3 * 4 and [s.index for s in samples] == list(range(13))
    timing = [c for c in constants if c.changes_timing]
    points = {tuple(s.values[c.key] for c in timing) for s in samples[1:]}
    assert points == {tuple(c.low for c in timing), tuple(c.nominal for c in timing), tuple(c.high for c in timing)}
    for grid in {s.grid for s in samples[1:]}:
        group = [s for s in samples[1:] if s.grid == grid]
        for c in constants:
            if c.changes_timing:
                continue
            # One value in each quarter of the range (on its scale): a Latin hypercube.
            quantiles = sorted(
                (math.log(s.values[c.key] / c.low) / math.log(c.high / c.low))
                if c.scale == "log"
                else (s.values[c.key] - c.low) / (c.high - c.low)
                for s in group
            )
            assert [int(q * 4) for q in quantiles] == [0, 1, 2, 3], c.name
    assert [s.values for s in band_samples(constants, 4, seed=0)] == [s.values for s in samples]
    assert [s.values for s in band_samples(constants, 4, seed=1)] != [s.values for s in samples]
    assert len(band_samples(constants, 0, seed=0)) == 1  # band_samples=0: the nominal point only
    applied = with_values(cfg, samples[5].values)
    assert applied.cluster.gpu.achieved_flop_fraction == samples[5].values["cluster.gpu.achieved_flop_fraction"]
    assert cfg.cluster.gpu.achieved_flop_fraction == 0.45  # the config itself is untouched


def _band(cycles: list[float | None], baseline: list[float], interval: float = 600.0) -> pd.DataFrame:
    rows = []
    for sample, (cycle, theirs) in enumerate(zip(cycles, baseline)):
        common = {"model": "m", "trace": "t", "start": 0, "sample": sample, "failure_interval_s": interval}
        rows.append({**common, "strategy": "oobleck", "throughput": 10.0, "oom": False, "recovery_cycle_s": None})
        rows.append(
            {
                **common,
                "strategy": "varuna",
                "throughput": theirs,
                "oom": False,
                "recovery_cycle_s": cycle,
                "restart_share": 1.0,
            }
        )
    return pd.DataFrame(rows).assign(restart_share=lambda f: f["restart_share"].fillna(0.0))


def test_a_band_crossing_the_cliff_is_marked_and_an_unbounded_one_says_so():
    crossing = band_of(_band([300.0, 500.0, 900.0], [8.0, 5.0, 0.5]), "m", "t", "varuna")
    assert crossing["ratio_low"] == pytest.approx(1.25) and crossing["ratio_high"] == pytest.approx(20.0)
    assert crossing["cliff"] and not crossing["beyond_cliff"] and crossing["band_points"] == 3
    assert (crossing["cycle_low_s"], crossing["cycle_high_s"], crossing["failure_interval_s"]) == (300, 900, 600)
    within = band_of(_band([300.0, 500.0], [8.0, 5.0]), "m", "t", "varuna")
    assert not within["cliff"] and not within["beyond_cliff"]
    stalled = band_of(_band([700.0, 900.0], [2.0, 0.0]), "m", "t", "varuna")
    assert stalled["beyond_cliff"] and stalled["band_unbounded"] == 1 and math.isnan(stalled["ratio_high"])
    assert stalled["ratio_low"] == pytest.approx(5.0) and math.isnan(stalled["ratio_band_median"])
    # A baseline that restarts on few failures (Bamboo's adjacent losses) has no cliff.
    rare = _band([300.0, 900.0], [8.0, 5.0]).assign(restart_share=0.1)
    assert not band_of(rare, "m", "t", "varuna")["cliff"]


def test_a_short_experiment_reports_bands_around_its_nominal_ratios(make_config):
    from oobleck.sim.experiment import run_experiment

    cfg = make_config(
        "experiment=paper_failure_frequency",
        "sim.models=[gpt3_medium]",
        "sim.traces=[synthetic/10m]",
        "sim.trace_starts=2",
        "sim.band_samples=1",
        "sim.duration_h=1.5",
    )
    result = run_experiment(cfg)
    strategies = len(cfg.sim.strategies)  # Oobleck, Varuna, Bamboo, torchft and ReCycle
    assert strategies == 5 and len(result.band) == (1 + 3 * 1) * 2 * strategies  # samples x starts x strategies
    assert len(result.summary) == 2 * strategies and set(result.samples["sample"]) == set(range(4))
    nominal = result.band[result.band["sample"] == 0].set_index(["start", "strategy"])["throughput"]
    assert nominal.to_dict() == result.summary.set_index(["start", "strategy"])["throughput"].to_dict()
    for _, row in result.ratios.iterrows():
        assert row["ratio_low"] <= row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"] <= row["ratio_high"]
        assert row["band_points"] == 4 * 2 and row["failure_interval_s"] == pytest.approx(600.0, rel=0.01)
    varuna = result.ratios.set_index("baseline").loc["varuna"]
    assert varuna["cycle_low_s"] < varuna["cycle_high_s"]  # the constants move Varuna's restart cycle
