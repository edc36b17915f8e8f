"""Placement: a candidate's pipelines on the alive nodes with the fewest parameter bytes to copy.

Step 4 of ``reconfigure``'s module docstring. ``_place`` solves a min-cost assignment of alive
nodes to pipeline positions (``scipy.optimize.linear_sum_assignment``, imported on first use:
``preload_solver``): a node at a position costs the parameter bytes that position needs and the
node does not hold (the same local rank keeps its device); among equal costs, a node keeps its
position in an intact pipeline matched to the new one (``_home_slots``), then nodes that hold
something come first. The placed plan, its copies (``layer_copies``) and what they cost make a
``_Candidate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from oobleck.planning.gradient_sync import _Sync
from oobleck.planning.instantiate import build_plan
from oobleck.planning.layer_copies import _copies
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer, Worker, tolerated_failures
from oobleck.planning.pipeline_cost import chain_copy_seconds
from oobleck.planning.templates import TemplateSet

# Assignment costs are float64: the tie-break below is only exact while costs stay below 2**52.
_EXACT_FLOAT = 2.0**52


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """One way to reconfigure: a placed plan, its copies and what they cost."""

    name: str  # regroup | fresh
    plan: ExecutionPlan
    copies: list  # the LayerTransfer fields of every copy (``_copies``): built only for the winner
    min_bytes: int
    standby: tuple[int, ...]
    copy_s: float

    def cost(self, horizon: int) -> float:
        return horizon * self.plan.predicted_iteration_s + self.copy_s

    @property
    def transfers(self) -> tuple[LayerTransfer, ...]:
        return LayerTransfer.of_rows(self.copies)


def _home_slots(
    intact: Sequence[tuple[int, ...]], multiset: Sequence[int], slots: Sequence[tuple[int, int]]
) -> dict[int, int]:
    """Node -> the slot it keeps if the new pipeline matched to its old one (same size, in order)."""
    unmatched = list(intact)
    index = {slot: c for c, slot in enumerate(slots)}
    home = {}
    for p, size in enumerate(multiset):
        match = next((nodes for nodes in unmatched if len(nodes) == size), None)
        if match is not None:
            unmatched.remove(match)
            home.update({node: index[(p, q)] for q, node in enumerate(match)})
    return home


def _place(
    name: str,
    multiset: Sequence[int],
    old: ExecutionPlan,
    intact: Sequence[tuple[int, ...]],
    templates: TemplateSet,
    alive: Sequence[int],
    held: dict[Worker, tuple[int, int]],
    live: dict[int, tuple[Worker, ...]],
    layer_bytes: Sequence[int],
    max_sources: int,
    piece_bytes: int,
    f: int,
    sync: _Sync,
) -> _Candidate:
    """Step 4: put ``multiset``'s pipelines on alive nodes with the fewest bytes to copy."""
    G = templates.gpus_per_node
    prefix = np.concatenate(([0], np.cumsum(np.asarray(layer_bytes, dtype=np.int64))))
    slots = [(p, q) for p, n in enumerate(multiset) for q in range(n)]
    # need[c, g] / have[r, g]: the layer range local rank g needs at slot c / holds on node r.
    need = np.zeros((len(slots), G, 2), dtype=np.int64)
    for c, (p, q) in enumerate(slots):
        for stage in templates[multiset[p]].stages:
            if stage.node == q:
                need[c, stage.gpu_offset : stage.gpu_offset + stage.gpus] = (stage.start, stage.end)
    have = np.zeros((len(alive), G, 2), dtype=np.int64)
    for r, node in enumerate(alive):
        for g in range(G):
            have[r, g] = held.get((node, g), (0, 0))
    needed = (prefix[need[:, :, 1]] - prefix[need[:, :, 0]]).sum(axis=1)
    lo = np.maximum(have[:, None, :, 0], need[None, :, :, 0])
    hi = np.minimum(have[:, None, :, 1], need[None, :, :, 1])
    kept = np.where(hi > lo, prefix[hi] - prefix[lo], 0).sum(axis=2)
    missing = needed[None, :] - kept  # [node, slot]: bytes the node would receive there
    # Among placements that copy equally little, keep nodes where they were: each new pipeline is
    # matched to an old intact pipeline of its size (in order) and a node at its own position there
    # costs 0, another node that holds something 1, a node that holds nothing 2.
    preference = np.where((have[:, :, 1] == have[:, :, 0]).all(axis=1), 2, 1)[:, None].repeat(len(slots), axis=1)
    home = _home_slots(intact, multiset, slots)
    row_of = {node: r for r, node in enumerate(alive)}
    for node, c in home.items():
        if node in row_of:
            preference[row_of[node], c] = 0
    weight = 2 * len(alive) + 1  # the preference sum of any assignment is below it
    if missing.size and missing.max() * weight >= _EXACT_FLOAT:
        weight, preference = 1, np.zeros_like(preference)  # bytes alone (over 2**52 / weight bytes)
    cost = missing.astype(np.float64) * weight + preference
    from scipy.optimize import linear_sum_assignment  # here, not at import: see ``preload_solver``

    rows, cols = linear_sum_assignment(cost)
    groups: list[list[int]] = [[0] * n for n in multiset]
    for r, c in zip(rows, cols):
        p, q = slots[c]
        groups[p][q] = alive[r]
    groups.sort(key=min)  # deterministic pipeline order: by the smallest node id
    placed = set(int(alive[r]) for r in rows)
    new = build_plan(templates, [len(g) for g in groups], groups, old.global_batch_size, old.microbatch_size, f, sync)
    new = dataclasses.replace(new, fault_tolerance=min(f, tolerated_failures(new)))
    copies = _copies(new, {w: range(a, b) for w, (a, b) in held.items()}, live, layer_bytes, max_sources, piece_bytes)
    seconds = chain_copy_seconds(
        (
            (layer, source[0], target[0], chunk, nbytes, hop, pieces)
            for layer, source, target, chunk, _, nbytes, hop, pieces in copies
        ),
        sync.inter,
    )
    return _Candidate(
        name=name,
        plan=new,
        copies=copies,
        min_bytes=int(missing[rows, cols].sum()),
        standby=tuple(n for n in alive if n not in placed),
        copy_s=seconds,
    )


def preload_solver() -> None:
    """Import the placement's assignment solver now (``scipy.optimize``, 0.3-0.5 s of CPU here).

    ``reconfigure`` imports it on first use, so that importing the planner stays cheap for every
    process that never reconfigures (workers, agents, the CLI); but a process that will
    reconfigure otherwise pays the import inside its first recovery: measured here, the
    controller's first ``plan_s`` was 0.70 s and its second 0.004 s in one run (analysis/README.md).
    Call this once when such a process starts (the controller).
    """
    import scipy.optimize  # noqa: F401
