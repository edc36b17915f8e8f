"""Varuna- and Bamboo-style training for real, and Oobleck's checkpoint fall-back (issues 10, 11).

Every strategy runs on the same controller, agents and workers, trains the same model on the same
step-indexed batches and takes real SIGKILLs; so each run must equal single-process training on
the same batches, whatever the strategy did about its failures (restarts redo the steps after the
checkpoint they roll back to; failovers and reconfigurations redo only the interrupted step).
"""

from __future__ import annotations

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from oobleck.errors import ConfigError, RunError
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes


def _pids(outcome) -> dict[tuple[int, int], set[int]]:
    pids: dict[tuple[int, int], set[int]] = {}
    for ranks in outcome.probes.values():
        for probe in ranks.values():
            pids.setdefault(tuple(probe["worker"]), set()).add(probe["pid"])
    return pids


@pytest.fixture(scope="module")
def varuna_run(tmp_path_factory):
    """2 nodes (D=2 x P=1 for this small model), two nodes join at step 1: the cost model finds
    D=4 faster, so Varuna checkpoints the next step boundary and restarts onto 4 nodes (a planned
    restart: nothing lost). Then a working node is lost in the backward pass of step 30 or later:
    every worker stops and fresh ones resume from the latest checkpoint (every 5 steps); another
    node dies while that restart is under way (a second restart supersedes it); and a third in the
    optimizer step of step 45. The joiners boot while the 2 nodes train: forked from a fork server
    that has imported torch (tests/conftest.py shares one), they were up and the morph done by
    step 8 under a load average of 11 on 2 cores, so step 30 leaves them over three times that."""
    cfg = tiny_config(
        "strategy=varuna",
        **{
            "cluster.nodes": 2,
            "job.steps": 60,
            "checkpoint.every_steps": 5,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "join", "step": 1, "count": 2},
                {"action": "remove", "step": 30, "nodes": [1], "phase": "backward"},
                {"action": "remove", "step": 30, "nodes": [2], "phase": "reconfigure"},
                {"action": "remove", "step": 45, "nodes": [3], "phase": "optimizer"},
            ],
        },
    )
    run_dir = tmp_path_factory.mktemp("varuna")
    outcome, summary = launch(cfg, run_dir)
    return cfg, outcome, summary, run_dir


def outcome_events(run_dir):
    return pd.read_csv(run_dir / "events.csv").to_dict("records")


def test_varuna_morphs_onto_joined_nodes_then_restarts_from_its_checkpoint(varuna_run):
    cfg, outcome, summary, run_dir = varuna_run
    assert_matches_reference(cfg, outcome, run_dir)
    morph, restart, last = [r for r in outcome.recoveries if r["kind"] == "restart"]
    assert morph["joined"] == [2, 3] and morph["rolled_back_steps"] == 0 and "morph" in morph["decision"]
    # The first failure's restart was superseded by the failure during it: one restart absorbed both.
    assert restart["removed"] == [1, 2] and restart["resume_step"] % 5 == 0
    killed_at = next(e["step"] for e in outcome_events(run_dir) if e["kind"] == "failure" and e["node"] == 1)
    assert restart["rolled_back_steps"] == killed_at - restart["resume_step"] >= 0
    for key in ("stop_s", "spawn_s", "groups_s", "load_s", "first_step_s", "total_s"):
        assert restart[key] >= 0, key
    assert last["removed"] == [3] and summary["restarts"] == 3
    assert outcome.steps[-1]["nodes"] == 1
    events = pd.read_csv(run_dir / "events.csv")
    assert {"restart_planned", "restart_superseded"} <= set(events["kind"])
    checkpoints = events[events["kind"] == "checkpoint"]
    assert not checkpoints.empty and (checkpoints["bytes"] > 0).all()
    assert set(checkpoints["checkpoint_step"]) >= {5, 10, restart["resume_step"]}


def test_varuna_restart_replaces_every_worker_process(varuna_run):
    _, outcome, _, _ = varuna_run
    pids = _pids(outcome)
    # Node 0 ran through every restart: a new process each time; node 3 through the second.
    assert len(pids[(0, 0)]) == 4 and len(pids[(3, 0)]) == 2, pids


@pytest.fixture(scope="module")
def bamboo_run(tmp_path_factory):
    """Two pipelines of depth 2 on 4 nodes: stage 1 of pipeline 0 lost during the all-reduce of
    step 3 (failover), a node joins at step 5 (once it is up it replaces the failed-over stage),
    then both nodes of pipeline 1 are lost at step 30 or later (a stage and its only copy: global
    restart from the latest checkpoint; one every 4 steps), then one of the two survivors in the
    forward pass of step 45 (a failover onto the last node). The joiner boots while the others
    train: forked from a fork server that has imported torch, it replaced the stage at step 9
    under a load average of 11 on 2 cores, so step 30 leaves it over three times that. Inline redundancy (the redundant
    forward on the critical path; the other modes: tests/elastic/test_bamboo_modes.py)."""
    cfg = tiny_config(
        "strategy=bamboo",
        **{
            "cluster.nodes": 4,
            "job.steps": 60,
            "strategy.pipeline_depth": 2,
            "strategy.redundancy": "inline",
            "checkpoint.every_steps": 4,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 3, "nodes": [1], "phase": "allreduce"},
                {"action": "join", "step": 5, "count": 1},
                {"action": "remove", "step": 30, "nodes": [2, 3]},
                {"action": "remove", "step": 45, "nodes": [4], "phase": "forward"},
            ],
        },
    )
    run_dir = tmp_path_factory.mktemp("bamboo")
    outcome, summary = launch(cfg, run_dir)
    return cfg, outcome, summary, run_dir


