"""One training step of one rank: the 1F1B schedule, gradient synchronisation and clipping.

The schedule is the non-interleaved 1F1B: stage i of S runs min(S-i-1, m) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. A rank holding a
shadow copy of another stage (Bamboo-style plans) also runs that stage's forward pass on each
microbatch, redundantly (no gradient; timed in ``StepContext.redundant_s``): the successor's
layers on its own output, or, for the first stage's layers, on the microbatch's tokens. Receives block
(abortably); sends are asynchronous and waited for at the end of the step. Each microbatch loss
(``ModelSpec.loss``: summed over samples) is divided by the global batch size, so after the SUM
all-reduce of every layer's gradient over all its holders, gradients are those of the mean loss
over the global batch however it is split across pipelines, stages and shards.

Gradient reduction (``GradientReducer``) overlaps the backward pass, as torch's DDP does: each
gradient group's parameters are cut into buckets in reverse layer order, and a bucket's
all-reduce starts as soon as the last microbatch's backward has produced the final gradient of
every parameter in it (per-parameter post-accumulate hooks); the reducer waits for all of them
before the gradient norm. As DDP's ``gradient_as_bucket_view``, a bucket's parameters' gradients
are views of its one flat tensor, so backward accumulates straight into what is all-reduced, in
place: no copy into the bucket and none back. Shapes of the tensors crossing stage boundaries
come from the model's ``ModelSpec``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oobleck.data import GlobalBatchSampler, TokenDataset, collate
from oobleck.models.spec import ModelSpec
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.state import LayerState
from oobleck.runtime.topology import WORLD, Topology

# Called with a phase name (forward, backward, allreduce, optimizer) as the step reaches it; the
# fault injector uses it to strike at a chosen point.
PhaseHook = Callable[[str], None]


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
    hook, armed only during the step's last backward (the one that makes its gradient final);
    without, every bucket is launched by ``finish``. Parameters the backward never reaches
    (shadow copies, a shard with no rows) contribute zeros. ``close`` removes the hooks and the
    gradient views.
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
        self.armed = False
        self.launched = 0
        self.handles: list[Any] = []
        if overlap:
            for bucket in self.order:
                for p in bucket.live:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: _Bucket) -> Callable[[torch.nn.Parameter], None]:
        def on_gradient(_p: torch.nn.Parameter) -> None:
            if self.armed:
                bucket.ready += 1
                self._launch_ready()

        return on_gradient

    def start_step(self) -> None:
        """Reset for a new step (call before the first forward)."""
        self.armed = False
        self.launched = 0
        for bucket in self.order:
            bucket.ready, bucket.work = 0, None
            if bucket.tied:
                bucket.flat = None
            else:
                bucket.attach()

    def last_backward(self) -> None:
        """The next backward pass is the step's last: gradients it produces are final."""
        self.armed = True

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
                    p.grad.copy_(bucket.flat)
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


@dataclass
class StepContext:
    topology: Topology
    comm: Communicator
    layers: dict[int, LayerState]
    spec: ModelSpec
    dataset: TokenDataset
    sampler: GlobalBatchSampler
    global_batch_size: int
    device: str = "cpu"
    bucket_bytes: int = 4 << 20
    overlap_grad_reduce: bool = True
    hook: PhaseHook | None = None
    redundant_s: float = 0.0  # seconds of redundant forward work (shadow copies) this step
    reducer: GradientReducer = field(init=False)
    # Every rank holds every layer (pure data parallelism): after the reduction every rank has
    # the same gradients, so each computes the same norm alone and no norm all-reduce is needed.
    norm_is_local: bool = field(init=False)

    def __post_init__(self) -> None:
        self.reducer = GradientReducer(self, bucket_bytes=self.bucket_bytes, overlap=self.overlap_grad_reduce)
        everything = tuple(range(self.topology.plan.num_layers))
        self.norm_is_local = all(tuple(sorted(a.layers)) == everything for a in self.topology.plan.assignments())

    def phase(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name)

    def stage_layers(self) -> list[LayerState]:
        return [self.layers[i] for i in self.topology.assignment.layers]

    def close(self) -> None:
        """Remove the reducer's hooks from the layers (they outlive this generation)."""
        self.reducer.close()


def _forward_layers(ctx: StepContext, x: torch.Tensor) -> torch.Tensor:
    for layer in ctx.stage_layers():
        x = layer.module(x)
    return x


def _redundant_forward(ctx: StepContext, out: torch.Tensor, tokens: Callable[[], torch.Tensor]) -> None:
    """The forward pass of this rank's shadow copies, thrown away (Bamboo's redundant computation)."""
    shadow = ctx.topology.assignment.shadow_layers
    if not shadow:
        return
    started = time.perf_counter()
    with torch.no_grad():
        x = tokens() if shadow[0] == 0 else out.detach()
        for index in shadow:
            x = ctx.layers[index].module(x)
    ctx.redundant_s += time.perf_counter() - started


