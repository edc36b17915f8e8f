"""One training step of one rank: the interpreter of its schedule, gradient sync and clipping.

The rank's ops come from the plan (``oobleck.schedules``: 1F1B, Bamboo's redundancy modes,
ReCycle-style re-routed schedules), checked before the first step (``check_schedule``), and run
here in order, with no branch on where they came from:

- F: the forward of layers ``[start, end)`` on rows ``[lo, hi)`` of the microbatch: its tokens when
  ``start`` is 0, else the parts its RECV_F ops received, in row order; the layer ending the model
  also computes the loss (``ModelSpec.loss``: summed over samples, divided by the global batch
  size, so that after the SUM all-reduce of every layer's gradient over all its holders, gradients
  are those of the mean loss over the global batch however it is split);
- B: the full backward (``Tensor.backward``) from the loss or the received output gradient;
- I and W: the backward split as ``torch.distributed.pipelining`` splits it, with its helpers
  ``stage_backward_input`` (the input gradient; keeps what the weight pass needs) and
  ``stage_backward_weight``; a stage whose input is token ids has no input gradient, so (as
  torch's ``PipelineStage`` does for stage 0) its I only keeps the output gradient and its W runs
  the whole backward;
- RF: the forward of the rank's shadow copy (Bamboo), thrown away (no graph), or with ``keep``
  kept with its graph until the step ends, as Bamboo's eager mode keeps it; timed in
  ``StepContext.redundant_s``;
- RECV_F / RECV_B block (abortably, ``Waiter``) until the peer's tensor arrives; SEND_F / SEND_B
  are asynchronous and waited for at the end of the step (point-to-point channels are two-rank
  groups used with ``broadcast``: ``oobleck.runtime.comm``);
- REDUCE_GRAD: every gradient of the rank is final; the reducer launches what is not in flight.

Gradient reduction (``oobleck.runtime.reducer``) overlaps the backward pass: during the op marked
``final`` each bucket's all-reduce starts as soon as its parameters' gradients are final.
Shapes of the tensors crossing stage boundaries come from the model's ``ModelSpec``.

``torch.distributed.pipelining``'s schedules themselves (``_PipelineScheduleRuntime``) are not
used: their actions name a stage index mapped to one rank, so they cannot say that a stage is
sharded over several devices with rows split, that a microbatch runs one stage on another
pipeline's rank, or that a layer's gradient is reduced across heterogeneous pipelines; and a
``PipelineStage`` needs a registered process group, while a generation's groups here are built
over a prefix store and abandoned on abort (``oobleck.runtime.comm``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oobleck.data import GlobalBatchSampler, TokenDataset, collate
from oobleck.errors import PlanningError, RunError
from oobleck.models.spec import ModelSpec
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.reducer import GradientReducer, _Bucket  # noqa: F401 (_Bucket: tests)
from oobleck.runtime.state import LayerState
from oobleck.runtime.topology import WORLD, Topology
from oobleck.schedules import Op, OpKind, build_schedule, check_schedule

# Called with a phase name (forward, backward, allreduce, optimizer) as the step reaches it; the
# fault injector uses it to strike at a chosen point.
PhaseHook = Callable[[str], None]

_BACKWARD_PHASE = frozenset({OpKind.RECV_B, OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT})


def rank_schedule(topology: Topology) -> tuple[Op, ...]:
    """This rank's ops: the plan's schedule, checked whole before any rank runs it."""
    plan = topology.plan
    try:
        schedule = build_schedule(plan, topology.routes)
        check_schedule(plan, schedule)
    except PlanningError as error:
        raise RunError(f"the plan's schedule cannot run: {error}") from None
    return schedule.of(topology.rank)


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
    # When set, each step's compute ops (kind, microbatch, layers, rows) are listed in ``work``.
    record_work: bool = False
    work: list[tuple[str, int, int, int, int, int]] = field(default_factory=list)
    ops: tuple[Op, ...] = field(init=False)
    reducer: GradientReducer = field(init=False)
    # Every rank holds every layer (pure data parallelism): after the reduction every rank has
    # the same gradients, so each computes the same norm alone and no norm all-reduce is needed.
    norm_is_local: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ops = rank_schedule(self.topology)
        self.reducer = GradientReducer(self, bucket_bytes=self.bucket_bytes, overlap=self.overlap_grad_reduce)
        everything = tuple(range(self.topology.plan.num_layers))
        self.norm_is_local = all(tuple(sorted(a.layers)) == everything for a in self.topology.plan.assignments())

    def phase(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name)

    def stage_params(self) -> list[torch.nn.Parameter]:
        return [p for i in self.topology.assignment.layers for p in self.layers[i].params]

    def close(self) -> None:
        """Remove the reducer's hooks from the layers (they outlive this generation)."""
        self.reducer.close()


