"""The wandb side of a run, real or simulated: who it is, how its metrics are laid out, what it saves.

- Identity (``run_identity``): the group is the experiment (``logger.wandb.group`` wins; a Hydra
  sweep without an experiment is one group; a lone run is grouped with the runs it compares to:
  same model, cluster size and failure schedule), the job type is the strategy, the tags name
  the model, cluster size, failure schedule or trace and experiment, and the name is unique in
  a sweep (it ends with the Hydra job number).
- Layout (``WandbRun``): history keys carry a prefix (``train/``, ``sim/``, ``event/``) and
  ``define_metric`` ties each prefix to its x-axis (``step``, ``time_s``, ``sim_time_h``); every
  event is a marker on the time axis (``event/<kind>`` counts that kind so far, numeric fields
  follow as ``event/<kind>/<field>``) and all events end up in one typed table.
- Outputs: the run dir's files as one artifact, and the run's totals as its summary, written
  after the last history row so that nothing logged later overwrites a total.
- Continuity: run ids are kept in ``<run dir>/wandb_run_ids.json`` (key ``run`` for a real run,
  one key per simulated model/trace/strategy); a resumed or requeued job in the same run dir
  continues the same wandb run (``resume="allow"``).
"""

from __future__ import annotations

import json
import math
import secrets
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from oobleck.checks import choice
from oobleck.errors import RunError

RUN_IDS_FILE = "wandb_run_ids.json"
TAG_LIMIT = 64  # wandb rejects longer tags
EVENT_PREFIX = "event/"


@dataclass(frozen=True)
class SweepJob:
    """Where a run sits in a Hydra multirun (``-m``)."""

    num: int
    override_dirname: str
    sweep_dir: str


@dataclass(frozen=True)
class RunIdentity:
    name: str
    group: str
    job_type: str
    tags: tuple[str, ...]


def sweep_job(run_dir: str | Path) -> SweepJob | None:
    """The Hydra multirun job this run dir belongs to, or None for a single run.

    Hydra's live config answers in the job's own process; otherwise ``.hydra/hydra.yaml``
    (which Hydra writes before the job starts) does.
    """
    hydra: Any = None
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hydra = HydraConfig.get()
    except ImportError:  # pragma: no cover - hydra is a dependency
        hydra = None
    if hydra is None:
        path = Path(run_dir) / ".hydra" / "hydra.yaml"
        if not path.is_file():
            return None
        from omegaconf import OmegaConf

        hydra = OmegaConf.load(path).hydra
    if str(hydra.mode) != "RunMode.MULTIRUN" and str(hydra.mode) != "MULTIRUN":
        return None
    return SweepJob(int(hydra.job.num), str(hydra.job.override_dirname), str(hydra.sweep.dir))


def failures_label(failures: Mapping[str, Any] | None) -> str:
    """A short name for a failure schedule: ``none``, ``remove1@8``, ``mtbf60s``, ``spot/ec2_p3_scaled``;
    a preemption notice is appended: ``remove1@8~5s`` (that event's), ``spot/ec2_p3_scaled~30s``
    (``failures.notice_s``, every removal's)."""
    failures = failures or {}
    kind = str(failures.get("kind", "none"))
    default = float(failures.get("notice_s") or 0.0)
    every = f"~{default:g}s" if default > 0 else ""
    if kind == "trace":
        return f"{failures.get('trace')}{every}"
    if kind == "poisson":
        return f"mtbf{float(failures.get('mtbf_s', 0)):g}s{every}"
    if kind == "explicit":
        events = list(failures.get("events") or [])
        if not events:
            return "none"
        if len(events) > 3:
            return f"explicit{len(events)}{every}"
        parts = []
        for event in events:
            action = event.get("action", "remove")
            count = len(event.get("nodes") or []) or event.get("count") or 1
            at = f"@{event['step']}" if event.get("step") is not None else f"@{float(event.get('time_s') or 0):g}s"
            own = event.get("notice_s")
            notice = (float(own) if own is not None else default) if action == "remove" else 0.0
            parts.append(f"{action}{count}{at}" + (f"~{notice:g}s" if notice > 0 else ""))
        return "+".join(parts)
    return kind


