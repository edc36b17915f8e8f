"""Ready-made wandb comparison workspaces, built with ``wandb-workspaces`` from the names the runs log.

- ``strategy_workspace``: real runs (``python -m oobleck.run``) of one group (an experiment or a
  sweep), one colour group per strategy (job type): throughput and progress over wall time and
  steps, layout changes, every event on the time axis, recovery times, and the run totals.
- ``paper_workspace``: the simulated runs of one experiment (``python -m oobleck.simulate``),
  grouped by strategy and model: throughput and nodes over simulated time, events, throughput,
  effective-time shares and Oobleck's speedups.

Building a workspace needs no server (``spec`` gives the JSON the wandb app would store, which
the tests check); ``save`` needs a wandb server and a login, which this machine does not have.
The metric names come from ``oobleck.metrics`` (``train/``, ``event/``, ``sim/``, x-axes
``step``, ``time_s``, ``sim_time_h``).

CLI::

    python -m analysis.dashboards strategies --entity ME --project oobleck --group sweep-2026-12-01_10-00-00 [--save]
    python -m analysis.dashboards paper --entity ME --project oobleck --experiment paper_spot [--save]

Without ``--save`` it prints the spec as JSON (``--out FILE`` writes it there).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from oobleck.errors import report_errors
from oobleck.extras import require
from oobleck.metrics.recorder import WANDB_AXES
from oobleck.metrics.simulation import SIM_TIME
from oobleck.sim.results import DOWNTIME_EVENTS

STEP, TIME = WANDB_AXES["train/"], WANDB_AXES["event/"]
EVENT_MARKERS = ("fault_injected", "join_started", "reconfiguration", "failover", "restart", "checkpoint", "stop")
RECOVERY_TIMES = ("reconfiguration", "failover", "restart")
BREAKDOWN_SHARES = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
# Simulated events: membership changes and the strategies' reactions that cost time (oobleck.strategy).
SIM_REACTIONS = DOWNTIME_EVENTS
SIM_EVENTS = ("failure", "join", *SIM_REACTIONS, "oom", "stop")


def _libraries() -> tuple[Any, Any]:
    require(["wandb_workspaces"], "analysis", "the wandb dashboards")
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    return ws, wr


def strategy_workspace(entity: str, project: str, group: str, *, name: str | None = None) -> Any:
    """The real-run comparison of the strategies in wandb group ``group``."""
    ws, wr = _libraries()

    def line(x: str, y: list[str], title: str) -> Any:
        return wr.LinePlot(x=x, y=y, title=title, title_x=x)

    sections = [
        ws.Section(
            name="Throughput",
            is_open=True,
            panels=[
                line(TIME, ["train/samples_per_s"], "samples/s over wall time"),
                line(STEP, ["train/samples_per_s"], "samples/s per step"),
                line(TIME, ["train/samples_total"], "samples done over wall time"),
                line(STEP, ["train/loss"], "loss"),
            ],
        ),
        ws.Section(
            name="Layout",
            is_open=True,
            panels=[
                line(TIME, ["train/generation"], "generation"),
                line(TIME, ["train/nodes"], "nodes in the plan"),
                line(TIME, ["train/pipelines"], "pipelines"),
                line(STEP, ["train/attempts"], "attempts per step"),
            ],
        ),
        ws.Section(
            name="Events",
            is_open=True,
            panels=[
                line(TIME, [f"event/{kind}" for kind in EVENT_MARKERS], "events so far (one step up per event)"),
                line(
                    TIME,
                    [f"event/{kind}/total_s" for kind in RECOVERY_TIMES],
                    "recovery time (s), at the end of each recovery",
                ),
                line(TIME, ["event/reconfiguration/bytes_moved"], "bytes moved per reconfiguration"),
            ],
        ),
        ws.Section(
            name="Totals",
            is_open=True,
            panels=[
                wr.BarPlot(metrics=[wr.SummaryMetric("samples")], title="samples"),
                wr.BarPlot(metrics=[wr.SummaryMetric("median_samples_per_s")], title="median samples/s"),
                wr.BarPlot(metrics=[wr.SummaryMetric("recoveries")], title="recoveries"),
                wr.BarPlot(metrics=[wr.SummaryMetric("wall_time_s")], title="wall time (s)"),
            ],
        ),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or f"strategies: {group}",
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=TIME, max_runs=20),
        runset_settings=ws.RunsetSettings(
            filters=ws.And(ws.Metric("Group") == group, ws.Tags().isin(["real"])),
            groupby=[ws.Metric("JobType")],
            pinned_columns=["config:strategy.name", "config:cluster.nodes", "config:failures_label", "summary:samples"],
        ),
    )


def paper_workspace(entity: str, project: str, experiment: str, *, name: str | None = None) -> Any:
    """The simulated comparison of one experiment (e.g. ``paper_failure_frequency``)."""
    ws, wr = _libraries()
    sections = [
        ws.Section(
            name="Over simulated time",
            is_open=True,
            panels=[
                wr.LinePlot(x=SIM_TIME, y=["sim/samples_per_s"], title="samples/s over simulated time (h)"),
                wr.LinePlot(x=SIM_TIME, y=["sim/nodes_alive", "sim/nodes_used"], title="nodes alive and used"),
                wr.LinePlot(x=SIM_TIME, y=[f"event/{k}" for k in SIM_EVENTS], title="events so far"),
                wr.LinePlot(
                    x=SIM_TIME, y=[f"event/{k}/downtime_s" for k in SIM_REACTIONS], title="downtime per reaction (s)"
                ),
            ],
        ),
        ws.Section(
            name="Totals",
            is_open=True,
            panels=[
                wr.BarPlot(
                    metrics=[wr.SummaryMetric("throughput")],
                    title="throughput (samples/s)",
                    groupby=wr.Config("model.name"),
                ),
                wr.BarPlot(
                    metrics=[wr.SummaryMetric("speedup_vs_varuna"), wr.SummaryMetric("speedup_vs_bamboo")],
                    title="Oobleck's speedup",
                ),
                wr.BarPlot(
                    metrics=[wr.SummaryMetric(f"{k}_fraction") for k in BREAKDOWN_SHARES], title="share of node time"
                ),
            ],
        ),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or f"simulation: {experiment}",
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=SIM_TIME, max_runs=100),
        runset_settings=ws.RunsetSettings(
            filters=ws.And(
                ws.Metric("Group") == experiment, ws.Tags().isin(["simulation"]), ws.Metric("JobType") != "figures"
            ),
            groupby=[ws.Metric("JobType"), ws.Config("model.name")],
            pinned_columns=["config:model.name", "config:failures.trace", "summary:throughput", "summary:oom"],
        ),
    )


def spec(workspace: Any) -> dict[str, Any]:
    """The workspace as the JSON view the wandb app stores (built offline)."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.dashboards", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("strategies", "paper"))
    parser.add_argument("--entity", required=True, help="wandb entity (user or team) that owns the project")
    parser.add_argument("--project", default="oobleck", help="wandb project (logger.wandb.project)")
    parser.add_argument(
        "--group", default=None, help="strategies: the wandb group of the runs (experiment or sweep-<dir>)"
    )
    parser.add_argument("--experiment", default=None, help="paper: the simulated experiment (its wandb group)")
    parser.add_argument("--save", action="store_true", help="create the workspace on the wandb server (needs a login)")
    parser.add_argument("--out", default=None, help="write the spec JSON here instead of printing it")
    args = parser.parse_args(argv)
    with report_errors("analysis.dashboards"):
        if args.kind == "strategies":
            if not args.group:
                parser.error(
                    "strategies needs --group (the runs' wandb group: their experiment, or sweep-<sweep dir name>)"
                )
            workspace = strategy_workspace(args.entity, args.project, args.group)
        else:
            if not args.experiment:
                parser.error("paper needs --experiment (e.g. paper_failure_frequency)")
            workspace = paper_workspace(args.entity, args.project, args.experiment)
        if args.save:
            workspace.save()
            print(f"saved workspace {workspace.name!r}: {workspace.url}")
            return 0
        text = json.dumps(spec(workspace), indent=1)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text)
            print(f"written {args.out}")
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
