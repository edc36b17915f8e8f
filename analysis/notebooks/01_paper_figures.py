# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The paper's simulator figures
#
# Throughput against failure frequency, throughput over spot-instance traces, where the node time
# goes, and Oobleck's speedups with their bands over the constants nobody measured on the modelled
# hardware, for Oobleck, Varuna, Bamboo, torchft and ReCycle, from the outputs of
# `python -m oobleck.simulate` (`experiment=paper_failure_frequency`, `experiment=paper_spot`, on
# one testbed). Point
# `sim_dirs` at those run dirs; with none, the notebook runs the simulation given by `simulate`.

# %% tags=["parameters"]
sim_dirs = []  # run dirs of python -m oobleck.simulate
simulate = ["experiment=paper_spot"]  # overrides of a simulation to run when sim_dirs is empty
out_dir = "paper_figures"  # figures (PNG + PDF) and tables are written here
models = None  # e.g. ["gpt3_2_7b", "gpt3_6_7b"]; None: every simulated model
traces = None  # e.g. ["synthetic/10m"]; None: every trace
bin_s = 600.0  # time bin of the throughput-over-time figure (seconds of trace time)

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Image, Markdown, display

from analysis.figures import write_figures
from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import breakdown, cliff_notes, format_throughput_table, load_sim
from analysis.paper_figures import markdown_table, recycle_table

out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
if not sim_dirs:
    from oobleck.config import compose_config
    from oobleck.simulate import run as run_simulation

    cfg = compose_config(*simulate, "logger.progress_bar=false", "sim.figures=false")
    run_simulation(cfg, out / "simulation")
    sim_dirs = [str(out / "simulation")]

sims = [load_sim(d) for d in sim_dirs]


def merged(name):
    frames = [getattr(s, name) for s in sims if not getattr(s, name).empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


metrics, summary, band, ratios = merged("metrics"), merged("summary"), merged("band"), merged("ratios")
for column, wanted in (("model", models), ("trace", traces)):
    if wanted:
        metrics, summary = metrics[metrics[column].isin(wanted)], summary[summary[column].isin(wanted)]
        band = band[band[column].isin(wanted)] if not band.empty else band
        ratios = ratios[ratios[column].isin(wanted)] if not ratios.empty else ratios
assert not summary.empty, f"no simulated runs left for models={models}, traces={traces} in {sim_dirs}"
print(f"{len(summary)} simulated runs: {summary['model'].nunique()} models x {summary['trace'].nunique()} traces")

# %% [markdown]
# ## Throughput (samples/s) and Oobleck's speedup
# A baseline that does not fit in GPU memory reads OOM, and so does the speedup over it. A ratio
# reads `median [min-max]` over the shifted starts at the nominal constants, then `{low-high}`:
# its band over the uncertain constants (`sim.uncertain`) and the starts, `!` where the band
# crosses the cliff (a restart plus a checkpoint interval stops fitting between failures), `!!`
# where it lies beyond it.

# %%
print(format_throughput_table(summary, ratios if not ratios.empty else None))
for line in cliff_notes(ratios if not ratios.empty else None):
    print(line)
table_md = markdown_table(summary, ratios if not ratios.empty else None)
if recycle_table(summary):  # ReCycle's throughput over Oobleck's and Bamboo's, beside its own claims
    table_md += "\nReCycle beside its published claims (its throughput over the others', same start):\n\n"
    table_md += recycle_table(summary)
(out / "paper_table.md").write_text(table_md)
display(Markdown(table_md))

# %% [markdown]
# ## Figures

# %%
written = write_figures(
    metrics,
    summary,
    out,
    bin_s=float(bin_s),
    band=band if not band.empty else None,
    ratios=ratios if not ratios.empty else None,
)
for path in written:
    if path.suffix == ".png":
        print(path)
        display(Image(filename=str(path)))

# %% [markdown]
# ## Where the node time goes
# Shares of alive node time per strategy (rows of the effective-time figure).

# %%
shares = breakdown(summary).assign(
    model=lambda f: f["model"].map(model_label),
    trace=lambda f: f["trace"].map(trace_label),
    strategy=lambda f: f["strategy"].map(strategy_label),
)
table = shares.pivot_table(index=["model", "trace", "strategy"], columns="category", values="fraction", sort=False)
oom = (
    summary.assign(
        model=summary["model"].map(model_label),
        trace=summary["trace"].map(trace_label),
        strategy=summary["strategy"].map(strategy_label),
    )
    .set_index(["model", "trace", "strategy"])["oom"]
    .astype(bool)
)
table = table.round(3).astype(object)
table.loc[oom[oom].index] = "OOM"
table.to_csv(out / "effective_time.csv")
table
