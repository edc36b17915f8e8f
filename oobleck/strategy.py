"""The resilience-strategy interface shared by the simulator and (later) real runs.

A strategy answers two questions, nothing else:

- ``start(nodes, restart=...)``: which layout runs on this node set, and what starting costs;
- ``react(layout, alive, removed, joined)``: what happens on a membership change: reconfigure in
  place, fail over, restart from the last checkpoint, or stop, with the downtime it costs.

Answers are plain frozen dataclasses (``Layout``, ``Reaction``), so the same objects drive the
discrete-event simulator (``oobleck.sim``) and can drive the real runtime's control plane.
Oobleck's own policy is ``oobleck.sim.policies.OobleckStrategy``; the baselines live in
``baselines/varuna`` and ``baselines/bamboo``. ``make_strategy(name, context)`` builds any of them.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from oobleck.errors import ConfigError
from oobleck.planning.plan import ExecutionPlan
from oobleck.planning.profile import ClusterSpec, ModelProfile

# Reaction actions; the simulator records each (except "none") as an event of that kind.
ACTIONS = ("start", "reconfiguration", "failover", "restart", "stop", "oom", "none")


@dataclass(frozen=True)
class Layout:
    """What runs on the cluster between two membership changes."""

    nodes: tuple[int, ...]  # nodes doing work (alive nodes not listed here are idle)
    iteration_s: float  # seconds per training iteration (one global batch), checkpoints excluded
    samples_per_iteration: int
    description: str  # e.g. "3 pipelines of 10+10+10 nodes" or "D=2 x P=15"
    # Share of the busy time spent on work that is thrown away by design (Bamboo's redundant forward).
    redundant_fraction: float = 0.0
    plan: ExecutionPlan | None = None  # Oobleck's instantiated plan
    state: Any = None  # strategy-private, immutable (e.g. Bamboo's pipeline slots)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_iteration / self.iteration_s


@dataclass(frozen=True)
class Reaction:
    """A strategy's answer to a start or a membership change.

    The simulator applies it at the change's time: the in-flight iteration is lost; if
    ``checkpoint_first`` the completed work is checkpointed (``checkpoint_s`` of the downtime);
    if ``rollback`` everything since the last completed checkpoint is lost; then no node makes
    progress for ``downtime_s``, after which ``layout`` runs (None: stopped until the next change).
    """

    action: str
    layout: Layout | None
    downtime_s: float = 0.0
    rollback: bool = False
    checkpoint_first: bool = False
    checkpoint_s: float = 0.0  # part of downtime_s spent writing that checkpoint
    bytes_moved: int = 0
    breakdown: tuple[tuple[str, float], ...] = ()  # named parts of downtime_s
    reason: str = ""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Reaction.action={self.action!r} is not one of {ACTIONS}")
        if self.downtime_s < 0 or self.checkpoint_s > self.downtime_s + 1e-9:
            raise ValueError(f"Reaction downtime_s={self.downtime_s}, checkpoint_s={self.checkpoint_s} are inconsistent")


@dataclass
class StrategyContext:
    """Everything a strategy may consult: the model profile, the cluster, the job and constants.

    Template sets are generated once per fault tolerance and cached here, so a simulation calls
    the planner's template generation once and only instantiation/reconfiguration per change.
    """

    profile: ModelProfile
    cluster: ClusterSpec  # nodes = the most nodes the run can have
    global_batch_size: int
    microbatch_size: int
    fault_tolerance: int
    reference_microbatches_per_stage: int = 4
    max_gpus_per_stage: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # this strategy's constants (conf/strategy/*.yaml)
    _templates: dict[int, Any] = field(default_factory=dict, repr=False)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    def templates(self, fault_tolerance: int | None = None):
        """The planner's TemplateSet for ``fault_tolerance`` (default: the job's f), cached."""
        from oobleck.planning.templates import generate_templates

        f = self.fault_tolerance if fault_tolerance is None else fault_tolerance
        if f not in self._templates:
            self._templates[f] = generate_templates(
                self.profile,
                self.cluster,
                f,
                reference_microbatches_per_stage=self.reference_microbatches_per_stage,
                max_gpus_per_stage=self.max_gpus_per_stage,
            )
        return self._templates[f]

    def param(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    def with_params(self, params: dict[str, Any]) -> StrategyContext:
        """The same context (sharing the template cache) with another strategy's constants."""
        clone = StrategyContext(
            profile=self.profile,
            cluster=self.cluster,
            global_batch_size=self.global_batch_size,
            microbatch_size=self.microbatch_size,
            fault_tolerance=self.fault_tolerance,
            reference_microbatches_per_stage=self.reference_microbatches_per_stage,
            max_gpus_per_stage=self.max_gpus_per_stage,
            params=dict(params),
        )
        clone._templates = self._templates
        return clone


class Strategy(ABC):
    """A resilience policy. Subclasses set ``name`` and implement ``start`` and ``react``."""

    name: str = "strategy"

    def __init__(self, context: StrategyContext) -> None:
        self.context = context

    @property
    def checkpoint_interval(self) -> int:
        """Iterations between periodic checkpoints; 0 = none."""
        return 0

    def checkpoint_s(self, layout: Layout) -> float:
        """Seconds one periodic checkpoint stops training for, on this layout."""
        return 0.0

    @abstractmethod
    def start(self, nodes: Sequence[int], *, restart: bool = False) -> Reaction:
        """Layout for a fresh start on ``nodes`` (``restart``: after a stop, so restart costs apply)."""

    @abstractmethod
    def react(
        self, layout: Layout, alive: Sequence[int], removed: Sequence[int], joined: Sequence[int]
    ) -> Reaction:
        """Answer to ``removed`` nodes failing and ``joined`` nodes arriving; ``alive`` is the new node set."""


STRATEGIES = ("oobleck", "varuna", "bamboo")


@functools.lru_cache(maxsize=None)
def _strategy_class(name: str) -> type[Strategy]:
    if name == "oobleck":
        from oobleck.sim.policies import OobleckStrategy

        return OobleckStrategy
    if name == "varuna":
        from baselines.varuna.policy import VarunaStrategy

        return VarunaStrategy
    if name == "bamboo":
        from baselines.bamboo.policy import BambooStrategy

        return BambooStrategy
    raise ConfigError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}; set strategy=<one of them>")


def make_strategy(name: str, context: StrategyContext) -> Strategy:
    """Build a strategy by name (oobleck | varuna | bamboo) on ``context``."""
    return _strategy_class(name)(context)
