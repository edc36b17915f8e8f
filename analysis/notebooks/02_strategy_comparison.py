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
# # Strategies compared on real runs under one failure schedule
#
# Real runs of `python -m oobleck.run` (e.g. a sweep `-m strategy=oobleck,varuna,bamboo`): their
# throughput over time with every failure, join and recovery marked, what each recovery or restart
# spent its time on, and how much of each run's time was lost. Runs are told apart by their config
# (strategy, model, failure schedule, nodes), so sweep job dirs named 0, 1, 2 stay distinct.

# %% tags=["parameters"]
run_dirs = []  # run dirs of python -m oobleck.run
sweep_dirs = []  # Hydra multirun folders (multirun/, or one sweep in it)
failures = None  # compare only runs with this failure schedule label (e.g. "remove1@8"); None: the most common
model = None  # only this model (config model.name); None: any
out_dir = "strategy_comparison"  # figures (PNG + PDF) and tables are written here

# %%
from pathlib import Path

from IPython.display import Image, display

from analysis.comparison import recovery_breakdown, time_lost
from analysis.load import load_run_set
from analysis.run_figures import recovery_breakdown_plot, throughput_timeline, time_lost_plot

assert run_dirs or sweep_dirs, "give run_dirs or sweep_dirs"
runs = load_run_set(run_dirs, sweep_dirs)
if model is not None:
    runs = runs.select(model=model)
if failures is None:
    failures = runs.runs["failures"].mode().iloc[0]
runs = runs.select(failures=failures)
assert not runs.runs.empty, f"no run with failures={failures!r}"
out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
print(f"{len(runs.runs)} runs under failure schedule {failures!r}")
runs.runs[["run", "strategy", "model", "nodes", "failures", "label"]]

# %% [markdown]
# ## The comparison, with the host each run ran on
# `fault`: crash (SIGKILL: the harness hears of it at once, torchft after its heartbeat timeout) or
# hang (SIGSTOP: every strategy waits the heartbeat timeout); ratios pair runs of one fault type.
# The host columns come from each run's summary.json; a warning is printed when the load exceeded
# the cores or the training processes outnumbered them (the times are then partly the scheduler's).
# A comparison under the measurement protocol (repeats, seeded failure steps) is read by
# `python -m analysis.comparison DIR` on the benchmark's dir instead.

# %%
from analysis.comparison import host_warnings, strategy_table, with_hosts

table = with_hosts(strategy_table(runs), runs)
table.to_csv(out / "comparison.csv", index=False)
for warning in host_warnings(table):
    print(warning)
table.round(3)

# %% [markdown]
# ## Throughput over time
# Each step at its measured rate over the time it took; red lines: failures injected; blue
# dashed: joins; shaded: recoveries (from the failure to the end of the first step after it).

# %%
for path in throughput_timeline(runs, out / "throughput_timeline.png"):
    if path.suffix == ".png":
        display(Image(filename=str(path)))

# %% [markdown]
# ## Recovery and restart breakdown (seconds)

# %%
phases = recovery_breakdown(runs)
phases.to_csv(out / "recovery_breakdown.csv", index=False)
for path in recovery_breakdown_plot(runs, out / "recovery_breakdown.png"):
    if path.suffix == ".png":
        display(Image(filename=str(path)))
phases.pivot_table(
    index=["label", "kind", "recovery"], columns="phase", values="seconds", sort=False
) if not phases.empty else phases

# %% [markdown]
# ## Time lost
# `useful_s`: the committed steps at the run's steady step time; the rest of the span is lost to
# recoveries (beyond their first step), checkpoint stalls, and other causes (redone steps).

# %%
lost = time_lost(runs)
lost.to_csv(out / "time_lost.csv", index=False)
for path in time_lost_plot(lost, out / "time_lost.png"):
    if path.suffix == ".png":
        display(Image(filename=str(path)))
lost.set_index("label")[
    ["span_s", "useful_s", "recovery_s", "checkpoint_s", "other_lost_s", "redone_steps", "goodput"]
].round(3)
