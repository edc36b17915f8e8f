"""analysis/: tidy tables from simulator rows, the simulator figures, labels and the ratio tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from analysis.figures import (
    effective_time_breakdown_figure,
    throughput_over_time_figure,
    throughput_vs_frequency_figure,
    write_figures,
)
from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import (
    BREAKDOWN,
    breakdown,
    cliff_notes,
    format_throughput_table,
    load_run,
    load_sim,
    throughput_cells,
    throughput_table,
    timeline,
)
from analysis.paper_figures import main as paper_figures_main
from analysis.ratio_bands import NO_LAYOUT, no_layout_cells, ratio_bands_figure, ratio_ticks
from oobleck.errors import RunError

PNG_MAGIC = b"\x89PNG"
PDF_MAGIC = b"%PDF"


def _segments(models=("gpt3_2_7b",), traces=("synthetic/10m",)) -> pd.DataFrame:
    rows = []
    for model in models:
        for trace in traces:
            base = {"model": model, "trace": trace}
            rows += [
                {
                    **base,
                    "strategy": "oobleck",
                    "t_start_s": 0,
                    "t_end_s": 90,
                    "phase": "running",
                    "nodes_alive": 4,
                    "samples_per_s": 10.0,
                },
                {
                    **base,
                    "strategy": "oobleck",
                    "t_start_s": 90,
                    "t_end_s": 120,
                    "phase": "recovering",
                    "nodes_alive": 3,
                    "samples_per_s": 0.0,
                },
                {
                    **base,
                    "strategy": "varuna",
                    "t_start_s": 0,
                    "t_end_s": 120,
                    "phase": "running",
                    "nodes_alive": 4,
                    "samples_per_s": 5.0,
                },
                {
                    **base,
                    "strategy": "bamboo",
                    "t_start_s": 0,
                    "t_end_s": 120,
                    "phase": "stopped",
                    "nodes_alive": 4,
                    "samples_per_s": 0.0,
                },
            ]
    return pd.DataFrame(rows)


def _summary(models=("gpt3_2_7b",), traces=("synthetic/10m", "synthetic/1h")) -> pd.DataFrame:
    rows = []
    for model in models:
        for strategy, throughput, useful in (("oobleck", 7.5, 0.9), ("varuna", 5.0, 0.5), ("bamboo", 0.0, 0.0)):
            for trace in traces:
                row = {
                    "model": model,
                    "trace": trace,
                    "strategy": strategy,
                    "throughput": throughput,
                    "oom": strategy == "bamboo",
                }
                shares = {k: 0.0 for k in BREAKDOWN}
                shares["useful"] = useful
                shares["idle"] = 1.0 - useful  # what the engine reports for a run that never started
                for key, share in shares.items():
                    row[f"{key}_fraction"] = share
                    row[f"{key}_node_s"] = share * 3600.0
                rows.append(row)
    return pd.DataFrame(rows)


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


def test_labels_are_readable():
    assert [model_label(m) for m in ("gpt3_2_7b", "gpt3_6_7b", "gpt3_1_3b", "gpt3_medium", "gpt2_small", "llama")] == [
        "GPT-3 2.7B",
        "GPT-3 6.7B",
        "GPT-3 1.3B",
        "GPT-3 medium",
        "GPT-2 small",
        "llama",
    ]
    assert trace_label("synthetic/10m") == "node lost every 10m" and trace_label("synthetic/10m", short=True) == "10m"
    assert (
        trace_label("spot/ec2_p3_scaled") == "EC2 p3 spot" and trace_label("spot/ec2_g4dn_raw") == "EC2 g4dn spot (raw)"
    )
    assert trace_label("/data/my_trace.csv") == "my_trace" and strategy_label("varuna") == "Varuna"


def test_timeline_is_a_time_weighted_mean_per_bin():
    table = timeline(_segments(), bin_s=60.0)
    ours = table[table["strategy"] == "oobleck"].sort_values("time_h")
    # Bin 0-60 s: running at 10; bin 60-120 s: 30 s at 10 then 30 s at 0.
    assert ours["samples_per_s"].tolist() == pytest.approx([10.0, 5.0])
    assert ours["nodes_alive"].tolist() == pytest.approx([4.0, 3.5])
    assert ours["time_h"].tolist() == pytest.approx([0.0, 60 / 3600])


def test_timeline_draws_rolled_back_work_apart():
    segments = _segments()
    # Oobleck's 0-90 s of running: the last 30 s were later rolled back.
    first = segments.index[0]
    rolled = segments.loc[[first]].assign(t_start_s=60, t_end_s=90, durable=False)
    segments.loc[first, "t_end_s"] = 60
    segments = pd.concat([segments.assign(durable=True), rolled], ignore_index=True)
    ours = timeline(segments, bin_s=60.0).query("strategy == 'oobleck'").sort_values("time_h")
    assert ours["samples_per_s"].tolist() == pytest.approx([10.0, 0.0])
    assert ours["rolled_back_per_s"].tolist() == pytest.approx([0.0, 5.0])  # 30 s at 10 in a 60 s bin


def _band(summary: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Band rows (two samples, Varuna much slower in the second) and ratios with a cliff at 10m."""
    rows = []
    for sample, slow in ((0, 1.0), (1, 4.0)):
        for _, row in summary.iterrows():
            throughput = row["throughput"] / (slow if row["strategy"] == "varuna" else 1.0)
            rows.append(
                {**row[["model", "trace", "strategy", "oom"]].to_dict(), "throughput": throughput, "sample": sample}
            )
    band = pd.DataFrame(rows).assign(start=0)
    ratios = pd.DataFrame(
        [
            {
                "model": "gpt3_2_7b",
                "trace": trace,
                "baseline": "varuna",
                "ratio_median": 1.5,
                "ratio_min": 1.5,
                "ratio_max": 1.5,
                "ratio_low": 1.5,
                "ratio_high": 6.0,
                "band_unbounded": 0,
                "cliff": trace == "synthetic/10m",
                "beyond_cliff": False,
                "cycle_low_s": 300.0,
                "cycle_high_s": 900.0,
                "failure_interval_s": 600.0 if trace == "synthetic/10m" else 3600.0,
            }
            for trace in ("synthetic/10m", "synthetic/1h")
        ]
    )
    return band, ratios