def choose_group(group: str | None, experiment: str | None, sweep: SweepJob | None, default: str) -> str:
    """``logger.wandb.group``, else the experiment, else the Hydra sweep, else ``default``."""
    if group:
        return str(group)
    if experiment and experiment != "default":
        return str(experiment)
    if sweep is not None:
        return f"sweep-{Path(sweep.sweep_dir).name}"
    return default


def run_identity(
    *,
    strategy: str,
    model: str,
    nodes: int | str,
    failures: str,
    experiment: str | None,
    group: str | None,
    tags: Iterable[str] = (),
    sweep: SweepJob | None = None,
    simulated: bool = False,
    default_group: str | None = None,
) -> RunIdentity:
    """Name, group, job type and tags of one run (see the module docstring for the rules)."""
    schedule = failures.replace("/", "-")
    base = "-".join([f"sim-{strategy}" if simulated else strategy, model, f"n{nodes}", schedule])
    name = f"{base}-j{sweep.num}" if sweep is not None else base
    chosen = choose_group(group, experiment, sweep, default_group or f"{model}-n{nodes}-{schedule}")
    experiment = experiment if experiment and experiment != "default" else None
    labels = ["simulation" if simulated else "real", strategy, model, f"nodes={nodes}", f"failures={failures}"]
    if experiment:
        labels.append(f"experiment={experiment}")
    labels.extend(str(t) for t in tags)
    unique = tuple(dict.fromkeys(t[:TAG_LIMIT] for t in labels))
    return RunIdentity(name=name, group=chosen, job_type=strategy, tags=unique)


def stable_run_id(run_dir: Path, key: str = "run") -> str:
    """The wandb run id stored for ``key`` in the run dir, or a new one, stored there."""
    path = run_dir / RUN_IDS_FILE
    ids: dict[str, str] = {}
    if path.is_file():
        try:
            ids = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise RunError(f"{path}: not valid JSON ({error}); delete it to start new wandb runs") from None
    if key not in ids:
        # The alphabet and length wandb itself uses for run ids (wandb/sdk/lib/runid.py).
        ids[key] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        path.write_text(json.dumps(ids, indent=1))
    return ids[key]


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, numpy scalars become Python ones."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def is_number(value: Any) -> bool:
    """A real number worth plotting (bools, NaN and infinities are not)."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str)):
        value = value.item()
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def typed_frame(rows: Sequence[Mapping[str, Any]], columns: Iterable[str]) -> Any:
    """Rows as a DataFrame whose columns wandb types as it should: numbers as floats (NaN when
    absent), true/false as booleans, lists as JSON text, everything else as text."""
    import pandas as pd

    out: dict[str, Any] = {}
    for column in columns:
        values = [row.get(column) for row in rows]
        present = [v for v in values if not _missing(v)]
        if present and all(isinstance(v, bool) or type(v).__name__ == "bool_" for v in present):
            out[column] = pd.Series([None if _missing(v) else bool(v) for v in values], dtype=object)
        elif present and all(is_number(v) or (isinstance(v, float) and not math.isfinite(v)) for v in present):
            out[column] = pd.Series(
                [math.nan if _missing(v) or v is None else float(v) for v in values], dtype="float64"
            )
        else:
            out[column] = pd.Series(
                [
                    None if _missing(v) else (json.dumps(_plain(v)) if isinstance(v, (list, tuple, dict)) else str(v))
                    for v in values
                ],
                dtype=object,
            )
    return pd.DataFrame(out)


WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: dict[str, WandbMode] = {"offline": "offline", "online": "online", "disabled": "disabled"}


def check_logger(logger: Any) -> None:
    """The ``logger:`` config section's checks (``oobleck.config.validate`` calls it)."""
    choice("logger.wandb.mode", logger.wandb.mode, tuple(WANDB_MODES))


def _wandb_mode(value: object) -> WandbMode:
    """The mode as wandb's own type (``check_logger`` refused any other before the run)."""
    mode = WANDB_MODES.get(str(value))
    if mode is None:
        raise RunError(f"logger.wandb.mode={value!r}: expected one of {', '.join(WANDB_MODES)}")
    return mode