class _Step:
    """What one step's ops hand each other on this rank (see the module docstring)."""

    def __init__(self, ctx: StepContext, step: int) -> None:
        self.ctx, self.step = ctx, step
        self.lo, self.hi = ctx.topology.my_rows()
        self.comm, self.waiter = ctx.comm, ctx.comm.waiter
        self.rank = ctx.topology.rank
        self.last_layer = ctx.topology.plan.num_layers - 1
        self.batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.received: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # mb -> (input, output or loss)
        self.outputs: dict[int, torch.Tensor] = {}  # mb -> output, detached (sent on, read by RF)
        self.input_grads: dict[int, torch.Tensor] = {}
        self.weight_pass: dict[int, Any] = {}  # mb -> what its W needs
        self.kept: list[torch.Tensor] = []  # redundant outputs kept until the step ends
        self.pending: list[tuple[Any, str]] = []
        self.loss_total = 0.0
        self.handlers: dict[OpKind, Callable[[Op], None]] = {
            OpKind.FORWARD: self._forward,
            OpKind.BACKWARD: self._backward,
            OpKind.BACKWARD_INPUT: self._backward_input,
            OpKind.BACKWARD_WEIGHT: self._backward_weight,
            OpKind.REDUNDANT_FORWARD: self._redundant_forward,
            OpKind.RECV_F: lambda op: self._receive(op, "act", op.start - 1),
            OpKind.RECV_B: lambda op: self._receive(op, "grad", op.end - 1),
            OpKind.SEND_F: lambda op: self._send(op, "act", self.outputs[op.microbatch]),
            OpKind.SEND_B: lambda op: self._send(op, "grad", self.input_grads[op.microbatch]),
            OpKind.REDUCE_GRAD: lambda op: ctx.reducer.flush(),
        }

    def batch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        if mb not in self.batches:
            ctx = self.ctx
            indices = ctx.sampler.microbatch_indices(self.step, mb, ctx.topology.plan.microbatch_size)
            inputs, targets = collate(ctx.dataset, indices[self.lo : self.hi])
            self.batches[mb] = (inputs.to(ctx.device), targets.to(ctx.device))
        return self.batches[mb]

    def run(self, op: Op) -> None:
        self.handlers[op.kind](op)
        if self.ctx.record_work and op.is_compute:
            self.ctx.work.append((op.kind.value, op.microbatch, op.start, op.end, op.lo, op.hi))

    # ----- communication -------------------------------------------------------------------------
    def _receive(self, op: Op, kind: str, boundary: int) -> None:
        spec = self.ctx.spec
        buf = torch.empty(
            spec.boundary_shape(boundary, op.hi - op.lo), dtype=spec.boundary_dtype, device=self.ctx.device
        )
        what = f"receiving {'activations' if kind == 'act' else 'gradients'} of microbatch {op.microbatch}"
        self.waiter.work(self.comm.broadcast(channel_name(op.peer, self.rank, kind), buf, op.peer), what)
        self.received.setdefault((op.microbatch, kind), []).append(buf)

    def _send(self, op: Op, kind: str, tensor: torch.Tensor) -> None:
        piece = tensor[op.lo - self.lo : op.hi - self.lo].contiguous()
        what = f"sending {'activations' if kind == 'act' else 'gradients'} of microbatch {op.microbatch}"
        self.pending.append((self.comm.broadcast(channel_name(self.rank, op.peer, kind), piece, self.rank), what))

    def _take(self, mb: int, kind: str) -> torch.Tensor:
        parts = self.received.pop((mb, kind))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # ----- compute -------------------------------------------------------------------------------
    def _layers(self, op: Op, x: torch.Tensor) -> torch.Tensor:
        for index in range(op.start, op.end):
            x = self.ctx.layers[index].module(x)
        return x

    def _forward(self, op: Op) -> None:
        mb = op.microbatch
        if op.start == 0:
            x, x_in = self.batch(mb)[0], None
        else:
            x = self._take(mb, "act")
            x.requires_grad_(True)
            x_in = x
        out = self._layers(op, x)
        if op.end - 1 == self.last_layer:
            loss = self.ctx.spec.loss(out, self.batch(mb)[1])
            self.loss_total += float(loss.detach())
            self.saved[mb] = (x_in, loss / self.ctx.global_batch_size)
        else:
            self.saved[mb] = (x_in, out)
            self.outputs[mb] = out.detach()

    def _output_grad(self, op: Op) -> torch.Tensor | None:
        """The gradient flowing into this op's output: received, or None at the loss."""
        return None if op.end - 1 == self.last_layer else self._take(op.microbatch, "grad")

    def _backward(self, op: Op) -> None:
        x_in, out = self.saved.pop(op.microbatch)
        self.outputs.pop(op.microbatch, None)
        if op.final:
            self.ctx.reducer.arm()
        out.backward(self._output_grad(op))
        if x_in is not None:
            self.input_grads[op.microbatch] = _input_grad(x_in.grad, op)

    def _backward_input(self, op: Op) -> None:
        mb = op.microbatch
        x_in, out = self.saved.pop(mb)
        self.outputs.pop(mb, None)
        grad = self._output_grad(op)
        if x_in is None:  # token ids: no input gradient; W runs the whole backward
            self.weight_pass[mb] = ("whole", out, grad)
            return
        # Imported where used: torch.distributed.pipelining brings torch._dynamo and DTensor with
        # it (~2 s of CPU), which a process that never splits a backward need not pay.
        from torch.distributed.pipelining._backward import stage_backward_input

        dinputs, groups = stage_backward_input(
            [out], None if grad is None else [grad], [x_in], iter(self.ctx.stage_params())
        )
        self.input_grads[mb] = _input_grad(dinputs[0], op)
        self.weight_pass[mb] = ("groups", groups, None)

    def _backward_weight(self, op: Op) -> None:
        how, what, grad = self.weight_pass.pop(op.microbatch)
        reducer = self.ctx.reducer
        if op.final:
            reducer.arm()
        if how == "whole":
            what.backward(grad)
        else:
            from torch.distributed.pipelining._backward import stage_backward_weight

            stage_backward_weight(iter(self.ctx.stage_params()), what)
        if op.final:  # autograd.grad ran no accumulate hooks: report the final gradients
            reducer.mark_final(self.ctx.stage_params())

    def _redundant_forward(self, op: Op) -> None:
        started = time.perf_counter()
        x = self.batch(op.microbatch)[0] if op.start == 0 else self.outputs[op.microbatch]
        if op.keep:
            self.kept.append(self._layers(op, x))
        else:
            with torch.no_grad():
                self._layers(op, x)
        self.ctx.redundant_s += time.perf_counter() - started


def _input_grad(grad: torch.Tensor | None, op: Op) -> torch.Tensor:
    """A received activation's gradient, which the previous stage waits for: autograd leaves it
    None only when the stage's output does not depend on its input, a model that cannot train."""
    if grad is None:
        raise RuntimeError(
            f"layers {op.start}..{op.end - 1} gave no gradient for their input of microbatch {op.microbatch}: "
            "the output does not depend on the input"
        )
    return grad


def run_schedule(ctx: StepContext, step: int) -> float:
    """Run this rank's ops for step ``step``; returns the summed loss of the microbatches whose
    loss it computed. Gradient buckets are launched during the last gradient op;
    ``sync_gradients`` completes them."""
    run = _Step(ctx, step)
    ctx.reducer.start_step()
    ctx.work = []
    ctx.phase("forward")
    in_backward = False
    for op in ctx.ops:
        if not in_backward and op.kind in _BACKWARD_PHASE:
            ctx.phase("backward")
            in_backward = True
        run.run(op)
    if not in_backward:
        ctx.phase("backward")
    for work, what in run.pending:
        run.waiter.work(work, what)
    return run.loss_total


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