def test_bands_and_cliffs_are_printed_and_drawn_with_what_they_mean():
    summary = _summary()
    band, ratios = _band(summary)
    cells = throughput_cells(summary, ratios=ratios)
    assert cells.loc[("gpt3_2_7b", "synthetic/10m"), "oobleck/varuna"] == "1.5 {1.5-6!}"
    assert cells.loc[("gpt3_2_7b", "synthetic/1h"), "oobleck/varuna"] == "1.5 {1.5-6}"
    (note,) = cliff_notes(ratios)
    assert "300-900 s over the band, against 600 s between failures" in note
    fig = throughput_vs_frequency_figure(summary, band, ratios)
    text = " ".join(_texts(fig))
    assert "Pale bands" in text and "2 samples of the uncertain constants" in text and "!" in _texts(fig)
    pale = [p for p in fig.axes[0].patches if p.get_alpha() is not None and p.get_alpha() < 1]
    varuna = [p for p in pale if p.get_facecolor()[:3] == pytest.approx((0xD9 / 255, 0x5F / 255, 0x02 / 255))]
    assert [(p.get_y(), p.get_y() + p.get_height()) for p in varuna] == [(1.25, 5.0), (1.25, 5.0)]
    fig = ratio_bands_figure(ratios)
    assert "thin line: the band over the samples" in " ".join(_texts(fig)) and "!" in " ".join(_texts(fig))
    # A baseline out of memory in a cell is said there, not left blank.
    oom = ratios.iloc[:1].assign(baseline="bamboo", note="OOM", ratio_median=math.nan, ratio_low=math.nan)
    fig = ratio_bands_figure(pd.concat([ratios, oom], ignore_index=True))
    assert " OOM" in [t.get_text() for t in fig.axes[1].texts]


