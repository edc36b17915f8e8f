"""Load real run dirs, Hydra sweeps and simulator outputs into tidy pandas tables.

A real run dir (``python -m oobleck.run``) holds ``metrics.csv`` (one row per committed step),
``events.csv``, ``summary.json``, ``plan.json`` and ``.hydra/config.yaml``; a Hydra multirun
(``-m``) is ``multirun/<date>/<job.num>/`` run dirs beside ``multirun.yaml``. Runs are labelled by
their config (strategy, model, failure schedule, nodes), never by their directory name, which
sweeps repeat ("0", "1", ...). A simulation dir (``python -m oobleck.simulate``) holds
``sim_metrics.csv`` (one row per period of constant state), ``sim_events.csv``,
``sim_summary.csv`` (one row per model, trace, shifted start and strategy), ``sim_ratios.csv``
(Oobleck's speedups as median and range over the starts, their band over the uncertain constants
and the cliff), ``sim_band.csv`` (every band sample's simulations), ``sim_samples.csv`` (each
sample's constants) and ``summary.json``. Missing or malformed files raise ``RunError`` naming
the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.labels import model_label, strategy_label
from oobleck.errors import RunError
from oobleck.metrics.wandb_run import failures_label

BREAKDOWN = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
FREQUENCY_ORDER = ("6h", "3h", "1h", "30m", "10m", "5m")
LABEL_COLUMNS = ("run", "strategy", "model", "failures", "nodes", "label")


def _csv(path: Path, required: bool = True) -> pd.DataFrame:
    if not path.is_file():
        if required:
            raise RunError(f"{path} does not exist; is {path.parent} a run dir of python -m oobleck.run/simulate?")
        return pd.DataFrame()
    try:
        return pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError) as error:
        raise RunError(f"{path}: not a readable CSV ({error})") from None
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def _json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise RunError(f"{path} does not exist")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RunError(f"{path}: not valid JSON ({error})") from None


def _yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as error:  # omegaconf raises several yaml/grammar errors
        raise RunError(f"{path}: not readable YAML ({error})") from None


@dataclass(frozen=True)
class RunLabels:
    """What a run is, from its config: the keys a comparison groups and filters by."""

    strategy: str
    model: str
    failures: str
    nodes: int | None
    experiment: str

    def text(self) -> str:
        """ "Oobleck, GPT-3 tiny, 4 nodes, remove1@8": a legend entry."""
        nodes = f"{self.nodes} nodes" if self.nodes is not None else "? nodes"
        return ", ".join([strategy_label(self.strategy), model_label(self.model), nodes, self.failures])


@dataclass
class RunData:
    """One real run: per-step metrics, events, summary, plan and resolved config."""

    path: Path
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: dict[str, Any]
    plan: dict[str, Any]
    config: dict[str, Any]

    @property
    def labels(self) -> RunLabels:
        """From ``.hydra/config.yaml``; a run dir without one falls back on its own rows."""
        cfg = self.config
        strategy = (cfg.get("strategy") or {}).get("name") or self.summary.get("strategy")
        if strategy is None and "strategy" in self.metrics:
            strategy = self.metrics["strategy"].iloc[0] if not self.metrics.empty else None
        nodes = (cfg.get("cluster") or {}).get("nodes")
        if nodes is None and "nodes" in self.metrics and not self.metrics.empty:
            nodes = self.metrics["nodes"].iloc[0]
        return RunLabels(
            strategy=str(strategy or "unknown"),
            model=str((cfg.get("model") or {}).get("name", "unknown")),
            failures=failures_label(cfg.get("failures")) if cfg else "unknown",
            nodes=int(nodes) if nodes is not None and str(nodes).isdigit() else None,
            experiment=str(cfg.get("experiment", "default")),
        )


def load_run(run_dir: str | Path) -> RunData:
    path = Path(run_dir)
    hydra_cfg = path / ".hydra" / "config.yaml"
    config: dict[str, Any] = _yaml(hydra_cfg) if hydra_cfg.is_file() else {}
    return RunData(
        path=path,
        metrics=_csv(path / "metrics.csv"),
        events=_csv(path / "events.csv", required=False),
        summary=_json(path / "summary.json", required=False),
        plan=_json(path / "plan.json", required=False),
        config=config,
    )


@dataclass
class RunSet:
    """Several real runs as tidy tables, each row carrying its run's labels (``LABEL_COLUMNS``).

    ``runs``: one row per run (labels, path, sweep job and overrides when swept, and the run's
    summary.json totals); ``metrics`` and ``events``: every run's rows with its labels.
    """

    runs: pd.DataFrame
    metrics: pd.DataFrame
    events: pd.DataFrame

    def select(self, **labels: Any) -> RunSet:
        """The runs whose label columns equal the given values, e.g. ``select(failures="remove1@8")``."""
        keep = self.runs
        for column, value in labels.items():
            if column not in keep:
                raise RunError(f"select({column}=...): runs have no column {column!r}; use one of {list(keep.columns)}")
            keep = keep[keep[column] == value]
        names = set(keep["run"])
        return RunSet(keep, _only(self.metrics, names), _only(self.events, names))


def _only(frame: pd.DataFrame, names: set[str]) -> pd.DataFrame:
    return frame[frame["run"].isin(names)] if not frame.empty else frame


def _run_names(paths: list[Path]) -> list[str]:
    """Unique, short run ids: the shortest tail of the paths that tells them apart (the directory
    name where that is unique, ``<sweep>/0`` for job 0 of two sweeps)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    raise RunError(f"the same run dir is given twice: {sorted(str(p) for p in paths)}")


