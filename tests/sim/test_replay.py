"""Shifted trace starts, shared decisions and the ratio tables with their uncertainty."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from simhelpers import make_strategy

from oobleck.faults.kinds import FaultKind
from oobleck.faults.trace import parse_trace
from oobleck.sim.charges import CostCache
from oobleck.sim.engine import simulate
from oobleck.sim.ratios import add_speedups, speedup_ranges
from oobleck.sim.replay import DecisionMemo, Memoized, shifted_trace, start_offsets

JOIN, REMOVE = FaultKind.JOIN, FaultKind.REMOVE

TEXT = "0,add,a\n0,add,b\n0,add,c\n600000,remove,b\n900000,add,d\n1200000,remove,a\n1800000,remove,d\n"


def test_a_shifted_start_begins_with_the_nodes_alive_there():
    trace = parse_trace(TEXT, origin="t.csv")
    shifted = shifted_trace(trace, 1000.0)  # 1000 s in: a, c, d alive
    assert [(e.time_ms, e.kind, e.node) for e in shifted.events] == [
        (0, JOIN, "a"),
        (0, JOIN, "c"),
        (0, JOIN, "d"),
        (200000, REMOVE, "a"),
        (800000, REMOVE, "d"),
    ]
    assert shifted.name == trace.name and shifted_trace(trace, 0.0) is trace
    # Spacing: the median time between changes (600, 300, 300, 600 s -> 450 s) over the starts.
    assert start_offsets(trace, 3) == pytest.approx([0.0, 150.0, 300.0])
    assert start_offsets(trace, 2, 60.0) == [0.0, 60.0] and start_offsets(trace, 1) == [0.0]


def _lines(n: int, removals: list[tuple[int, int]]) -> str:
    return "\n".join([f"0,add,n{i}" for i in range(n)] + [f"{t * 1000},remove,n{i}" for t, i in removals]) + "\n"


@pytest.mark.parametrize("name", ["oobleck", "varuna", "bamboo"])
def test_shared_decisions_change_nothing(context, name):
    trace = parse_trace(_lines(8, [(300, 1), (700, 5), (1100, 2)]), origin="t.csv")
    memo = DecisionMemo()
    plain = simulate(make_strategy(context, name, checkpoint_every_steps=7), trace, node_creation_s=45.0)
    for _ in range(2):
        shared = simulate(
            Memoized(make_strategy(context, name, checkpoint_every_steps=7), memo),
            trace,
            node_creation_s=45.0,
            cache=memo.costs,
        )
        assert shared.summary == plain.summary
        assert shared.events == plain.events
    assert memo.hits > 0  # the second replay reused the first one's decisions


def _summary(rows):
    frame = pd.DataFrame(
        rows, columns=["model", "trace", "start", "strategy", "throughput", "oom", "no_durable_progress"]
    )
    return add_speedups(frame)


def test_ratios_are_paired_by_start_and_never_inf():
    rows = []
    for start, (ours, varuna) in enumerate([(10.0, 5.0), (10.0, 2.0), (12.0, 0.0)]):
        rows += [
            ("m", "t", start, "oobleck", ours, False, False),
            ("m", "t", start, "varuna", varuna, False, varuna == 0.0),
        ]
        rows += [("m", "t", start, "bamboo", 0.0, True, True)]
    summary = _summary(rows)
    ours = summary[summary["strategy"] == "oobleck"]
    assert ours["speedup_vs_varuna"].tolist()[:2] == [2.0, 5.0] and math.isnan(ours["speedup_vs_varuna"].iloc[2])
    assert ours["speedup_vs_varuna_note"].tolist() == ["", "", "no progress"]
    assert ours["speedup_vs_bamboo"].isna().all() and set(ours["speedup_vs_bamboo_note"]) == {"OOM"}
    assert not any(math.isinf(v) for v in summary["speedup_vs_varuna"].dropna())
    ranges = speedup_ranges(summary).set_index("baseline")
    varuna = ranges.loc["varuna"]
    assert (varuna["ratio_median"], varuna["ratio_min"], varuna["ratio_max"], varuna["ratio_starts"]) == (
        3.5,
        2.0,
        5.0,
        2,
    )
    assert varuna["baseline_no_durable_progress_starts"] == 1 and varuna["note"] == "no progress"
    assert ranges.loc["bamboo", "baseline_oom"] and math.isnan(ranges.loc["bamboo", "ratio_median"])


def test_the_printed_table_shows_median_range_and_marks():
    from analysis.load import throughput_cells

    rows = []
    for start, (ours, varuna, lost) in enumerate([(10.0, 5.0, False), (10.0, 2.0, True), (12.0, 4.0, False)]):
        rows += [("m", "t", start, "oobleck", ours, False, False), ("m", "t", start, "varuna", varuna, False, lost)]
    cells = throughput_cells(_summary(rows))
    assert cells.loc[("m", "t"), "oobleck/varuna"] == "3 [2-5]"
    assert cells.loc[("m", "t"), "varuna"] == "4*" and cells.loc[("m", "t"), "oobleck"] == "10"


def test_cost_cache_is_per_plan(context):
    strategy = make_strategy(context, "varuna")
    layout = strategy.start(list(range(8))).layout
    cache = CostCache()
    first = cache.checkpoint(strategy, layout)
    assert cache.checkpoint(strategy, layout) is first and cache.restore(strategy, layout) > 0


def test_the_failure_interval_is_the_stretch_a_moment_falls_in():
    from oobleck.sim.replay import failure_interval_s

    regular = parse_trace("0,add,a\n0,add,b\n600000,remove,a\n1200000,remove,b\n1800000,add,c\n", origin="t.csv")
    assert failure_interval_s(regular) == pytest.approx(600.0)
    # A burst of removals 10 s apart in a long quiet trace: the typical moment is in a long gap.
    bursty = parse_trace(
        "0,add,a\n0,add,b\n0,add,c\n0,add,d\n3000000,remove,a\n3010000,remove,b\n3020000,remove,c\n7200000,add,e\n",
        origin="t.csv",
    )
    assert failure_interval_s(bursty) == pytest.approx(4180.0)  # the last removal to the end
    assert math.isinf(failure_interval_s(parse_trace("0,add,a\n60000,add,b\n", origin="t.csv")))