def test_every_ratio_panel_has_readable_ticks_and_a_model_nothing_lays_out_has_its_row():
    # A narrow range (Bamboo's 1-1.07x) gets round, evenly spaced ticks, not the 1x tick alone.
    narrow = ratio_ticks(0.98, 1.1)
    assert len(narrow) >= 3 and all(0.98 <= t <= 1.1 for t in narrow) and 1.0 in narrow
    assert ratio_ticks(0.5, 500) == [1.0, 10.0, 100.0]  # decades over a wide one
    assert ratio_ticks(0.8, 12) == [1.0, 2.0, 5.0, 10.0]

    def row(model, baseline, median, low, high, note="", oobleck_oom=False):
        return {
            "model": model,
            "trace": "synthetic/llama3_rate_1024x8_7d",
            "baseline": baseline,
            "ratio_median": median,
            "ratio_min": low,
            "ratio_max": high,
            "note": note,
            "oobleck_oom": oobleck_oom,
        }

    nan = math.nan
    ratios = pd.DataFrame(
        [
            row("gpt_70b", "varuna", 4.0, 2.0, 9.0),
            row("gpt_70b", "bamboo", 1.03, 1.0, 1.07),
            row("gpt_405b", "varuna", nan, nan, nan, "OOM", True),
            row("gpt_405b", "bamboo", nan, nan, nan, "OOM", True),
        ]
    )
    assert no_layout_cells(ratios) == {("gpt_405b", "synthetic/llama3_rate_1024x8_7d")}
    fig = ratio_bands_figure(ratios)
    trace = trace_label("synthetic/llama3_rate_1024x8_7d", short=True)
    rows = [f"{model_label(m)}, {trace}" for m in ("gpt_70b", "gpt_405b")]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == rows  # the panels share the rows
    for ax in fig.axes:
        low, high = ax.get_xlim()
        assert len([t for t in ax.get_xticks() if low <= t <= high]) >= 3, ax.get_title()
        assert [t.get_text() for t in ax.texts] == [f" {NO_LAYOUT}"]
    # A model Oobleck fits but a baseline does not: that panel says why, the row is no "no layout".
    fits = ratios.assign(oobleck_oom=False)
    assert no_layout_cells(fits) == set()
    assert [t.get_text() for t in ratio_bands_figure(fits).axes[1].texts] == [" OOM"]


def test_every_figure_says_what_its_marks_are():
    over_time = " ".join(_texts(throughput_over_time_figure(_segments(), 60.0, _summary())))
    assert "unshifted trace (start 0)" in over_time and "rolled back" in over_time and "nodes alive" in over_time
    breakdown_text = " ".join(_texts(effective_time_breakdown_figure(_summary())))
    assert "the unshifted trace (start 0) at the nominal constants" in breakdown_text
    bars = " ".join(_texts(throughput_vs_frequency_figure(_summary())))
    assert "whiskers: the lowest to the highest start" in bars


def test_breakdown_and_throughput_tables():
    long = breakdown(_summary())
    shares = long.groupby(["trace", "strategy"])["fraction"].sum()
    assert shares.tolist() == pytest.approx([1.0] * len(shares))
    table = throughput_table(_summary())
    assert table.loc[("gpt3_2_7b", "synthetic/10m"), "oobleck/varuna"] == pytest.approx(1.5)
    assert pd.isna(table.loc[("gpt3_2_7b", "synthetic/10m"), "oobleck/bamboo"])  # bamboo OOM: no ratio


def test_ratio_table_prints_oom_not_inf():
    summary = _summary()
    summary.loc[(summary["strategy"] == "varuna") & (summary["trace"] == "synthetic/1h"), "throughput"] = 0.0
    text = format_throughput_table(summary)
    assert "inf" not in text and "nan" not in text.lower() and "OOM" in text
    cells = throughput_cells(summary)
    columns = ["oobleck", "varuna", "bamboo", "oobleck/varuna", "oobleck/bamboo"]
    assert cells.loc[("gpt3_2_7b", "synthetic/10m"), columns].tolist() == ["7.5", "5", "OOM", "1.5", "OOM"]
    # Varuna fit in memory but made no progress: not OOM, not inf.
    assert cells.loc[("gpt3_2_7b", "synthetic/1h"), columns].tolist() == ["7.5", "0", "OOM", "no progress", "OOM"]