def _runs_from(datas: list[RunData], extra: list[dict[str, Any]]) -> RunSet:
    if not datas:
        raise RunError("no run dirs given")
    names = _run_names([d.path for d in datas])
    rows, metrics, events = [], [], []
    for name, data, more in zip(names, datas, extra):
        labels = data.labels
        tags = {
            "run": name,
            "strategy": labels.strategy,
            "model": labels.model,
            "failures": labels.failures,
            "nodes": labels.nodes,
            "label": labels.text(),
        }
        summary = {k: v for k, v in data.summary.items() if not isinstance(v, (dict, list)) and k not in tags}
        rows.append({**tags, "experiment": labels.experiment, "path": str(data.path), **more, **summary})
        metrics.append(data.metrics.assign(**tags))
        if not data.events.empty:
            events.append(data.events.assign(**tags))
    # Duplicate labels (a sweep over something the labels do not show, e.g. the seed) stay
    # apart in legends: the run id is appended.
    table = pd.DataFrame(rows)
    repeated = table["label"].duplicated(keep=False)
    if repeated.any():
        relabel = dict(
            zip(table["run"], np.where(repeated, table["label"] + " [" + table["run"] + "]", table["label"]))
        )
        table["label"] = table["run"].map(relabel)
        metrics = [m.assign(label=relabel[m["run"].iloc[0]]) if not m.empty else m for m in metrics]
        events = [e.assign(label=relabel[e["run"].iloc[0]]) for e in events]
    return RunSet(
        runs=table,
        metrics=pd.concat(metrics, ignore_index=True) if metrics else pd.DataFrame(columns=list(LABEL_COLUMNS)),
        events=pd.concat(events, ignore_index=True)
        if events
        else pd.DataFrame(columns=[*LABEL_COLUMNS, "kind", "time_s"]),
    )


def load_run_set(run_dirs: Iterable[str | Path] = (), sweeps: Iterable[str | Path] = ()) -> RunSet:
    """Real run dirs and Hydra sweeps (``load_sweep``) as one ``RunSet``."""
    datas = [load_run(d) for d in run_dirs]
    extra: list[dict[str, Any]] = [{} for _ in datas]
    for root in sweeps:
        more, more_extra = _sweep_runs(root)
        datas += more
        extra += more_extra
    return _runs_from(datas, extra)


