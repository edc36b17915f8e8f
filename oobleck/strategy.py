"""Resilience strategies: one interface that the real runtime executes and the simulator costs.

A strategy *decides*; it never acts. It answers two questions:

- ``start(nodes)``: the layout to start on (``START``), or why it cannot run (``STOP``);
- ``on_change(state)``: what to do about a membership change (nodes lost or joined).

Each answer is one frozen ``Decision`` whose ``kind`` says how to carry it out:

- ``START``: run ``layout`` from the current step (a first start, or a resume);
- ``RECONFIGURE``: in place: the survivors switch to ``layout``, copying ``transfers`` (layer
  state between live workers) and redo the interrupted step; nothing is lost;
- ``FAILOVER``: in place too, but survivors take over lost stages from shadow copies they already
  hold (Bamboo); ``transfers`` only re-establish redundancy;
- ``REROUTE``: in place, no state copy: the survivors switch to ``layout``, whose re-routes
  (``ExecutionPlan.reroutes``) send a lost stage's microbatches through the same stage of peer
  pipelines, which already hold its layers (ReCycle), and redo the interrupted step;
- ``RESTART``: every worker process stops and fresh ones start on ``layout``, loading the
  checkpoint of ``rollback_to_step`` (0: the seeded initial state) and redoing every step since;
  with ``checkpoint_first`` a checkpoint of the current step is written first, so nothing is lost
  (a planned restart, e.g. Varuna morphing onto joined nodes);
- ``CONTINUE``: the runtime changes nothing: an idle node came or went (``layout`` says which
  alive nodes stand by), or the strategy's own workers absorb the change themselves (an external
  peer such as torchft, whose replicas heal in place); a lost node that was not standing by is then
  recorded as a ``continue`` recovery, ending at the next committed step;
- ``STOP``: training cannot go on (``reason``; ``out_of_memory`` when nothing fits).

A *preemption notice* (``failures.*.notice_s``: a spot provider's warning that nodes will be
killed in ``notice_s`` seconds) reaches every strategy alike through ``on_notice(state)``, called
when the notice arrives, with the nodes about to go in ``state.leaving`` (still alive; nothing is
lost yet). It is a hook of its own rather than another ``on_change``: a notice changes no
membership, so ``on_change`` keeps meaning "nodes were lost or joined" and a strategy that does
not use notices needs no code (the default continues, and the kill is then recovered like a
crash). Its answer is an ordinary decision, carried out by the same executor: a restart that
checkpoints first (Varuna's reaction), a failover or reconfiguration onto layouts without the
nodes under notice (Bamboo's), or continue. Nodes under notice are never part of a new layout and
never copy state (our runtime copies only between workers of the new plan); once a layout that
does not use them runs, their kill changes nothing. ``state.leaving`` also tells every later
decision which alive nodes are about to go.

The real runtime (``oobleck.elastic``) dispatches on the kind and has no strategy-specific code;
the simulator (``oobleck.sim``) charges each kind by its cost model. A strategy is chosen by
``_target_`` in ``conf/strategy/<name>.yaml``: the target is the strategy's class, whose ``Config``
dataclass types the rest of that file (``strategy_config`` checks it). Oobleck's own policy is
``oobleck.strategies.oobleck.Oobleck``; the baselines live in ``baselines/``. Nothing here imports them.

A strategy whose workers need a server for the whole run (torchft's lighthouse) provides it from
``services(run)``: the controller enters that context before it starts any node, publishes what it
yields to the workers (store key ``services``) and leaves it after the workers are gone.
"""

from __future__ import annotations

import contextlib
import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from oobleck.errors import ConfigError, PlanningError, unknown_key_message
from oobleck.plain import resolved_dict
from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer
from oobleck.recovery_costs import CostConstants


class Kind(str, enum.Enum):
    """How a decision is carried out (see the module docstring)."""

    START = "start"
    RECONFIGURE = "reconfigure"
    FAILOVER = "failover"
    REROUTE = "reroute"
    RESTART = "restart"
    CONTINUE = "continue"
    STOP = "stop"


