"""Constants nobody measured on the modelled hardware, and the seeded samples the bands come from.

An experiment's testbed (``conf/testbed/<name>.yaml``) declares each such constant under
``sim.uncertain.<name>``: the config key it sets (``key``), its range (``low``, ``high``), whether
it is sampled on a linear or a log scale (``scale``) and where the range comes from (``source``);
the value the config already holds at ``key`` is the nominal one, the simulation every table
reports first. ``declared(cfg)`` reads and checks them (one ``ConfigError`` naming the entry, the
value and the fix).

``band_samples(constants, per_point, seed)`` draws the samples the ratios' bands are taken over
(DESIGN 5d). Constants that change iteration times or decisions (``changes_timing``: anything
but a cost constant, e.g. ``cluster.gpu.achieved_flop_fraction``) are set together
to three grid points: all at their low ends, all nominal, all at their high ends. Each grid point
needs its own profile, templates and decisions (on the spot traces those cost about as much as
the nominal simulations themselves), so the full 3^k grid is out of the time budget; for the
constants declared here (a lower achieved FLOP fraction and a lower bandwidth both slow every
iteration) the two ends are the slowest and the fastest cluster, the band's extremes in
iteration time. The cost constants (restart components, storage, detection) take a seeded Latin
hypercube of ``per_point`` samples at every grid point, which reuses the grid point's decisions
(a strategy's decisions do not depend on what recoveries cost). Sample 0 is the nominal point.
``with_values(cfg, values)`` is the config a sample simulates.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from oobleck.errors import ConfigError

SCALES = ("linear", "log")
SPEC_KEYS = ("key", "low", "high", "scale", "source")
COST_PREFIX = "sim.costs."


@dataclass(frozen=True)
class Uncertain:
    """One constant declared uncertain: its range, scale and source, and its nominal value."""

    name: str
    key: str
    low: float
    high: float
    scale: str
    source: str
    nominal: float

    @property
    def changes_timing(self) -> bool:
        """Whether it may change iteration times or decisions (and so profiles, templates and
        decisions): anything but a cost constant (``sim.costs.*``, ``sim.params.<name>.costs.*``)."""
        parts = self.key.split(".")
        return not (self.key.startswith(COST_PREFIX) or (parts[:2] == ["sim", "params"] and parts[3:4] == ["costs"]))

    def at(self, u: float) -> float:
        """The value at quantile ``u`` in [0, 1] of the range, on its scale."""
        if self.scale == "log":
            return math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        return self.low + u * (self.high - self.low)


@dataclass(frozen=True)
class Sample:
    """One point of the band: the value of every uncertain constant (by config key)."""

    index: int  # 0: the nominal point
    grid: int  # which grid point of the timing constants it belongs to
    values: Mapping[str, float]


def _number(name: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"sim.uncertain.{name}.{field}={value!r} must be a finite number")
    return float(value)


def declared(cfg: Any) -> list[Uncertain]:
    """The constants ``cfg.sim.uncertain`` declares, checked against the config they change."""
    section = cfg.sim.get("uncertain") or {}
    out = []
    for name, spec in section.items():
        if not isinstance(spec, (Mapping, DictConfig)):
            raise ConfigError(
                f"sim.uncertain.{name}={spec!r} must be a mapping with keys {', '.join(SPEC_KEYS)}; see conf/testbed/"
            )
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        missing = [k for k in SPEC_KEYS if k not in spec]
        if unknown or missing:
            raise ConfigError(
                f"sim.uncertain.{name} has {'unknown keys ' + str(unknown) if unknown else 'no ' + str(missing)}; "
                f"an uncertain constant has exactly {', '.join(SPEC_KEYS)}"
            )
        key = str(spec["key"])
        if not key.startswith(("sim.costs.", "sim.params.", "cluster.")):
            raise ConfigError(
                f"sim.uncertain.{name}.key={key!r}: only sim.costs.*, sim.params.* and cluster.* constants can be "
                "uncertain (they change costs or iteration times)"
            )
        current = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if current is None:
            raise ConfigError(
                f"sim.uncertain.{name}.key={key} has no nominal value: the config holds none at {key}; set {key}=<value> "
                "in the testbed (the value every table reports first)"
            )
        nominal = _number(name, "key (its value)", current)
        low, high = _number(name, "low", spec["low"]), _number(name, "high", spec["high"])
        scale = str(spec["scale"])
        if scale not in SCALES:
            raise ConfigError(f"sim.uncertain.{name}.scale={scale!r} is not one of {', '.join(SCALES)}")
        if not low < high:
            raise ConfigError(f"sim.uncertain.{name}: low={low:g} must be below high={high:g}")
        if scale == "log" and low <= 0:
            raise ConfigError(f"sim.uncertain.{name}.low={low:g}: a log scale needs low > 0; use scale: linear")
        if not low <= nominal <= high:
            raise ConfigError(
                f"sim.uncertain.{name}: the nominal {key}={nominal:g} lies outside [{low:g}, {high:g}]; widen the range "
                "or change the nominal value"
            )
        if not str(spec["source"]).strip():
            raise ConfigError(f"sim.uncertain.{name}.source is empty: say where the range comes from")
        out.append(Uncertain(str(name), key, low, high, scale, str(spec["source"]), nominal))
    keys = [c.key for c in out]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"sim.uncertain declares one key twice ({sorted(keys)}); one entry per constant")
    return out


def latin_hypercube(count: int, dimensions: int, rng: Any) -> list[list[float]]:
    """``count`` points in [0, 1)^dimensions, one in each of ``count`` equal strata of every dimension."""
    columns = []
    for _ in range(dimensions):
        order = rng.permutation(count)
        columns.append([(int(order[i]) + float(rng.random())) / count for i in range(count)])
    return [[column[i] for column in columns] for i in range(count)]


def band_samples(constants: Sequence[Uncertain], per_point: int, seed: int) -> list[Sample]:
    """The nominal point, then ``per_point`` cost samples at every grid point of the timing
    constants (module docstring); an empty list of constants gives the nominal point only."""
    import numpy as np

    timing = [c for c in constants if c.changes_timing]
    costs = [c for c in constants if not c.changes_timing]
    nominal = {c.key: c.nominal for c in constants}
    ends = (tuple(c.low for c in timing), tuple(c.nominal for c in timing), tuple(c.high for c in timing))
    points = list(dict.fromkeys(ends))  # one point when there is no timing constant
    at_nominal = points.index(ends[1])
    samples = [Sample(0, at_nominal, nominal)]
    if per_point <= 0 or not constants:
        return samples
    for grid, point in enumerate(points):
        rng = np.random.default_rng([seed, grid])
        draws = latin_hypercube(per_point, len(costs), rng) if costs else [[] for _ in range(per_point)]
        for row in draws:
            values = dict(zip((c.key for c in timing), point))
            values.update({c.key: c.at(u) for c, u in zip(costs, row)})
            samples.append(Sample(len(samples), grid, values))
    return samples


def with_values(cfg: Any, values: Mapping[str, float]) -> Any:
    """A copy of ``cfg`` with every ``key: value`` of a sample set."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in values.items():
            OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out