def test_figures_are_written_as_png_and_pdf(tmp_path: Path):
    written = write_figures(_segments(), _summary(), tmp_path, bin_s=60.0)
    names = sorted(p.name for p in written)
    stems = ["effective_time_breakdown", "throughput_over_time", "throughput_vs_frequency"]
    assert names == sorted(f"{s}{suffix}" for s in stems for suffix in (".pdf", ".png"))
    for path in written:
        magic = PNG_MAGIC if path.suffix == ".png" else PDF_MAGIC
        assert path.read_bytes()[: len(magic)] == magic and path.stat().st_size > 10_000


def test_facet_titles_are_readable_and_legends_shared():
    fig = throughput_vs_frequency_figure(_summary(models=("gpt3_2_7b", "gpt3_6_7b")))
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["GPT-3 2.7B", "GPT-3 6.7B"]
    assert "OOM" in _texts(fig) and len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)


def test_throughput_over_time_is_a_grid_with_one_legend():
    models, traces = ("gpt3_2_7b", "gpt3_6_7b"), ("synthetic/10m", "spot/ec2_p3_scaled")
    fig = throughput_over_time_figure(_segments(models, traces), 60.0, _summary(models, traces))
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        "GPT-3 2.7B, node lost every 10m",
        "GPT-3 6.7B, node lost every 10m",
        "GPT-3 2.7B, EC2 p3 spot",
        "GPT-3 6.7B, EC2 p3 spot",
    ]
    assert len(fig.legends) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == [
        "Oobleck",
        "Varuna",
        "Bamboo",
        "nodes alive",
        "work later rolled back",
    ]
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert _texts(fig).count("Bamboo: out of memory") == 4
    width, height = fig.get_size_inches()
    assert width / height < 2.5  # a grid, not one tall strip of panels


def test_breakdown_marks_out_of_memory_instead_of_idle():
    fig = effective_time_breakdown_figure(_summary())
    (ax,) = fig.axes
    assert ax.get_title(loc="left") == "GPT-3 2.7B"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["Oobleck\n10m", "Oobleck\n1h", "Varuna\n10m", "Varuna\n1h", "Bamboo\n10m", "Bamboo\n1h"]
    assert _texts(fig).count("out of\nmemory") == 2
    # The stacked bars of the Bamboo columns are empty (height 0): no idle share is drawn for them.
    stacked = [p for p in ax.patches if p.get_hatch() is None]
    bamboo = [p for p in stacked if round(p.get_x() + p.get_width() / 2) in (4, 5)]
    assert bamboo and all(p.get_height() == 0 for p in bamboo)
    assert "out of memory" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_paper_figures_regenerate_from_a_sim_dir(tmp_path: Path):
    sim = tmp_path / "sim"
    sim.mkdir()
    _segments().to_csv(sim / "sim_metrics.csv", index=False)
    _summary().to_csv(sim / "sim_summary.csv", index=False)
    assert paper_figures_main([str(tmp_path / "out"), str(sim), "--bin-s", "60"]) == 0
    table = (tmp_path / "out" / "paper_table.md").read_text()
    assert "| GPT-3 2.7B | 10m | 7.5 | 5 | OOM | 1.5 | OOM | 13.9x vs Varuna |" not in table  # headline is 6.7B's
    assert "| GPT-3 2.7B | 10m | 7.5 | 5 | OOM | 1.5 | OOM |  |" in table and "inf" not in table
    assert (tmp_path / "out" / "throughput_over_time.pdf").is_file()
    assert load_sim(sim).summary.shape[0] == 6


def test_load_run_reads_files_and_names_missing_ones(tmp_path: Path):
    with pytest.raises(RunError, match="metrics.csv does not exist"):
        load_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,time_s,samples\n1,0.5,8\n2,1.0,8\n")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2}))
    run = load_run(tmp_path)
    assert run.metrics["samples"].sum() == 16 and run.summary == {"steps": 2} and run.events.empty
    assert run.labels.strategy == "unknown" and run.labels.model == "unknown"
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(RunError, match="plan.json: not valid JSON"):
        load_run(tmp_path)


