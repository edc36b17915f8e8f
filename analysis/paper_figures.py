"""Regenerate the paper's simulator figures and the README comparison table from saved outputs.

    python -m analysis.paper_figures OUT_DIR SIM_RUN_DIR [SIM_RUN_DIR ...]

Each SIM_RUN_DIR is a run dir of ``python -m oobleck.simulate`` (e.g. of
``experiment=paper_failure_frequency`` and ``experiment=paper_spot``); their tables are merged,
the figures of ``analysis.figures`` are drawn into OUT_DIR (PNG and PDF), and ``paper_table.md``
there holds Oobleck's throughput ratio over each baseline ("OOM" where a baseline does not fit
in memory) beside the paper's headline figure. The notebook ``analysis/notebooks/01_paper_figures.py``
does the same interactively.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analysis.figures import write_figures
from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import load_sim, throughput_cells
from oobleck.errors import report_errors

# The paper's headline (Oobleck, SOSP'23 abstract and section 7): up to 13.9x Varuna's throughput
# for GPT-3 6.7B with one node lost every 10 minutes, and near parity when failures are rare.
PAPER_HEADLINE = {("gpt3_6_7b", "synthetic/10m", "varuna"): 13.9}


def markdown_table(summary: pd.DataFrame) -> str:
    """Throughput per model and trace (samples/s) and Oobleck's ratios; "OOM" where a strategy does
    not fit in memory, with the paper's headline beside the row it reports."""
    cells = throughput_cells(summary).reset_index()
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
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.paper_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("sim_dirs", nargs="+")
    parser.add_argument("--bin-s", type=float, default=600.0, help="time bin of the throughput-over-time figure")
    args = parser.parse_args(argv)
    with report_errors("analysis.paper_figures"):
        sims = [load_sim(d) for d in args.sim_dirs]
        metrics = pd.concat([s.metrics for s in sims], ignore_index=True)
        summary = pd.concat([s.summary for s in sims], ignore_index=True)
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for path in write_figures(metrics, summary, out, bin_s=args.bin_s):
            print(f"written {path}")
        (out / "paper_table.md").write_text(markdown_table(summary))
        print(f"written {out / 'paper_table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