def load_runs(run_dirs: Iterable[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Metrics and events of several real runs, each row labelled (``LABEL_COLUMNS``)."""
    runs = load_run_set(run_dirs)
    return runs.metrics, runs.events


def sweep_dirs(root: str | Path) -> list[Path]:
    """Every Hydra multirun under ``root`` (a ``multirun/`` folder, one date, or one sweep): the
    folders holding a ``multirun.yaml``."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"{root} is not a directory (expected a Hydra multirun/ folder)")
    found = sorted(p.parent for p in root.rglob("multirun.yaml"))
    if not found:
        raise RunError(f"{root}: no multirun.yaml below it; is it the output of a Hydra sweep (-m)?")
    return found


def _sweep_runs(root: str | Path) -> tuple[list[RunData], list[dict[str, Any]]]:
    datas, extra = [], []
    for sweep in sweep_dirs(root):
        jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.csv").is_file()), key=_job_order)
        for job in jobs:
            overrides_file = job / ".hydra" / "overrides.yaml"
            overrides = _yaml(overrides_file) if overrides_file.is_file() else []
            datas.append(load_run(job))
            extra.append({"sweep": sweep.name, "job": job.name, "overrides": ",".join(map(str, overrides or []))})
    if not datas:
        raise RunError(f"{root}: its sweeps have no job dir with a metrics.csv yet")
    return datas, extra


def load_sweep(root: str | Path) -> RunSet:
    """All jobs of all sweeps under ``root``, with columns ``sweep``, ``job`` and ``overrides``."""
    return load_run_set(sweeps=[root])


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


@dataclass
class SimData:
    path: Path
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: pd.DataFrame
    ratios: pd.DataFrame = field(default_factory=pd.DataFrame)
    band: pd.DataFrame = field(default_factory=pd.DataFrame)
    samples: pd.DataFrame = field(default_factory=pd.DataFrame)


def load_sim(run_dir: str | Path) -> SimData:
    path = Path(run_dir)
    return SimData(
        path=path,
        metrics=_csv(path / "sim_metrics.csv"),
        events=_csv(path / "sim_events.csv", required=False),
        summary=_csv(path / "sim_summary.csv"),
        ratios=_csv(path / "sim_ratios.csv", required=False),
        band=_csv(path / "sim_band.csv", required=False),
        samples=_csv(path / "sim_samples.csv", required=False),
    )


def frequency_label(trace: str) -> str:
    """``synthetic/10m`` -> ``10m`` (the x axis of the failure-frequency figure)."""
    return str(trace).rsplit("/", 1)[-1]


def timeline(segments: pd.DataFrame, bin_s: float) -> pd.DataFrame:
    """Time-weighted mean throughput per bin of ``bin_s`` seconds, per (model, trace, strategy).

    Columns: model, trace, strategy, time_h (bin start, hours from the trace start),
    samples_per_s (work that stayed: durable progress), rolled_back_per_s (work done there and
    later rolled back or abandoned in flight: segments with ``durable`` False; 0 for simulations
    written before that column existed), nodes_alive (time-weighted mean). Of a simulation with
    shifted starts, the first start's.
    """
    rows: list[dict[str, Any]] = []
    segments = first_start(segments)
    columns = ["model", "trace", "strategy", "time_h", "samples_per_s", "rolled_back_per_s", "nodes_alive"]
    if segments.empty:
        return pd.DataFrame(columns=columns)
    if "durable" not in segments:
        segments = segments.assign(durable=True)
    for (model, trace, strategy), group in segments.groupby(["model", "trace", "strategy"], sort=False):
        start = group["t_start_s"].min()
        end = group["t_end_s"].max()
        edges = np.arange(start, end + bin_s, bin_s)
        t0 = group["t_start_s"].to_numpy()
        t1 = group["t_end_s"].to_numpy()
        rate = group["samples_per_s"].to_numpy()
        kept = group["durable"].astype(bool).to_numpy()
        alive = group["nodes_alive"].to_numpy()
        for left in edges[:-1]:
            right = min(left + bin_s, end)
            overlap = np.clip(np.minimum(t1, right) - np.maximum(t0, left), 0.0, None)
            width = overlap.sum()
            if width <= 0:
                continue
            rows.append(
                {
                    "model": model,
                    "trace": trace,
                    "strategy": strategy,
                    "time_h": (left - start) / 3600.0,
                    "samples_per_s": float((overlap * rate * kept).sum() / width),
                    "rolled_back_per_s": float((overlap * rate * ~kept).sum() / width),
                    "nodes_alive": float((overlap * alive).sum() / width),
                }
            )
    return pd.DataFrame(rows, columns=columns)


def breakdown(summary: pd.DataFrame) -> pd.DataFrame:
    """Long form of the effective-time breakdown: model, trace, strategy, category, node_hours,
    fraction (of the first start when there are shifted starts)."""
    rows = []
    for _, row in first_start(summary).iterrows():
        for category in BREAKDOWN:
            rows.append(
                {
                    "model": row["model"],
                    "trace": row["trace"],
                    "strategy": row["strategy"],
                    "category": category,
                    "node_hours": row[f"{category}_node_s"] / 3600.0,
                    "fraction": row[f"{category}_fraction"],
                }
            )
    return pd.DataFrame(rows)


def first_start(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of each trace's unshifted replay (``start`` 0) when a simulation replayed shifted
    starts (``sim.trace_starts``): one timeline and one breakdown per run."""
    return frame[frame["start"] == 0] if "start" in frame and not frame.empty else frame


def _paired_ratios(summary: pd.DataFrame, baseline: str) -> pd.Series | None:
    """Oobleck's speedup over ``baseline`` per (model, trace, start) as the simulator paired it."""
    column = f"speedup_vs_{baseline}"
    if column not in summary:
        return None
    ours = summary[summary["strategy"] == "oobleck"]
    return ours.set_index(["model", "trace"])[column]


def throughput_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Throughput (samples/s) per model and trace, one column per strategy, plus Oobleck's ratios:
    medians over the shifted starts when there are several (a ratio is the median of the ratios
    of the same start), with ``<ratio> min`` / ``<ratio> max`` columns for their range."""
    from oobleck.sim.ratios import baselines_in

    table = summary.pivot_table(
        index=["model", "trace"], columns="strategy", values="throughput", aggfunc="median", sort=False
    )
    for baseline in baselines_in(summary):
        if "oobleck" not in table or baseline not in table:
            continue
        name = f"oobleck/{baseline}"
        paired = _paired_ratios(summary, baseline)
        if paired is None:
            table[name] = table["oobleck"] / table[baseline].replace(0.0, np.nan)
            continue
        grouped = paired.groupby(level=[0, 1], sort=False)
        table[name] = grouped.median().reindex(table.index)
        if "start" in summary and summary["start"].nunique() > 1:
            table[f"{name} min"] = grouped.min().reindex(table.index)
            table[f"{name} max"] = grouped.max().reindex(table.index)
    return table


def band_text(row: Any, digits: int = 3) -> str:
    """A ratio's band over the uncertain constants as text ("1.42-7.6", "1.42-unbounded"), with
    "!" where it crosses the cliff; "" without a band."""
    if row is None or "ratio_low" not in row or pd.isna(row.get("ratio_low")):
        return ""
    high = "unbounded" if int(row.get("band_unbounded", 0) or 0) else _significant(float(row["ratio_high"]), digits)
    return f"{_significant(float(row['ratio_low']), digits)}-{high}" + cliff_mark(row)


def cliff_mark(row: Any) -> str:
    """ "!" where a ratio's band crosses the cliff, "!!" where all of it lies beyond, else ""."""
    if bool(row.get("cliff", False)):
        return "!"
    return "!!" if bool(row.get("beyond_cliff", False)) else ""


def _ratio_rows(ratios: pd.DataFrame | None) -> dict[tuple[str, str, str], Any]:
    if ratios is None or ratios.empty:
        return {}
    return {(r["model"], r["trace"], r["baseline"]): r for _, r in ratios.iterrows()}


def throughput_cells(summary: pd.DataFrame, *, digits: int = 3, ratios: pd.DataFrame | None = None) -> pd.DataFrame:
    """``throughput_table`` as text for printing: a strategy that ran out of memory reads "OOM"
    (not 0), and so does Oobleck's ratio over it (not ``inf``); a baseline that fit but made no
    progress reads "no progress"; a ratio over several starts reads "median [min-max]", and with
    ``ratios`` (``sim_ratios.csv``) its band over the uncertain constants follows in braces,
    "{low-high}", marked "!" where it crosses the cliff and "!!" where all of it lies beyond
    (``oobleck.sim.ratios``); a throughput is
    marked "*" when the strategy kept no durable progress in some start (every iteration before
    the trace's last change was rolled back)."""
    numbers = throughput_table(summary)
    bands = _ratio_rows(ratios)
    ranged = [c for c in numbers.columns if str(c).endswith((" min", " max"))]
    numbers_shown = numbers.drop(columns=ranged)
    flags = summary.assign(oom=summary["oom"].astype(bool) if "oom" in summary else False)
    oom = flags.pivot_table(index=["model", "trace"], columns="strategy", values="oom", aggfunc="any", sort=False)
    ran = summary["ran"].astype(bool) if "ran" in summary else pd.Series(True, index=summary.index)
    refused = flags.assign(refused=~ran & ~flags["oom"]).pivot_table(
        index=["model", "trace"], columns="strategy", values="refused", aggfunc="all", sort=False
    )
    lost = None
    if "no_durable_progress" in summary:
        lost = flags.assign(nd=summary["no_durable_progress"].astype(bool)).pivot_table(
            index=["model", "trace"], columns="strategy", values="nd", aggfunc="any", sort=False
        )
    cells = pd.DataFrame(index=numbers_shown.index, columns=numbers_shown.columns, dtype=object)
    for key in numbers_shown.index:
        for column in numbers_shown.columns:
            value = numbers_shown.loc[key, column]
            strategy = column.split("/", 1)[1] if "/" in str(column) else column
            if strategy in oom.columns and bool(oom.loc[key, strategy]):
                cells.loc[key, column] = "OOM"
            elif "/" in str(column) and strategy in refused.columns and bool(refused.loc[key, strategy]):
                cells.loc[key, column] = "does not run"
            elif "/" in str(column) and pd.isna(value):
                stalled = strategy in numbers.columns and numbers.loc[key, strategy] == 0
                band = band_text(bands.get((*key, strategy)), digits) if stalled else ""
                cells.loc[key, column] = ("no progress" + (f" {{{band}}}" if band else "")) if stalled else "-"
            elif pd.isna(value):
                cells.loc[key, column] = "-"
            else:
                text = _significant(float(value), digits)
                if "/" in str(column) and f"{column} min" in numbers:
                    low, high = numbers.loc[key, f"{column} min"], numbers.loc[key, f"{column} max"]
                    text += f" [{_significant(float(low), digits)}-{_significant(float(high), digits)}]"
                if "/" in str(column):
                    band = band_text(bands.get((*key, strategy)), digits)
                    text += f" {{{band}}}" if band else ""
                if "/" not in str(column) and lost is not None and strategy in lost and bool(lost.loc[key, strategy]):
                    text += "*"
                cells.loc[key, column] = text
    return cells


def cliff_notes(ratios: pd.DataFrame | None) -> list[str]:
    """One line per cell whose band crosses the cliff ("!") or lies beyond it ("!!"), with the
    threshold."""
    lines = []
    for _, row in (ratios if ratios is not None else pd.DataFrame()).iterrows():
        mark = cliff_mark(row)
        if not mark:
            continue
        lines.append(
            f"{mark} {model_label(row['model'])}, {row['trace']}, {strategy_label(row['baseline'])}: its restart plus one "
            f"checkpoint interval takes {row['cycle_low_s']:.0f}-{row['cycle_high_s']:.0f} s over the band, against "
            f"{row['failure_interval_s']:.0f} s between failures"
        )
    return lines


def _significant(value: float, digits: int) -> str:
    """``digits`` significant digits without an exponent: 1430, 61.6, 0.012."""
    return f"{value:.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"


def format_throughput_table(summary: pd.DataFrame, ratios: pd.DataFrame | None = None) -> str:
    """Throughput per (model, trace) and strategy with Oobleck's ratios, as aligned text."""
    return throughput_cells(summary, ratios=ratios).to_string()