@dataclass(frozen=True)
class Layout:
    """What runs between two decisions: an execution plan and what the strategy predicts of it."""

    plan: ExecutionPlan
    iteration_s: float  # predicted seconds per iteration by the strategy's cost model
    description: str  # e.g. "3 pipelines of 2+2+2 nodes" or "D=2 x P=3"
    # Share of the busy time spent on work thrown away by design (Bamboo's redundant forward).
    redundant_fraction: float = 0.0
    standby: tuple[int, ...] = ()  # alive nodes the plan leaves idle
    state: Any = None  # strategy-private, immutable (e.g. Bamboo's stage slots)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Nodes doing work."""
        return self.plan.nodes

    @property
    def samples_per_iteration(self) -> int:
        return self.plan.global_batch_size

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_iteration / self.iteration_s


@dataclass(frozen=True)
class Decision:
    """A strategy's answer; ``kind`` says how the runtime executes it and the simulator costs it."""

    kind: Kind
    layout: Layout | None = None
    transfers: tuple[LayerTransfer, ...] = ()
    rollback_to_step: int | None = None  # RESTART: the step to resume at (a checkpoint's, or 0)
    checkpoint_first: bool = False  # RESTART: write a checkpoint of the current step first
    reason: str = ""
    out_of_memory: bool = False  # STOP because no layout fits in device memory

    def __post_init__(self) -> None:
        kind = Kind(self.kind)
        object.__setattr__(self, "kind", kind)
        runs = kind not in (Kind.STOP, Kind.CONTINUE)
        if runs and self.layout is None:
            raise ValueError(f"a {kind.value} decision needs a layout")
        if kind is Kind.STOP and self.layout is not None:
            raise ValueError("a stop decision has no layout")
        if kind is Kind.RESTART and self.rollback_to_step is None and not self.checkpoint_first:
            raise ValueError("a restart decision needs rollback_to_step (or checkpoint_first)")
        if self.transfers and kind not in (Kind.RECONFIGURE, Kind.FAILOVER):
            raise ValueError(f"a {kind.value} decision copies no layer state between live workers")

    @property
    def bytes_moved(self) -> int:
        """Parameter bytes the transfers move (optimizer state moves with them)."""
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True)
class RunState:
    """What a strategy sees when membership changes."""

    layout: Layout  # what runs now (the last layout that was established)
    alive: tuple[int, ...]  # every alive node after the change (working or standing by)
    removed: tuple[int, ...]  # nodes lost since ``layout`` was decided
    joined: tuple[int, ...]  # nodes that arrived since then
    step: int  # the step in flight: the number of steps committed so far
    checkpoint_step: int | None = None  # steps held by the latest complete checkpoint
    leaving: tuple[int, ...] = ()  # alive nodes under a preemption notice (they go within notice_s)
    notice_s: float = 0.0  # the warning the newest notice gave: seconds from the notice to its kill

    @property
    def staying(self) -> tuple[int, ...]:
        """The alive nodes not under notice: what a new layout may use."""
        return tuple(n for n in self.alive if n not in self.leaving)


@dataclass(frozen=True)
class RunInfo:
    """What a strategy's run-long services may need to know about the run they serve."""

    host: str  # the controller's address (cluster.master_addr): bind services there
    store_address: str  # HOST:PORT of the run's TCPStore
    run_id: str
    run_dir: Path
    config: Mapping[str, Any] = field(default_factory=dict)  # the resolved run config (as the workers get it)
    # The run's secret: a service reads the run's store in its key space (``keys.KeySpace``,
    # ``oobleck.runtime.sealed_store``), where the workers write.
    secret: str = ""


@dataclass
class StrategyConfig:
    """Every strategy's settings; a strategy's own ``Config`` subclasses this."""

    _target_: str = MISSING  # the strategy class, e.g. oobleck.strategies.oobleck.Oobleck
    name: str = MISSING
    # Steps between checkpoints when ``checkpoint.every_steps`` is not set (0: none).
    checkpoint_every_steps: int = 0
    # What the simulator charges for each kind of decision (oobleck.recovery_costs).
    costs: CostConstants = field(default_factory=CostConstants)


