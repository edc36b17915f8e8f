"""Gradient reduction overlapped with the backward pass: the SUM all-reduce of every held layer.

Each gradient group's parameters are cut into buckets in reverse layer order, and a bucket's
all-reduce starts as soon as the step's last gradient op (the schedule's op marked ``final``) has
made the gradient of every parameter in it final, as torch's DDP does: per-parameter
post-accumulate hooks during a full backward, and ``mark_final`` after a weight-gradient pass
(``torch.autograd.grad``, which split backward uses, accumulates without running those hooks).
As DDP's ``gradient_as_bucket_view``, a bucket's parameters' gradients are views of its one flat
tensor, so backward accumulates straight into what is all-reduced, in place: no copy into the
bucket and none back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from oobleck.runtime.executor import StepContext


@dataclass
class _Bucket:
    """Gradients all-reduced together in one flat tensor on one group."""

    group: str
    params: list[torch.nn.Parameter]  # in flattening order
    live: list[torch.nn.Parameter]  # those whose final gradient this rank's backward produces
    tied: bool = False  # the tied weight's bucket: the local copies are summed, not concatenated
    ready: int = 0
    work: Any = None
    flat: torch.Tensor | None = None
    # A concatenated bucket's gradient storage: ``views[k]`` is ``params[k]``'s ``.grad``.
    views: list[torch.Tensor] = field(default_factory=list)

    def attach(self) -> None:
        """Zero the bucket and make it its parameters' gradients again (before a step)."""
        assert self.flat is not None
        self.flat.zero_()
        for p, view in zip(self.params, self.views):
            p.grad = view

    def reclaim(self) -> None:
        """A gradient autograd put elsewhere (not accumulated in place) goes back into its view."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
                p.grad = view


class GradientReducer:
    """SUM all-reduce of every held layer's gradient over its holders, overlapped with backward.

    Buckets: for each of this rank's gradient groups, its layers' parameters in reverse layer
    order (the order backward produces them), cut whenever a bucket reaches ``bucket_bytes``;
    plus one bucket for the tied weight (the sum of the local copies, over the tied group). Every
    rank of a group derives the same buckets from the plan, and launches them in one global
    order (reverse layer order, then the group name; the tied bucket last): a bucket is launched
    only after the ones before it, so all the members of every group issue the same collectives
    in the same order, and no two ranks wait on two groups in opposite orders (which NCCL, whose
    kernels block on their peers, could deadlock on).

    With ``overlap`` each parameter that the backward pass reaches gets a post-accumulate-grad
    hook, armed only from the step's last gradient op on (the one that makes its gradient final;
    ``arm``), and a weight-gradient pass reports its parameters with ``mark_final``; ``flush``
    launches whatever is left once the rank's gradients are all final (the schedule's
    ``REDUCE_GRAD``). Without overlap every bucket is launched by ``finish``. Parameters the
    backward never reaches (shadow copies, a shard with no rows) contribute zeros. ``close``
    removes the hooks and the gradient views.
    """

    def __init__(self, ctx: StepContext, *, bucket_bytes: int, overlap: bool) -> None:
        topo = ctx.topology
        self.comm = ctx.comm
        tied = ctx.spec.tied_names
        live_layers = set(topo.assignment.layers)
        keyed: list[tuple[tuple[int, int, str, int], _Bucket]] = []
        for group in topo.my_grad_groups():
            params: list[tuple[int, torch.nn.Parameter]] = []
            for index in sorted(group.layers, reverse=True):
                named = [p for name, p in ctx.layers[index].module.named_parameters() if tied.get(index) != name]
                params += [(index, p) for p in reversed(named)]
            cuts: list[list[tuple[int, torch.nn.Parameter]]] = [[]]
            size = 0
            for index, p in params:
                if size >= bucket_bytes:
                    cuts.append([])
                    size = 0
                cuts[-1].append((index, p))
                size += p.numel() * p.element_size()
            for position, cut in enumerate(c for c in cuts if c):
                top = max(index for index, _ in cut)
                bucket = _Bucket(group.name, [p for _, p in cut], [p for i, p in cut if i in live_layers])
                first = bucket.params[0]
                bucket.flat = torch.zeros(sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
                offset = 0
                for p in bucket.params:
                    bucket.views.append(bucket.flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                keyed.append(((0, -top, group.name, position), bucket))
        tied_group = topo.tied_group
        if tied_group is not None and tied:
            held = [i for i in tied_group.layers if i in ctx.layers]
            copies = [ctx.layers[i].module.get_parameter(tied[i]) for i in held]
            if copies:
                live = [p for i, p in zip(held, copies) if i in live_layers]
                keyed.append(((1, 0, tied_group.name, 0), _Bucket(tied_group.name, copies, live, tied=True)))
        self.order = [bucket for _, bucket in sorted(keyed, key=lambda kb: kb[0])]
        self.group_sizes = {g.name: len(g.ranks) for g in topo.my_grad_groups()}
        if tied_group is not None:
            self.group_sizes[tied_group.name] = len(tied_group.ranks)
        self.overlap = overlap
        self.armed = False
        self.launched = 0
        self.handles: list[Any] = []
        self.bucket_of: dict[int, _Bucket] = {}  # id(parameter) -> its bucket, for live parameters
        self.final: set[int] = set()  # live parameters whose gradient is final this step
        if overlap:
            for bucket in self.order:
                for p in bucket.live:
                    self.bucket_of[id(p)] = bucket
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_gradient))

    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        if self.armed:
            self.mark_final([p])

    def start_step(self) -> None:
        """Reset for a new step (call before the first forward)."""
        self.armed = False
        self.launched = 0
        self.final = set()
        for bucket in self.order:
            bucket.ready, bucket.work = 0, None
            if bucket.tied:
                bucket.flat = None
            else:
                bucket.attach()

    def arm(self) -> None:
        """The next gradient op is the step's last: gradients it produces are final."""
        self.armed = True

    def mark_final(self, params: Iterable[torch.nn.Parameter]) -> None:
        """These parameters' gradients are final: launch the buckets that are complete now, in order."""
        for p in params:
            bucket = self.bucket_of.get(id(p))
            if bucket is not None and id(p) not in self.final:
                self.final.add(id(p))
                bucket.ready += 1
        self._launch_ready()

    def flush(self) -> None:
        """Every gradient of this rank is final: launch what is left (with overlap; else ``finish`` does)."""
        if self.overlap:
            while self.launched < len(self.order):
                self._launch(self.order[self.launched])
                self.launched += 1

    def _launch_ready(self) -> None:
        while self.launched < len(self.order) and self.order[self.launched].ready >= len(
            self.order[self.launched].live
        ):
            self._launch(self.order[self.launched])
            self.launched += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.tied:
            grads = [_grad(p) for p in bucket.params]
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            bucket.flat = total
        else:
            bucket.reclaim()
        assert bucket.flat is not None
        if self.group_sizes[bucket.group] > 1:
            bucket.work = self.comm.allreduce(bucket.group, bucket.flat)

    def finish(self) -> None:
        """Launch what the backward pass did not, wait for every bucket, write the sums back."""
        self.armed = False
        while self.launched < len(self.order):
            self._launch(self.order[self.launched])
            self.launched += 1
        for bucket in self.order:
            if bucket.work is not None:
                self.comm.waiter.work(bucket.work, "all-reducing gradients")
            if bucket.tied:
                assert bucket.flat is not None
                for p in bucket.params:
                    _grad(p).copy_(bucket.flat)
                bucket.flat = None

    def close(self) -> None:
        """Remove the hooks and let go of the buckets (the layers outlive this generation)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for bucket in self.order:
            for p in bucket.params:
                p.grad = None
            bucket.flat, bucket.views = None, []


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