def run_schedule(ctx: StepContext, step: int) -> float:
    """Forward and backward of this rank's share of step ``step``; returns the summed loss (last
    stage). Gradient buckets are launched during the last backward; ``sync_gradients`` completes
    them."""
    topo, comm, waiter, spec = ctx.topology, ctx.comm, ctx.comm.waiter, ctx.spec
    lo, hi = topo.my_rows()
    b = topo.plan.microbatch_size
    microbatches = list(topo.microbatches())
    m, S, i = len(microbatches), topo.num_stages, topo.assignment.stage
    pending: list[tuple[Any, str]] = []
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    loss_total = 0.0
    empty = hi <= lo
    layers = topo.assignment.layers
    # What crosses the boundary before my first layer (received) and after my last (sent back).
    in_shape = (lambda rows: spec.boundary_shape(layers[0] - 1, rows)) if not topo.is_first else None
    out_shape = lambda rows: spec.boundary_shape(layers[-1], rows)  # noqa: E731
    ctx.reducer.start_step()

    def load(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = ctx.sampler.microbatch_indices(step, mb, b)[lo:hi]
        inputs, targets = collate(ctx.dataset, indices)
        return inputs.to(ctx.device), targets.to(ctx.device)

    def receive(offset: int, kind: str, shape: Callable[[int], tuple[int, ...]], what: str) -> torch.Tensor:
        parts = []
        for rank, (a, c) in topo.peer_rows(offset):
            buf = torch.empty(shape(c - a), dtype=spec.boundary_dtype, device=ctx.device)
            waiter.work(comm.broadcast(channel_name(rank, topo.rank, kind), buf, rank), what)
            parts.append(buf)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def send(offset: int, kind: str, tensor: torch.Tensor, what: str) -> None:
        for rank, (a, c) in topo.peer_rows(offset):
            piece = tensor[a - lo : c - lo].contiguous()
            pending.append((comm.broadcast(channel_name(topo.rank, rank, kind), piece, topo.rank), what))

    def forward(k: int) -> None:
        nonlocal loss_total
        if empty:
            return
        mb = microbatches[k]
        batch = load(mb) if topo.is_first or topo.is_last else None
        if topo.is_first:
            assert batch is not None
            x = batch[0]
            x_in: torch.Tensor | None = None
        else:
            assert in_shape is not None
            x = receive(-1, "act", in_shape, f"receiving activations of microbatch {mb}")
            x.requires_grad_(True)
            x_in = x
        out = _forward_layers(ctx, x)
        _redundant_forward(ctx, out, lambda: batch[0] if batch is not None else load(mb)[0])
        if topo.is_last:
            assert batch is not None
            loss = spec.loss(out, batch[1])
            loss_total += float(loss.detach())
            saved[k] = (x_in, loss / ctx.global_batch_size)
        else:
            send(+1, "act", out.detach(), f"sending activations of microbatch {mb}")
            saved[k] = (x_in, out)

    def backward(k: int) -> None:
        if empty:
            return
        mb = microbatches[k]
        x_in, out = saved.pop(k)
        if k == m - 1:
            ctx.reducer.last_backward()
        if topo.is_last:
            out.backward()
        else:
            out.backward(receive(+1, "grad", out_shape, f"receiving gradients of microbatch {mb}"))
        if x_in is not None:
            send(-1, "grad", x_in.grad, f"sending gradients of microbatch {mb}")

    warmup = min(S - i - 1, m)
    ctx.phase("forward")
    for k in range(warmup):
        forward(k)
    for k in range(m - warmup):
        forward(warmup + k)
        if k == 0:
            ctx.phase("backward")
        backward(k)
    if m - warmup == 0:
        ctx.phase("backward")
    for k in range(m - warmup, m):
        backward(k)
    for work, what in pending:
        waiter.work(work, what)
    return loss_total


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def sync_gradients(ctx: StepContext) -> None:
    """Complete the SUM all-reduce of every layer's gradients over its holders (buckets the
    backward pass did not launch are launched now), and of the tied weight's gradient over the
    holders of both of its layers."""
    ctx.reducer.finish()


def global_grad_norm(ctx: StepContext) -> float:
    """The L2 norm of the whole model's gradient, each layer counted once (by its lowest-rank
    holder) and the tied weight once (with its first layer)."""
    topo = ctx.topology
    tied_skip = {}
    if ctx.spec.tied:
        tied_layers = sorted(ctx.spec.tied_names)
        tied_skip = {layer: ctx.spec.tied_names[layer] for layer in tied_layers[1:]}
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for index in sorted(topo.assignment.layers):
        if not ctx.norm_is_local and topo.norm_owner.get(index) != topo.rank:
            continue
        for name, p in ctx.layers[index].module.named_parameters():
            if tied_skip.get(index) == name or p.grad is None:
                continue
            total += p.grad.detach().double().pow(2).sum()
    if len(topo.world) > 1 and not ctx.norm_is_local:
        ctx.comm.allreduce_wait(WORLD, total, "all-reducing the gradient norm")
    return math.sqrt(float(total))


def clip_and_step(ctx: StepContext, norm: float, max_norm: float, lr: float) -> None:
    """Scale gradients like ``clip_grad_norm_`` (coefficient max/(norm+1e-6), at most 1), then step."""
    coefficient = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
    for index in ctx.topology.assignment.held_layers:  # shadow copies step too, staying identical
        layer = ctx.layers[index]
        if coefficient < 1.0:
            for p in layer.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        for group in layer.optimizer.param_groups:
            group["lr"] = lr
        layer.optimizer.step()
