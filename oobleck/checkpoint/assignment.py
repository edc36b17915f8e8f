"""Which holder of each layer writes it to a checkpoint: each layer once, writers spread over nodes.

Every layer has several holders (its replicas in f+1 or more pipelines, and the shards of a
multi-GPU stage). Exactly one of them writes the layer, and the bytes written are spread so that
no node writes everything: layers are taken largest first and each goes to the holder whose node
has written the fewest bytes so far (then the holder that has, then the lowest node id and local
rank). This is the LPT rule for balancing loads (Graham 1969; its 4/3 bound is for machines that may
all take every job, which holds here only when every node holds every layer). Ties are broken by
ids, so every process that runs this on the same input gets the same assignment. Pure Python.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from oobleck.errors import PlanningError
from oobleck.planning.outputs import Worker


def assign_checkpoint_writers(
    holders: Mapping[int, Iterable[Worker]], layer_bytes: Mapping[int, float]
) -> dict[int, Worker]:
    """``{layer: the (node, local rank) that writes it}`` for every layer of ``holders``.

    ``holders`` is e.g. ``ExecutionPlan.layer_holders()``; ``layer_bytes`` the size of each
    layer's shard (any unit proportional to it, such as parameter bytes).
    """
    missing = sorted(set(holders) - set(layer_bytes))
    if missing:
        raise ValueError(f"layer_bytes lacks layers {missing}")
    candidates = {layer: sorted(set(workers)) for layer, workers in holders.items()}
    orphans = sorted(layer for layer, workers in candidates.items() if not workers)
    if orphans:
        raise PlanningError(
            f"layers {orphans} have no live holder, so no one can checkpoint them; resume from an earlier checkpoint"
        )
    node_bytes: dict[int, float] = defaultdict(float)
    worker_bytes: dict[Worker, float] = defaultdict(float)
    writers: dict[int, Worker] = {}
    for layer in sorted(candidates, key=lambda layer: (-layer_bytes[layer], layer)):
        writer = min(candidates[layer], key=lambda w: (node_bytes[w[0]], worker_bytes[w], w))
        writers[layer] = writer
        node_bytes[writer[0]] += layer_bytes[layer]
        worker_bytes[writer] += layer_bytes[layer]
    return dict(sorted(writers.items()))
