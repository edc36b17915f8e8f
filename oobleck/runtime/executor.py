"""One training step of one rank: the 1F1B schedule, gradient synchronisation and clipping.

The schedule is the non-interleaved 1F1B: stage i of S runs min(S-i-1, m) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. A rank holding a
shadow copy of another stage (Bamboo-style plans) also runs that stage's forward pass on each
microbatch, redundantly (no gradient; timed in ``StepContext.redundant_s``): the successor's
layers on its own output, or, for the first stage's layers, on the microbatch's tokens. Receives block
(abortably); sends are asynchronous and waited for at the end of the step. Each microbatch loss
(``loss_fn``: summed over samples) is divided by the global batch size, so after the SUM all-reduce
of every layer's gradient over all its holders, gradients are those of the mean loss over the
global batch however it is split across pipelines, stages and shards.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from oobleck.data import GlobalBatchSampler, TokenDataset, collate
from oobleck.models import loss_fn
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.state import LayerState
from oobleck.runtime.topology import WORLD, Topology

# Called with a phase name (forward, backward, allreduce, optimizer) as the step reaches it; the
# fault injector uses it to strike at a chosen point.
PhaseHook = Callable[[str], None]


@dataclass
class StepContext:
    topology: Topology
    comm: Communicator
    layers: dict[int, LayerState]
    dataset: TokenDataset
    sampler: GlobalBatchSampler
    seq_len: int
    n_embd: int
    global_batch_size: int
    tied_names: dict[int, str] = field(default_factory=dict)  # layer -> its copy of the tied weight
    device: str = "cpu"
    bucket_bytes: int = 4 << 20
    hook: Optional[PhaseHook] = None
    redundant_s: float = 0.0  # seconds of redundant forward work (shadow copies) this step

    def phase(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name)

    def stage_layers(self) -> list[LayerState]:
        return [self.layers[i] for i in self.topology.assignment.layers]


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
    """Forward and backward of this rank's share of step ``step``; returns the summed loss (last stage)."""
    topo, comm, waiter = ctx.topology, ctx.comm, ctx.comm.waiter
    lo, hi = topo.my_rows()
    b = topo.plan.microbatch_size
    microbatches = list(topo.microbatches())
    m, S, i = len(microbatches), topo.num_stages, topo.assignment.stage
    pending: list[tuple[Any, str]] = []
    saved: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    loss_total = 0.0
    empty = hi <= lo

    def load(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = ctx.sampler.microbatch_indices(step, mb, b)[lo:hi]
        inputs, targets = collate(ctx.dataset, indices)
        return inputs.to(ctx.device), targets.to(ctx.device)

    def forward(k: int) -> None:
        nonlocal loss_total
        if empty:
            return
        mb = microbatches[k]
        if topo.is_first:
            x, _ = load(mb)
            x_in: Optional[torch.Tensor] = None
        else:
            parts = []
            for rank, (a, c) in topo.peer_rows(-1):
                buf = torch.empty(c - a, ctx.seq_len, ctx.n_embd, device=ctx.device)
                waiter.work(comm.broadcast(channel_name(rank, topo.rank, "act"), buf, rank), f"receiving activations of microbatch {mb}")
                parts.append(buf)
            x = torch.cat(parts) if len(parts) > 1 else parts[0]
            x.requires_grad_(True)
            x_in = x
        out = _forward_layers(ctx, x)
        _redundant_forward(ctx, out, lambda: load(mb)[0])
        if topo.is_last:
            _, targets = load(mb)
            loss = loss_fn(out, targets)
            loss_total += float(loss.detach())
            saved[k] = (x_in, loss / ctx.global_batch_size)
        else:
            for rank, (a, c) in topo.peer_rows(+1):
                piece = out.detach()[a - lo : c - lo].contiguous()
                name = channel_name(topo.rank, rank, "act")
                pending.append((comm.broadcast(name, piece, topo.rank), f"sending activations of microbatch {mb}"))
            saved[k] = (x_in, out)

    def backward(k: int) -> None:
        if empty:
            return
        mb = microbatches[k]
        x_in, out = saved.pop(k)
        if topo.is_last:
            out.backward()
        else:
            parts = []
            for rank, (a, c) in topo.peer_rows(+1):
                buf = torch.empty(c - a, ctx.seq_len, ctx.n_embd, device=ctx.device)
                waiter.work(comm.broadcast(channel_name(rank, topo.rank, "grad"), buf, rank), f"receiving gradients of microbatch {mb}")
                parts.append(buf)
            out.backward(torch.cat(parts) if len(parts) > 1 else parts[0])
        if x_in is not None:
            for rank, (a, c) in topo.peer_rows(-1):
                piece = x_in.grad[a - lo : c - lo].contiguous()
                name = channel_name(topo.rank, rank, "grad")
                pending.append((comm.broadcast(name, piece, topo.rank), f"sending gradients of microbatch {mb}"))

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
    """SUM-all-reduce every layer's gradients over its holders (bucketed), and the tied weight's
    gradient over the holders of both of its layers."""
    topo, comm = ctx.topology, ctx.comm
    tied = ctx.tied_names
    launched: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    for group in topo.my_grad_groups():
        bucket: list[torch.Tensor] = []
        size = 0

        def flush() -> None:
            nonlocal bucket, size
            if bucket:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                launched.append((comm.allreduce(group.name, flat), flat, bucket))
            bucket, size = [], 0

        for layer_index in group.layers:
            layer = ctx.layers[layer_index]
            for name, p in layer.module.named_parameters():
                if tied.get(layer_index) == name:
                    continue
                g = _grad(p)
                bucket.append(g)
                size += g.numel() * g.element_size()
                if size >= ctx.bucket_bytes:
                    flush()
        flush()
    tied_local: list[torch.Tensor] = []
    tied_sum: Optional[torch.Tensor] = None
    if topo.tied_group is not None and tied:
        for layer_index in topo.tied_group.layers:
            if layer_index in ctx.layers:
                g = _grad(ctx.layers[layer_index].module.get_parameter(tied[layer_index]))
                tied_local.append(g)
                tied_sum = g.clone() if tied_sum is None else tied_sum + g
        if tied_sum is not None and len(topo.tied_group.ranks) > 1:
            launched.append((comm.allreduce(topo.tied_group.name, tied_sum), tied_sum, []))
    for work, flat, grads in launched:
        comm.waiter.work(work, "all-reducing gradients")
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
    if tied_sum is not None:
        for g in tied_local:
            g.copy_(tied_sum)


def global_grad_norm(ctx: StepContext) -> float:
    """The L2 norm of the whole model's gradient, each layer counted once (by its lowest-rank
    holder) and the tied weight once (with its first layer)."""
    topo = ctx.topology
    tied_skip = {}
    if ctx.tied_names:
        tied_layers = sorted(ctx.tied_names)
        tied_skip = {layer: ctx.tied_names[layer] for layer in tied_layers[1:]}
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for index, layer in ctx.layers.items():
        if index not in topo.assignment.layers or topo.norm_owner.get(index) != topo.rank:
            continue
        for name, p in layer.module.named_parameters():
            if tied_skip.get(index) == name or p.grad is None:
                continue
            total += p.grad.detach().double().pow(2).sum()
    if len(topo.world) > 1:
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