@dataclass
class StrategyContext:
    """Everything a strategy may consult: the model profile, the cluster and the job.

    Template sets are generated once per fault tolerance and cached here, so a simulation calls
    the planner's template generation once and only instantiation/reconfiguration per change;
    strategies sharing a context share its templates.
    """

    profile: ModelProfile
    cluster: ClusterSpec  # nodes = the most nodes the run can have
    global_batch_size: int
    microbatch_size: int
    fault_tolerance: int
    reference_microbatches_per_stage: int = 4
    max_gpus_per_stage: int | None = None
    transfer_sources: int = 4  # a layer copy is split across up to this many live holders
    copy_piece_bytes: int = 4 * 2**20  # relayed copies stream in pieces of this size (planner.copy_piece_mb)
    # A reconfiguration re-plans from scratch when that saves more over this many steps than the
    # extra state copy costs (planner.replan_horizon_steps, or derived from the failure schedule:
    # planner.replan_horizon; oobleck.planning.horizon, set by oobleck.elastic.job for real runs).
    replan_horizon_steps: int = 100
    _templates: dict[int, Any] = field(default_factory=dict, repr=False)
    # f -> the PlanningError's message where no template fits (the same inputs fail the same way).
    _no_templates: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: Any, profile: ModelProfile, cluster: ClusterSpec | None = None) -> StrategyContext:
        """The context of a run's config (``cluster`` overrides ``ClusterSpec.from_config(cfg.cluster)``)."""
        return cls(
            profile=profile,
            cluster=cluster if cluster is not None else ClusterSpec.from_config(cfg.cluster),
            global_batch_size=int(cfg.job.global_batch_size),
            microbatch_size=int(cfg.job.microbatch_size),
            fault_tolerance=int(cfg.job.fault_tolerance),
            reference_microbatches_per_stage=int(cfg.planner.reference_microbatches_per_stage),
            max_gpus_per_stage=cfg.planner.max_gpus_per_stage,
            transfer_sources=int(cfg.planner.transfer_sources),
            copy_piece_bytes=round(float(cfg.planner.copy_piece_mb) * 2**20),
            replan_horizon_steps=int(cfg.planner.replan_horizon_steps),
        )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    @property
    def layer_param_bytes(self) -> list[int]:
        return [layer.param_bytes for layer in self.profile.layers]

    def generated_templates(self):
        """The TemplateSet generated so far for the job's f (else for any f), or None."""
        if self.fault_tolerance in self._templates:
            return self._templates[self.fault_tolerance]
        return next(iter(self._templates.values()), None)

    def templates(self, fault_tolerance: int | None = None):
        """The planner's TemplateSet for ``fault_tolerance`` (default: the job's f), cached."""
        from oobleck.planning.templates import generate_templates

        f = self.fault_tolerance if fault_tolerance is None else fault_tolerance
        if f in self._no_templates:
            raise PlanningError(self._no_templates[f])
        if f not in self._templates:
            try:
                self._templates[f] = generate_templates(
                    self.profile,
                    self.cluster,
                    f,
                    reference_microbatches_per_stage=self.reference_microbatches_per_stage,
                    max_gpus_per_stage=self.max_gpus_per_stage,
                )
            except PlanningError as error:
                self._no_templates[f] = str(error)
                raise
        return self._templates[f]