def test_bamboo_fails_over_repairs_and_restarts_exactly(bamboo_run):
    cfg, outcome, summary, run_dir = bamboo_run
    assert_matches_reference(cfg, outcome, run_dir)
    kinds = [r["kind"] for r in outcome.recoveries]
    assert kinds == ["failover", "reconfiguration", "restart", "failover"], kinds
    failover, repair, restart, last = outcome.recoveries
    assert failover["removed"] == [1] and failover["resume_step"] == 3
    assert repair["joined"] == [4] and repair["bytes_moved"] > 0
    assert restart["removed"] == [2, 3] and restart["resume_step"] % 4 == 0
    killed_at = next(e for e in outcome_events(run_dir) if e["kind"] == "fault_injected" and e["nodes"] == "[2, 3]")[
        "step"
    ]
    assert restart["rolled_back_steps"] == killed_at - restart["resume_step"] >= 0
    assert restart["joined"] == [] and outcome.steps[restart["resume_step"] - outcome.steps[0]["step"]]["nodes"] == 2
    assert last["removed"] == [4] and outcome.steps[-1]["nodes"] == 1  # node 0 runs both stages


def test_bamboo_shadow_copies_stay_bit_identical(bamboo_run):
    _, outcome, _, run_dir = bamboo_run
    # Every established generation compared the checksums of every holder of every layer,
    # shadow copies included (an empty dict would mean a mismatch).
    assert outcome.checksums and all(outcome.checksums.values())
    assert all(r["replicas_identical"] for r in outcome.recoveries)


def test_bamboo_runs_the_redundant_forward_for_real(bamboo_run):
    _, outcome, _, _ = bamboo_run
    redundant = [p.get("redundant_forward", 0.0) for p in outcome.phase_seconds.values()]
    assert redundant and all(seconds > 0 for seconds in redundant)


def test_oobleck_beyond_f_restarts_from_its_checkpoint(tmp_path):
    """Two 2-node pipelines; both first stages die after step 4 commits: no live replica of their
    layers, so the run restarts from step 4's checkpoint on the two survivors."""
    from testing import two_pipelines_of_two_nodes

    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 8,
            "checkpoint.every_steps": 2,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 5, "nodes": [0, 2]}],
        }
    )
    plan = two_pipelines_of_two_nodes()
    outcome, summary = launch(cfg, tmp_path / "run", initial_plan=plan)
    (restart,) = outcome.recoveries
    assert restart["kind"] == "restart" and restart["resume_step"] == 4 and "no live replica" in restart["decision"]
    assert outcome.steps[-1]["nodes"] == 2
    assert_matches_reference(cfg, outcome, tmp_path / "run")


def test_bad_strategy_settings_fail_before_any_process_starts(tmp_path):
    with pytest.raises(ConfigError, match="checkpoints are disabled"):
        launch(tiny_config("strategy=varuna", "checkpoint=none"), tmp_path / "a")
    with pytest.raises(RunError, match="pipeline_depth=1"):
        launch(tiny_config("strategy=bamboo", **{"strategy.pipeline_depth": 1}), tmp_path / "b")
    with pytest.raises(
        ConfigError,
        match=r"strategy.pipline_depth is not a config key; did you mean strategy.pipeline_depth\? \(settings of strategy=bamboo",
    ):
        launch(tiny_config("strategy=bamboo", "+strategy.pipline_depth=2"), tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bamboo_failover_in_the_optimizer_and_during_the_failover(tmp_path):
    """Stage 1 of pipeline 0 dies in the optimizer step of step 3 (the step committed: its
    predecessor and shadow holder applied it too), and stage 1 of pipeline 1 dies while that
    failover is being established: the second failover supersedes the first; both pipelines end
    on one node each, exactly."""
    cfg = tiny_config(
        "strategy=bamboo",
        **{
            "cluster.nodes": 4,
            "job.steps": 10,
            "strategy.pipeline_depth": 2,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 3, "nodes": [1], "phase": "optimizer"},
                {"action": "remove", "step": 3, "nodes": [3], "phase": "reconfigure"},
            ],
        },
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    (failover,) = outcome.recoveries
    assert failover["kind"] == "failover" and failover["removed"] == [1, 3]
    assert outcome.steps[-1]["nodes"] == 2 and outcome.steps[-1]["pipelines"] == 2
    assert "failover_superseded" in set(pd.read_csv(tmp_path / "run" / "events.csv")["kind"])


def test_varuna_failures_in_the_forward_pass_and_the_all_reduce(tmp_path):
    cfg = tiny_config(
        "strategy=varuna",
        **{
            "cluster.nodes": 3,
            "job.steps": 12,
            "checkpoint.every_steps": 2,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 3, "nodes": [1], "phase": "forward"},
                {"action": "remove", "step": 8, "nodes": [2], "phase": "allreduce"},
            ],
        },
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    # Steps 1 and 7 commit with the checkpoints of steps 2 and 8 after them, written in the
    # background; nodes 1 and 2 die in the next step, before or after writing their shards of it
    # (a loaded machine writes slower than it trains). Each restart resumes at the newest
    # checkpoint that completed: 2 (or 0 when 2 was abandoned), then 8 (or 6).
    abandoned = {
        int(e["checkpoint_step"]) for e in outcome_events(tmp_path / "run") if e["kind"] == "checkpoint_abandoned"
    }
    first = 0 if 2 in abandoned else 2
    second = 6 if 8 in abandoned else 8
    assert [(r["kind"], r["removed"], r["resume_step"]) for r in outcome.recoveries] == [
        ("restart", [1], first),
        ("restart", [2], second),
    ]
