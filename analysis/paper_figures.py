"""Regenerate the paper's simulator figures and the README comparison table from saved outputs.

    python -m analysis.paper_figures OUT_DIR SIM_RUN_DIR [SIM_RUN_DIR ...]

Each SIM_RUN_DIR is a run dir of ``python -m oobleck.simulate`` (e.g. of
``experiment=paper_failure_frequency`` and ``experiment=paper_spot``, on one or both testbeds);
their tables are merged per testbed (``testbed=a100_analytic``, ``testbed=paper_testbed``), the
figures of ``analysis.figures`` are drawn into OUT_DIR (into ``OUT_DIR/<testbed>/`` when there
are several), and ``paper_table.md`` there holds Oobleck's throughput ratio over each baseline
("OOM" where a baseline does not fit in memory), its band over the uncertain constants and the
cliff thresholds, one table per testbed, beside the paper's headline figure; where ReCycle was
simulated, a second table puts its throughput over Oobleck's and Bamboo's beside ReCycle's own
published claims (``recycle_table``). The notebook
``analysis/notebooks/01_paper_figures.py`` does the same interactively.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analysis.figures import write_figures
from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import cliff_notes, load_sim, throughput_cells
from oobleck.errors import report_errors

# The paper's headline (Oobleck, SOSP'23 abstract and section 7): up to 13.9x Varuna's throughput
# for GPT-3 6.7B with one node lost every 10 minutes, and near parity when failures are rare.
PAPER_HEADLINE = {("gpt3_6_7b", "synthetic/10m", "varuna"): 13.9}
# ReCycle's published claims (Gandhi et al., SOSP'24, abstract and section 7): under failures and
# with no spare nodes, up to 1.46x Oobleck's and 1.64x Bamboo's throughput (ReCycle's over theirs).
RECYCLE_CLAIMS = {"oobleck": 1.46, "bamboo": 1.64}


def markdown_table(summary: pd.DataFrame, ratios: pd.DataFrame | None = None) -> str:
    """Throughput per model and trace (samples/s) and Oobleck's ratios, one table per testbed;
    "OOM" where a strategy does not fit in memory, each ratio's band over the uncertain constants
    in braces with "!" / "!!" where it crosses / lies beyond the cliff (the thresholds listed
    under the table), and the paper's headline beside the row it reports."""
    testbeds = list(dict.fromkeys(summary["testbed"])) if "testbed" in summary else [None]
    out = []
    for testbed in testbeds:
        part = summary[summary["testbed"] == testbed] if testbed is not None else summary
        bands = ratios
        if ratios is not None and testbed is not None and "testbed" in ratios:
            bands = ratios[ratios["testbed"] == testbed]
        if testbed is not None and len(testbeds) > 1:
            out.append(f"testbed={testbed}\n")
        out.append(_one_table(part, bands))
    return "\n".join(out)


def _one_table(summary: pd.DataFrame, ratios: pd.DataFrame | None) -> str:
    cells = throughput_cells(summary, ratios=ratios).reset_index()
    columns = [c for c in cells.columns if c not in ("model", "trace")]
    header = [
        strategy_label(c) if "/" not in str(c) else "/".join(strategy_label(p) for p in str(c).split("/"))
        for c in columns
    ]
    lines = [
        "| model | trace | " + " | ".join(header) + " | paper |",
        "| --- | --- | " + " | ".join("---:" for _ in columns) + " | ---: |",
    ]
    for _, row in cells.iterrows():
        paper = PAPER_HEADLINE.get((row["model"], row["trace"], "varuna"))
        lines.append(
            f"| {model_label(row['model'])} | {trace_label(row['trace'], short=True)} | "
            + " | ".join(str(row[c]) for c in columns)
            + f" | {'' if paper is None else f'{paper}x vs Varuna'} |"
        )
    notes = cliff_notes(ratios)
    if notes:
        lines.append("")
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def recycle_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """ReCycle's throughput over each strategy of ``RECYCLE_CLAIMS`` per (testbed, model, trace):
    the median, min and max over the shifted starts of the ratio on the same start; ``note``
    "OOM" / "does not run" / "no progress" where the other strategy has no throughput to divide
    by, and where ReCycle itself did not fit, "ReCycle OOM"."""
    keys = [k for k in ("testbed", "model", "trace") if k in summary]
    start = ["start"] if "start" in summary else []
    rows = []
    if "recycle" not in set(summary["strategy"]):
        return pd.DataFrame()
    for key, group in summary.groupby(keys, sort=False):
        by = group.set_index([*start, "strategy"]) if start else group.set_index("strategy")
        ours = group[group["strategy"] == "recycle"]
        for other in RECYCLE_CLAIMS:
            theirs = group[group["strategy"] == other]
            if theirs.empty:
                continue
            row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
            row.update(versus=other, claimed_up_to=RECYCLE_CLAIMS[other], note="")
            ratios = []
            for _, mine in ours.iterrows():
                index = (mine["start"], other) if start else other
                their = by.loc[index]
                if bool(mine.get("oom", False)):
                    row["note"] = "ReCycle OOM"
                elif bool(their.get("oom", False)):
                    row["note"] = "OOM"
                elif not bool(their.get("ran", True)):
                    row["note"] = "does not run"
                elif not float(their["throughput"]) > 0:
                    row["note"] = "no progress"
                else:
                    ratios.append(float(mine["throughput"]) / float(their["throughput"]))
            series = pd.Series(ratios, dtype=float)
            row.update(
                ratio_median=series.median() if ratios else float("nan"),
                ratio_min=series.min() if ratios else float("nan"),
                ratio_max=series.max() if ratios else float("nan"),
            )
            rows.append(row)
    return pd.DataFrame(rows)


