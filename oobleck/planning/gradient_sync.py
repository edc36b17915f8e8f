"""Gradient synchronisation figures of a template set, and the bound on the memo the planner keeps on it.

``_Sync`` holds, per template size, the slowest in-node all-reduce among its stages (``intra_p``
of ``instantiate``'s module docstring) and the most parameter bytes one node holds (what the
cross-pipeline ring moves), and prices that ring. ``sync_of`` builds it once per template set and
bandwidths; ``_remember`` stores it, and the results of ``instantiate``'s searches, in the set's
memo, which it bounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from oobleck.planning.outputs import PipelineTemplate
from oobleck.planning.pipeline_cost import ring_allreduce_seconds
from oobleck.planning.templates import TemplateSet

# Memoised results kept on one template set before they are all dropped (see ``_remember``).
MEMO_ENTRIES = 4096


def _node_param_bytes(template: PipelineTemplate, layer_param_bytes: Sequence[int]) -> list[int]:
    per_node = [0] * template.num_nodes
    for stage in template.stages:
        per_node[stage.node] += sum(layer_param_bytes[stage.start : stage.end])
    return per_node


def _intra_sync(template: PipelineTemplate, layer_param_bytes: Sequence[int], intra_bandwidth: float) -> float:
    return max(
        ring_allreduce_seconds(sum(layer_param_bytes[s.start : s.end]), s.gpus, intra_bandwidth)
        for s in template.stages
    )


class _Sync:
    """Gradient synchronisation figures of a template set for one cluster's bandwidths
    (``sync_of`` builds each once per template set and bandwidths)."""

    def __init__(self, templates: TemplateSet, intra_bandwidth: float, inter_bandwidth: float):
        bytes_ = templates.layer_param_bytes or (0,) * templates.num_layers
        self.intra = intra_bandwidth
        self.inter = inter_bandwidth
        # ``_intra_sync`` and ``_node_param_bytes`` of every template, each stage's bytes taken
        # from integer prefix sums (the same ints as summing its layers; a cold reconfiguration
        # builds this for every template size).
        prefix = list(itertools.accumulate(bytes_, initial=0))
        self.intra_of: dict[int, float] = {}
        self.node_bytes_of: dict[int, int] = {}
        for n, template in templates.templates.items():
            per_node = [0] * template.num_nodes
            reduce_s = []
            for stage in template.stages:
                held = prefix[stage.end] - prefix[stage.start]
                per_node[stage.node] += held
                reduce_s.append(ring_allreduce_seconds(held, stage.gpus, intra_bandwidth))
            self.intra_of[n] = max(reduce_s)
            self.node_bytes_of[n] = max(per_node)

    def cross(self, pipelines: int, node_bytes: float) -> float:
        return ring_allreduce_seconds(node_bytes, pipelines, self.inter)


def sync_of(
    templates: TemplateSet, intra_bandwidth: float | None = None, inter_bandwidth: float | None = None
) -> _Sync:
    """The template set's ``_Sync`` for these bandwidths (default: the set's own), built once."""
    intra, inter = _resolve_bandwidths(templates, intra_bandwidth, inter_bandwidth)
    key = ("sync", intra, inter)
    if key not in templates.memo:
        _remember(templates, key, _Sync(templates, intra, inter))
    return templates.memo[key]


def _remember(templates: TemplateSet, key: tuple, value) -> None:
    """Store a memoised result on the template set, dropping all of them past ``MEMO_ENTRIES``
    (a long simulation asks a few hundred distinct questions; this only bounds pathological use)."""
    if len(templates.memo) >= MEMO_ENTRIES:
        templates.memo.clear()
    templates.memo[key] = value


def _resolve_bandwidths(templates: TemplateSet, intra: float | None, inter: float | None) -> tuple[float, float]:
    return (
        intra if intra is not None else templates.intra_node_bandwidth,
        inter if inter is not None else templates.inter_node_bandwidth,
    )