class Strategy(ABC):
    """A resilience policy: ``start`` and ``on_change`` return decisions, nothing else.

    Subclasses set ``Config`` (their typed settings) and implement both methods. They must be
    deterministic: the same state gives the same decision.
    """

    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    # Real runs of this strategy need periodic checkpoints (refused before launch without them).
    requires_checkpoints: ClassVar[bool] = False
    # Its plans promise to survive job.fault_tolerance failures in place (the runtime reports
    # when a plan tolerates fewer).
    tolerates_in_place: ClassVar[bool] = False
    # The worker program the node agents start (``python -m <module>``).
    worker_module: ClassVar[str] = "oobleck.runtime.worker"

    def __init__(self, config: StrategyConfig, context: StrategyContext) -> None:
        self.config = config
        self.context = context

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def checkpoint_every_steps(self) -> int:
        """The strategy's default checkpoint interval (``checkpoint.every_steps`` overrides it)."""
        return int(self.config.checkpoint_every_steps)

    @abstractmethod
    def start(self, nodes: Sequence[int]) -> Decision:
        """The layout for a fresh start on ``nodes`` (``START``), or ``STOP`` with the reason."""

    @abstractmethod
    def on_change(self, state: RunState) -> Decision:
        """The decision on ``state.removed`` nodes failing and ``state.joined`` nodes arriving."""

    def on_notice(self, state: RunState) -> Decision:
        """The decision on a preemption notice: ``state.leaving`` nodes (alive now) will be killed in
        ``state.notice_s`` seconds. A layout it returns must not use them. Default: continue, and
        recover once they are gone as from a crash."""
        return Decision(Kind.CONTINUE)

    def services(self, run: RunInfo) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Servers the workers need for the whole run, as a context manager: entered before any node
        starts (so it may still refuse the run's settings), left at shutdown after the workers; the
        JSON-serialisable dict it yields is published to the workers (``keys.SERVICES``). Default: none."""
        return contextlib.nullcontext({})

    def restart(self, state: RunState, reason: str) -> Decision:
        """Stop everything and start afresh on the alive nodes (but those under notice) from the
        latest checkpoint (or from the initial state when there is none): the shared fall-back of
        every strategy."""
        fresh = self.start(state.staying)
        if fresh.kind is Kind.STOP:
            return Decision(
                Kind.STOP, reason=f"{reason}; restarting failed: {fresh.reason}", out_of_memory=fresh.out_of_memory
            )
        rollback = state.checkpoint_step if state.checkpoint_step is not None else 0
        return Decision(Kind.RESTART, fresh.layout, rollback_to_step=rollback, reason=reason)


def _as_dict(section: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    if isinstance(section, DictConfig):
        return resolved_dict(section)
    return dict(section)


def strategy_class(section: Mapping[str, Any] | DictConfig) -> type[Strategy]:
    """The class a strategy section's ``_target_`` names (one clear error if it names none)."""
    import importlib

    name = section.get("name", "?")
    target = section.get("_target_")
    if not target:
        raise ConfigError(
            f"strategy={name} has no _target_; conf/strategy/<name>.yaml must name the strategy class, "
            "e.g. _target_: oobleck.strategies.oobleck.Oobleck"
        )
    module, _, attribute = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"strategy._target_={target} cannot be imported ({error}); check the class path") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"strategy._target_={target} is not an oobleck.strategy.Strategy subclass")
    return cls


def setting_keys(cls: type[Strategy], section: str) -> list[str]:
    """The keys strategy class ``cls``'s typed config has at a dotted ``section`` ("" for the top)."""
    schema = OmegaConf.structured(cls.Config)
    node = OmegaConf.select(schema, section) if section else schema
    return [str(key) for key in node.keys()] if isinstance(node, DictConfig) else []


def strategy_config(
    section: Mapping[str, Any] | DictConfig, overrides: Mapping[str, Any] | None = None, *, where: str = "strategy"
) -> StrategyConfig:
    """The typed settings of a strategy section (``cfg.strategy``), with ``overrides`` merged in.

    Unknown keys and wrong types are ``ConfigError`` naming the strategy, the key (under ``where``:
    ``strategy``, or ``sim.params.<name>`` for a simulation's overrides) and the value.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    data = _as_dict(section)
    cls = strategy_class(data)
    name = data.get("name", "?")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls.Config), data, dict(overrides or {}))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", "") or ""
        parent, _, leaf = key.rpartition(".")
        known = setting_keys(cls, parent)
        if isinstance(error, (ConfigKeyError, ConfigAttributeError)) and leaf and leaf not in known:
            raise ConfigError(
                unknown_key_message(
                    f"{where}.{key}", known, f"(settings of strategy={name}: conf/strategy/{name}.yaml)"
                )
            ) from None
        message = str(error).splitlines()[0]
        raise ConfigError(
            f"strategy={name}: {key + ': ' if key else ''}{message}; see conf/strategy/{name}.yaml for the keys"
        ) from None
    assert isinstance(config, StrategyConfig)
    return config


def build_strategy(
    section: Mapping[str, Any] | DictConfig, context: StrategyContext, overrides: Mapping[str, Any] | None = None
) -> Strategy:
    """The strategy a config section (``cfg.strategy``) names, on ``context``."""
    config = strategy_config(section, overrides)
    return strategy_class(_as_dict(section))(config, context)


def checkpoint_every_steps(cfg: Any, config: StrategyConfig | None = None) -> int:
    """Steps between checkpoints of a run: ``checkpoint.every_steps`` when set, else the strategy's
    default (the one place the interval is decided)."""
    explicit = cfg.checkpoint.every_steps if "checkpoint" in cfg else None
    if explicit is not None:
        return int(explicit)
    config = config if config is not None else strategy_config(cfg.strategy)
    return int(config.checkpoint_every_steps)