def recycle_table(summary: pd.DataFrame) -> str:
    """``recycle_ratios`` as markdown, one table per testbed: ReCycle / Oobleck and ReCycle /
    Bamboo as "median [min-max]" over the starts, each beside ReCycle's claim; "" when ReCycle was
    not simulated."""
    ratios = recycle_ratios(summary)
    if ratios.empty:
        return ""
    out = []
    testbeds = list(dict.fromkeys(ratios["testbed"])) if "testbed" in ratios else [None]
    others = [o for o in RECYCLE_CLAIMS if o in set(ratios["versus"])]
    for testbed in testbeds:
        part = ratios[ratios["testbed"] == testbed] if testbed is not None else ratios
        if testbed is not None and len(testbeds) > 1:
            out.append(f"testbed={testbed}\n")
        header = " | ".join(f"ReCycle / {strategy_label(o)} (claimed: up to {RECYCLE_CLAIMS[o]}x)" for o in others)
        lines = [f"| model | trace | {header} |", "| --- | --- | " + " | ".join("---:" for _ in others) + " |"]
        for (model, trace), cell in part.groupby(["model", "trace"], sort=False):
            texts = []
            for other in others:
                found = cell[cell["versus"] == other]
                texts.append(_ratio_text(found.iloc[0]) if not found.empty else "-")
            lines.append(f"| {model_label(model)} | {trace_label(trace, short=True)} | " + " | ".join(texts) + " |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def _ratio_text(row: pd.Series) -> str:
    if pd.isna(row["ratio_median"]):
        return str(row["note"]) or "-"
    text = f"{row['ratio_median']:.3g}"
    low, high = f"{row['ratio_min']:.3g}", f"{row['ratio_max']:.3g}"
    return text + (f" [{low}-{high}]" if low != high else "")


def _merged(sims: list, name: str) -> pd.DataFrame:
    frames = [getattr(sim, name) for sim in sims if not getattr(sim, name).empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.paper_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("sim_dirs", nargs="+")
    parser.add_argument("--bin-s", type=float, default=600.0, help="time bin of the throughput-over-time figure")
    args = parser.parse_args(argv)
    with report_errors("analysis.paper_figures"):
        sims = [load_sim(d) for d in args.sim_dirs]
        by_testbed: dict[str | None, list] = {}
        for sim in sims:
            testbed = str(sim.summary["testbed"].iloc[0]) if "testbed" in sim.summary else None
            by_testbed.setdefault(testbed, []).append(sim)
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for testbed, group in by_testbed.items():
            where = out / str(testbed) if len(by_testbed) > 1 else out
            where.mkdir(parents=True, exist_ok=True)
            tables = {name: _merged(group, name) for name in ("metrics", "summary", "band", "ratios")}
            for path in write_figures(
                tables["metrics"],
                tables["summary"],
                where,
                bin_s=args.bin_s,
                band=tables["band"],
                ratios=tables["ratios"],
            ):
                print(f"written {path}")
        ratios = _merged(sims, "ratios")
        summary = _merged(sims, "summary")
        text = markdown_table(summary, ratios if not ratios.empty else None)
        recycle = recycle_table(summary)
        if recycle:
            text += "\nReCycle beside its published claims (its throughput over the others', same start):\n\n" + recycle
        (out / "paper_table.md").write_text(text)
        print(f"written {out / 'paper_table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
