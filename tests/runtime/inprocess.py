"""Several ranks of one plan in threads of the test process, on real gloo groups.

Each rank gets its topology and a built ``Communicator`` over a real TCPStore (the groups a worker
of that generation would create, including a reconfiguration's copy channels), runs ``body`` and
returns its result; the generation's watcher threads are ended afterwards. What a worker does
between building its groups and training, without the process around it.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from oobleck.planning.outputs import ExecutionPlan, ReconfigurationPlan
from oobleck.runtime import keys
from oobleck.runtime.backend import GlooBackend
from oobleck.runtime.comm import Communicator
from oobleck.runtime.sealed_store import SealedStore
from oobleck.runtime.topology import Topology, build_topology, group_specs
from oobleck.runtime.waits import AbortWatch, Waiter

TIMEOUT_S = 20.0  # bound on every collective here (seconds; loopback ops take milliseconds)
SPACE = keys.KeySpace("in-process ranks")  # their run's key space (the controller's abort is set in it)


def run_ranks(
    plan: ExecutionPlan,
    body: Callable[[Topology, Communicator], Any],
    *,
    store: dist.TCPStore,
    generation: int,
    tied_layers: tuple[int, ...] = (),
    reconfiguration: ReconfigurationPlan | None = None,
) -> list[Any]:
    backend = GlooBackend(dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"))
    workers = [a.worker for a in plan.assignments()]
    results: list[Any] = [None] * len(workers)
    errors: list[str] = []

    def rank_main(index: int) -> None:
        try:
            topology = build_topology(plan, workers[index], tied_layers)
            assert topology is not None
            watch = AbortWatch("127.0.0.1", store.port, TIMEOUT_S, SPACE)
            watch.watch(generation)
            comm = Communicator(
                generation,
                topology.rank,
                group_specs(topology, reconfiguration),
                host="127.0.0.1",
                port=store.port,
                timeout_s=TIMEOUT_S,
                waiter=Waiter(watch, TIMEOUT_S, 5.0, backend),
                space=SPACE,
            )
            comm.build()
            results[index] = body(topology, comm)
            comm.release()
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=rank_main, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * TIMEOUT_S)
    SealedStore(store, SPACE).set(keys.abort(generation), "1")  # ends the watcher threads
    assert not errors, "\n".join(errors)
    return results