class WandbRun:
    """One wandb run with the layout above. ``axes`` maps a history prefix to its x-axis key,
    e.g. ``{"train/": "step", "event/": "time_s"}``; the x-axis keys themselves are logged as is."""

    def __init__(
        self,
        settings: Any,
        identity: RunIdentity,
        config: Mapping[str, Any],
        run_dir: str | Path,
        *,
        axes: Mapping[str, str],
        time_key: str,
        id_key: str = "run",
    ) -> None:
        import wandb  # imported lazily: slow, and only a run that logs to wandb needs it

        self.run_dir = Path(run_dir)
        self.mode = _wandb_mode(settings.mode)
        self.time_key = time_key
        self.identity = identity
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            id=stable_run_id(self.run_dir, id_key),
            resume="allow",
            name=identity.name,
            group=identity.group,
            job_type=identity.job_type,
            tags=list(identity.tags),
            config=_plain(dict(config)),
            dir=str(self.run_dir),
            mode=self.mode,
            settings=wandb.Settings(silent=True),
            reinit="create_new",
        )
        for axis in dict.fromkeys(axes.values()):
            self.run.define_metric(axis)
        for prefix, axis in axes.items():
            self.run.define_metric(f"{prefix}*", step_metric=axis)
        self._event_counts: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []

    @property
    def local_dir(self) -> Path:
        """The offline run folder (``wandb/offline-run-*``) wandb writes into."""
        return Path(self.run.dir).parent

    def update_config(self, values: Mapping[str, Any]) -> None:
        """Set config keys known only at the end (the host's load then): they replace the start's."""
        self.run.config.update(_plain(dict(values)), allow_val_change=True)

    def log(self, row: Mapping[str, Any]) -> None:
        """One history row; keys must already carry their prefix or be an x-axis key."""
        self.run.log({k: v for k, v in row.items() if is_number(v)})

    def event(self, kind: str, time: float, fields: Mapping[str, Any]) -> None:
        """A marker at ``time`` on the time axis, and a row of the typed events table."""
        count = self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
        row = {self.time_key: time, f"{EVENT_PREFIX}{kind}": count}
        row.update({f"{EVENT_PREFIX}{kind}/{k}": v for k, v in fields.items() if k != self.time_key and is_number(v)})
        self.log(row)
        self.events.append({self.time_key: time, "kind": kind, **fields})

    def table(self, key: str, rows: Sequence[Mapping[str, Any]], columns: Iterable[str] | None = None) -> None:
        import wandb

        if columns is None:
            columns = list(dict.fromkeys(k for row in rows for k in row))
        self.run.log({key: wandb.Table(dataframe=typed_frame(rows, list(columns)))})

    def image(self, key: str, path: Path) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))})

    def artifact(
        self, name: str, type_: str, files: Mapping[str, Path], texts: Mapping[str, str] | None = None
    ) -> None:
        """Files (by their name inside the artifact) plus generated text files, as one artifact."""
        import wandb

        artifact = wandb.Artifact(name, type=type_)
        for inside, path in files.items():
            if Path(path).is_file():
                artifact.add_file(str(path), name=inside)
        for inside, text in (texts or {}).items():
            with artifact.new_file(inside, mode="w") as handle:
                handle.write(text)
        self.run.log_artifact(artifact)

    def finish(self, summary: Mapping[str, Any]) -> Path:
        """Set the summary (after every history row, so no auto-summary overwrites a total),
        close the run and return its local folder."""
        self.run.summary.update(_plain(dict(summary)))
        local = self.local_dir
        self.run.finish()
        return local

    def sync_hint(self, local: Path) -> str:
        return f"wandb: run saved in {local}" + (
            f"; upload it with: wandb sync {local}" if self.mode == "offline" else ""
        )


def config_yaml(config: Mapping[str, Any]) -> str:
    """The resolved config as YAML (the artifact's ``config.yaml``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(_plain(dict(config))))


def run_dir_files(run_dir: Path, names: Iterable[str]) -> dict[str, Path]:
    """Run-dir files by their path relative to the run dir, plus Hydra's ``.hydra/`` folder."""
    files = {name: run_dir / name for name in names if (run_dir / name).is_file()}
    hydra = run_dir / ".hydra"
    if hydra.is_dir():
        files.update({f".hydra/{p.name}": p for p in sorted(hydra.glob("*.yaml"))})
    return files
