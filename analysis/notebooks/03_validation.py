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
# # The simulator against real runs
#
# Each real run's own membership changes are replayed by the simulator (Oobleck policy, real
# planner) over the same window, and its step time, throughput and recovery time are compared
# with what the runtime measured (`oobleck.sim.validate`). Three models: `planner` (the cost
# model as is), `calibrated` (one overhead fitted on the run's own first generation: partly
# in-sample) and, given calibration runs, `predicted` (the runtime overhead measured on *other*
# runs: the out-of-sample validation, `analysis.validation`). Targets: throughput within 15%,
# recovery within 50%. Calibration and predicted runs should run back to back on an idle machine
# (analysis/README.md: the runtime's step time moves with other jobs' load).

# %% tags=["parameters"]
runs = []  # run dirs of python -m oobleck.run to validate
calibration = []  # other run dirs to measure the runtime overhead on (one with a failure); [] skips "predicted"
sweep_dirs = []  # or: Hydra multirun folders; with calibration_jobs, their jobs split into both roles
calibration_jobs = []  # job numbers (e.g. ["0"]) of the sweeps' runs used for calibration
out_dir = "validation"

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Image, display

from analysis.load import load_sweep
from analysis.validation import ratio_plot, validation_table
from oobleck.sim.validate import validate_run

for sweep in sweep_dirs:
    jobs = load_sweep(sweep).runs
    calibration = list(calibration) + list(jobs[jobs["job"].isin(calibration_jobs)]["path"])
    runs = list(runs) + list(jobs[~jobs["job"].isin(calibration_jobs)]["path"])
assert runs, "give runs (or sweep_dirs)"
out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)

tables = []
for run in runs:
    table = validate_run(run).table
    tables.append(table.assign(run=str(run)))
if calibration:
    predicted = validation_table(list(calibration), list(runs))
    print(f"runtime overhead measured on {len(calibration)} calibration runs: {predicted.attrs['runtime']}")
    tables.append(predicted.assign(model="predicted"))
table = pd.concat(tables, ignore_index=True)
table.to_csv(out / "validation.csv", index=False)
table[["run", "model", "metric", "measured", "simulated", "ratio", "target", "within_target"]]

# %% [markdown]
# ## Simulated over measured, per metric
# One dot per run and model; the shaded band is the target around exact agreement (1x).

# %%
for path in ratio_plot(table, out / "validation_ratios.png"):
    if path.suffix == ".png":
        display(Image(filename=str(path)))

# %%
summary = table.groupby(["model", "metric"])["within_target"].agg(["sum", "count"])
summary.columns = ["within target", "runs"]
summary
