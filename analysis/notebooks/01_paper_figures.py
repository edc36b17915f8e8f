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
# Throughput against failure frequency, throughput over spot-instance traces, and where the
# node time goes, for Oobleck, Varuna and Bamboo, from the outputs of `python -m oobleck.simulate`
# (`experiment=paper_failure_frequency`, `experiment=paper_spot`). Point `sim_dirs` at those run
# dirs; with none, the notebook runs the simulation given by `simulate` itself.

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
from analysis.load import breakdown, format_throughput_table, load_sim
from analysis.paper_figures import markdown_table

out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
if not sim_dirs:
    from oobleck.config import compose_config
    from oobleck.simulate import run as run_simulation

    cfg = compose_config(*simulate, "logger.progress_bar=false", "sim.figures=false")
    run_simulation(cfg, out / "simulation")
    sim_dirs = [str(out / "simulation")]

sims = [load_sim(d) for d in sim_dirs]
metrics = pd.concat([s.metrics for s in sims], ignore_index=True)
summary = pd.concat([s.summary for s in sims], ignore_index=True)
if models:
    metrics, summary = metrics[metrics["model"].isin(models)], summary[summary["model"].isin(models)]
if traces:
    metrics, summary = metrics[metrics["trace"].isin(traces)], summary[summary["trace"].isin(traces)]
assert not summary.empty, f"no simulated runs left for models={models}, traces={traces} in {sim_dirs}"
print(f"{len(summary)} simulated runs: {summary['model'].nunique()} models x {summary['trace'].nunique()} traces")

# %% [markdown]
# ## Throughput (samples/s) and Oobleck's speedup
# A baseline that does not fit in GPU memory reads OOM, and so does the speedup over it.

# %%
print(format_throughput_table(summary))
(out / "paper_table.md").write_text(markdown_table(summary))
display(Markdown(markdown_table(summary)))

# %% [markdown]
# ## Figures

# %%
written = write_figures(metrics, summary, out, bin_s=float(bin_s))
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
