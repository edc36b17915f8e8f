"""A run's start, between hosting its store and its loop: every node up, the first plan written
and, for a resumed run, its continuation from the checkpoint.

The controller (``oobleck.elastic.controller``) calls these in order: ``wait_for_nodes``, then
``first_decision`` (the strategy's start on the nodes that came up, where they differ from the
initial plan's), ``write_plan_file`` (plan.json: the templates, the plan and the layout) and, when
it resumes, ``resume_from`` before publishing generation 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.events import EventKind
from oobleck.elastic.firing import FaultFiring
from oobleck.elastic.ledger import StepLedger
from oobleck.elastic.membership import Membership
from oobleck.errors import RunError
from oobleck.strategy import Decision, Kind, Layout, Strategy


def wait_for_nodes(membership: Membership, nodes: Iterable[int], timeout_s: float, tick_s: float) -> None:
    """Until every node in ``nodes`` is up (raises if one fails first or ``timeout_s`` passes);
    nodes that come up before the first plan are not joins."""
    wanted = set(nodes)
    deadline = time.monotonic() + timeout_s
    while not all(membership.nodes[n].up for n in wanted):
        if time.monotonic() > deadline:
            missing = sorted(n for n in wanted if not membership.nodes[n].up)
            raise RunError(
                f"nodes {missing} did not start within cluster.startup_timeout_s={timeout_s}; "
                "check that agents can reach the controller"
            )
        membership.drain(tick_s)
        for n in wanted:
            if membership.nodes[n].failed:
                raise RunError(f"node {n} failed while starting (its agent or a worker exited)")
    membership.take_changes()
    membership.accepting_joins = True


def first_decision(strategy: Strategy, initial: Decision, alive: list[int]) -> Layout:
    """The layout of generation 0: ``initial``'s, or the strategy's start on the nodes that came
    up where they differ from the plan's."""
    decision = initial
    if decision.layout is None or not set(decision.layout.nodes) <= set(alive):
        decision = strategy.start(alive)
    if decision.kind is Kind.STOP:
        raise RunError(f"strategy {strategy.name} cannot start on nodes {alive}: {decision.reason}")
    assert decision.layout is not None
    return decision.layout


def write_plan_file(recorder: Any, strategy: Strategy, layout: Layout) -> None:
    """plan.json in the run directory: the templates generated, the first plan and its layout."""
    templates = strategy.context.generated_templates()
    recorder.write_plan(
        {
            "templates": templates.to_dict() if templates is not None else None,
            "plan": layout.plan.to_dict(),
            "layout": layout.description,
            "strategy": strategy.name,
        }
    )


def resume_from(
    resume: Any,
    checkpoints: CheckpointCoordinator,
    ledger: StepLedger,
    firing: FaultFiring,
    train_time_offset: float,
    event: Callable[..., None],
) -> tuple[int, str]:
    """Continue the run from checkpoint ``resume`` (``oobleck.checkpoint.Checkpoint``): its step
    is the next to train, and the fault schedule's events before it (in steps, or in training
    time before ``train_time_offset``) happened in the run already. Returns (step, its directory)."""
    step, directory = resume.step, str(resume.step_dir)
    checkpoints.adopt(step, resume.step_dir)
    ledger.next_step = ledger.outcome.resume_step = step
    passed = firing.injector.skip_before(step, train_time_offset)
    skipped = [entry.describe() for entry in resume.skipped]
    event(
        EventKind.RESUME,
        checkpoint=directory,
        resume_step=step,
        train_time_s=round(train_time_offset, 4),
        events_before=passed,
        skipped="; ".join(skipped),
    )
    for line in skipped:
        print(f"oobleck: warning: {line}", flush=True)
    return step, directory
