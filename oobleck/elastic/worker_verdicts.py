"""The controller's answer to what the workers' heartbeats say (``oobleck.elastic.watchdog`` holds
the rules, ``Membership.check_workers`` reads the beats): the ranks a timed-out collective waited
on fail their nodes; when those waits blame nobody, the nodes whose data plane does not answer
fail, and when that blames nobody either the run stops, naming the wait that timed out; ranks
stranded out of a generation the controller never ended get the next one on the same plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oobleck.errors import RunError

if TYPE_CHECKING:
    from oobleck.elastic.membership import Membership, WorkerFindings
    from oobleck.planning.outputs import ExecutionPlan


def act_on_findings(
    findings: WorkerFindings,
    generation: int,
    plan: ExecutionPlan,
    membership: Membership,
    redo: Callable[[str], None],
    cluster: Any,
) -> None:
    """Carry out what ``findings`` (of ``generation``, run on ``plan``) call for; ``redo`` ends the
    generation and publishes the next one on the same plan, for the reason it is given."""
    if membership.lost_pending():
        return  # a failure already waits: its decision comes first
    timeout = cluster.collective_timeout_s
    if findings.stranded and not membership.pending():
        redo(
            f"ranks {list(findings.stranded)} left generation {generation}, which the controller never "
            f"ended, and waited past cluster.collective_timeout_s={timeout} for the next one"
        )
        return
    verdict = findings.verdict
    if verdict is None:
        return
    workers = {a.rank: a.worker for a in plan.assignments()}
    now = time.time()
    if not verdict.culprits:
        cut_off = membership.unreachable(sorted(set(workers.values())))
        if not cut_off or len(cut_off) == len({node for node, _ in workers.values()}):
            raise RunError(
                f"generation {generation}: rank {verdict.waiter} waited {verdict.waited_s:.1f} s for "
                f"{verdict.what}, past cluster.collective_timeout_s={timeout}, every rank it waits on waits on "
                "another, and every node's data plane answers: no rank to blame"
            )
        for node in cut_off:
            membership.node_failed(
                node,
                f"its data-plane address did not answer within cluster.data_plane_probe_timeout_s="
                f"{cluster.data_plane_probe_timeout_s} after rank {verdict.waiter} waited "
                f"{verdict.waited_s:.1f} s for {verdict.what} (cut off from the other nodes)",
                now,
                cause=now - verdict.waited_s,
            )
        return
    for rank in verdict.culprits:
        node, local_rank = workers[rank]
        membership.node_failed(
            node,
            f"worker {local_rank} (rank {rank}) did not answer: rank {verdict.waiter} waited {verdict.waited_s:.1f} s "
            f"for {verdict.what} (cluster.collective_timeout_s={timeout})",
            now,
            cause=now - verdict.waited_s,
        )
