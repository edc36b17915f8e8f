"""What a torchft step tells the harness: every participant's row, summed over the quorum, and the
step report the first replica to commit writes (``keys.step_report``: it becomes a row of
metrics.csv). Pure functions, so the accounting is tested without processes.

Each participant fills its own ``SLOT`` values of a tensor the quorum all-reduces (sum); a
non-participant's (a replica healing under the asynchronous quorum) are zeroed by torchft, so a row
of zeros is nobody. A row: the replica's name + 1 (its first node), its shard + 1, whether it healed
since it last trained (0/1), the seconds that heal took (attempt start to state applied) and, for a
fresh joiner, the seconds from registering to that heal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLOT = 5


@dataclass(frozen=True)
class Row:
    """One participant of a committed step."""

    name: int
    shard: int
    heal_s: float | None = None  # None: it did not heal since it last trained
    join_to_heal_s: float = 0.0

    def values(self) -> list[float]:
        healed = self.heal_s is not None
        return [self.name + 1.0, self.shard + 1.0, 1.0 if healed else 0.0, self.heal_s or 0.0, self.join_to_heal_s]


def rows_of(values: Sequence[float]) -> list[Row]:
    """The participants' rows of a summed tensor (``SLOT`` values each), nobody's left out."""
    rows = []
    for offset in range(0, len(values), SLOT):
        name, shard, healed, heal_s, join_s = values[offset : offset + SLOT]
        if name > 0:
            rows.append(Row(int(name) - 1, int(shard) - 1, heal_s if healed > 0 else None, join_s))
    return rows


def step_report(
    rows: Sequence[Row],
    *,
    loss_sum: float,
    batch: int,
    batch_size: int,
    shards: int | None,
    skipped_batches: int,
    attempts: int,
    nodes_per_replica: int,
    quorum_s: float,
) -> dict[str, Any]:
    """The step's account (``keys.step_report``). ``shards``: how many fixed shards the batch is cut
    into (the asynchronous quorum: only the participants' shards are trained), None for the
    synchronous quorum (the batch is split over the participants, so all of it is trained)."""
    trained = sorted(r.shard for r in rows) if shards is not None else None
    samples = len(rows) * (batch_size // shards) if shards is not None else batch_size
    healed = [r for r in rows if r.heal_s is not None]
    return {
        "loss_sum": loss_sum,
        "samples": samples,
        "nodes": len(rows) * nodes_per_replica,
        "pipelines": len(rows),
        "attempts": attempts,
        "batch": batch,
        "shards": trained,
        "skipped_batches": skipped_batches,
        "skipped_samples": skipped_batches * batch_size + batch_size - samples,
        "replicas": sorted(r.name for r in rows),
        "healed": sorted(r.name for r in healed),
        "heal_s": round(max((r.heal_s or 0.0 for r in healed), default=0.0), 4),
        "join_to_heal_s": round(max((r.join_to_heal_s for r in healed), default=0.0), 4),
        "quorum_s": round(quorum_s, 4),
    }