def test_repeated_runs_are_judged_by_their_median_ratio():
    from analysis.validation import across_repeats

    rows = [("D", "throughput", 100.0, r * 100.0, r, 0.15) for r in (0.9, 1.5, 0.95)]
    rows += [("E", "throughput", 10.0, 3.0, 0.3, 0.15), ("D", "recovery_s", 1.0, 0.6, 0.6, 0.5)]
    table = pd.DataFrame(rows, columns=["case", "metric", "measured", "simulated", "ratio", "target"])
    table["within_target"] = (table["ratio"] - 1).abs() <= table["target"]
    out = across_repeats(table).set_index(["case", "metric"])
    d = out.loc[("D", "throughput")]
    assert (d["repeats"], d["ratio"], d["ratio_min"], d["ratio_max"], d["repeats_within"]) == (3, 0.95, 0.9, 1.5, 2)
    assert bool(d["within_target"]) and d["simulated"] == 95.0
    assert not bool(out.loc[("E", "throughput"), "within_target"]) and bool(
        out.loc[("D", "recovery_s"), "within_target"]
    )
    with pytest.raises(RunError, match="case"):
        across_repeats(table.drop(columns=["case"]))


def test_recycle_is_printed_beside_its_published_claims(tmp_path: Path):
    from analysis.paper_figures import RECYCLE_CLAIMS, recycle_ratios, recycle_table

    rows = []
    for start, (oobleck, bamboo, recycle) in enumerate(((10.0, 5.0, 8.0), (10.0, 4.0, 6.0), (10.0, 5.0, 7.0))):
        for strategy, throughput in (("oobleck", oobleck), ("bamboo", bamboo), ("recycle", recycle)):
            rows.append(
                {"testbed": "tb", "model": "gpt3_medium", "trace": "synthetic/10m", "start": start}
                | {"strategy": strategy, "throughput": throughput, "oom": False, "ran": True}
            )
    rows += [
        {"testbed": "tb", "model": "gpt3_6_7b", "trace": "synthetic/10m", "start": 0}
        | {"strategy": s, "throughput": t, "oom": s == "bamboo", "ran": True}
        for s, t in (("oobleck", 10.0), ("bamboo", 0.0), ("recycle", 5.0))
    ]
    ratios = recycle_ratios(pd.DataFrame(rows)).set_index(["model", "versus"])
    medium = ratios.loc[("gpt3_medium", "oobleck")]
    # Same-start ratios 0.8, 0.6, 0.7: their median and range, beside the claim.
    assert (medium["ratio_median"], medium["ratio_min"], medium["ratio_max"]) == pytest.approx((0.7, 0.6, 0.8))
    assert medium["claimed_up_to"] == RECYCLE_CLAIMS["oobleck"] == 1.46
    assert ratios.loc[("gpt3_medium", "bamboo"), "ratio_median"] == pytest.approx(1.5)  # 1.6, 1.5, 1.4
    big = ratios.loc[("gpt3_6_7b", "bamboo")]
    assert math.isnan(big["ratio_median"]) and big["note"] == "OOM"
    table = recycle_table(pd.DataFrame(rows))
    assert "ReCycle / Oobleck (claimed: up to 1.46x) | ReCycle / Bamboo (claimed: up to 1.64x)" in table
    assert "| GPT-3 medium | 10m | 0.7 [0.6-0.8] | 1.5 [1.4-1.6] |" in table
    assert "| GPT-3 6.7B | 10m | 0.5 | OOM |" in table
    # Without ReCycle in the experiment there is no table.
    assert recycle_table(pd.DataFrame([r for r in rows if r["strategy"] != "recycle"])) == ""
    # paper_figures writes it under the ratio table.
    sim = tmp_path / "sim"
    sim.mkdir()
    _segments().to_csv(sim / "sim_metrics.csv", index=False)
    shares = {f"{k}_{unit}": 0.0 for k in BREAKDOWN for unit in ("fraction", "node_s")}
    pd.DataFrame([{**r, **shares, "useful_fraction": 1.0, "useful_node_s": 3600.0} for r in rows]).to_csv(
        sim / "sim_summary.csv", index=False
    )
    assert paper_figures_main([str(tmp_path / "out"), str(sim), "--bin-s", "60"]) == 0
    assert "| GPT-3 medium | 10m | 0.7 [0.6-0.8] | 1.5 [1.4-1.6] |" in (tmp_path / "out" / "paper_table.md").read_text()
