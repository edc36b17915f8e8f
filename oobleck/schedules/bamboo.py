"""Bamboo's redundant forward pass, placed as Bamboo's own pipeline schedule places it.

Bamboo (Thorpe et al., NSDI'23; its DeepSpeed fork, ``deepspeed/runtime/pipe/schedule.py`` and
``engine.py`` in github.com/uclasystem/bamboo) gives each stage a copy of its successor's layers
(``get_redundant_stage_ids``: stage ``(i + 1) mod P``) and merges the successor's schedule into
the stage's own in one of two modes, chosen by ``eager_recovery`` (the examples' ``--eager``
flag, default false: **lazy is Bamboo's default**):

- ``lazy`` (``LazyRecoverySchedule``): no redundant forward in steady state; the copy's
  parameters and optimizer state live in host memory (``allocate_param(..., 'cpu')``), each
  stage keeps its output for every microbatch in host memory after its backward, and on a
  failover the predecessor moves the copy onto the device (``build_layers``) and recomputes the
  lost stage's forward passes of the interrupted iteration (``NextStageFailoverSchedule``'s redo
  of the successor's commands). Its steady-state extra is a one-element "ping" exchanged in the
  bubbles (``RecvActivation(-1)``), which this harness's heartbeats replace, so nothing is added;
- ``eager`` (``EagerRecoverySchedule._merge_cmds``): the copy lives on the device and the
  successor's forward of microbatch k runs on the stage right before the stage's
  ``RecvGrad`` of microbatch k, i.e. before the wait for gradients, inside the pipeline bubble;
  its outputs (with their autograd graph) stay on the device for the whole iteration (Bamboo's
  buffers are indexed by microbatch and released at the next ``train_batch``), so a failover
  needs no recompute.

And a third mode, not one of Bamboo's (the paper experiments set it: its memory reproduces the
artifact's out-of-memory decisions):

- ``inline``: the redundant forward right after the stage's own forward of the microbatch, before
  its activations are sent on (on the critical path), thrown away.

Where we differ from Bamboo's code, and why:

- its last stage never has a ``RecvGrad``, so ``EagerRecoverySchedule`` never flushes the
  redundant forward of stage 0 that the last stage holds (its buffer only grows); we place that
  one before the last stage's wait for the microbatch's activations (its only wait; stage 0's
  forward needs only the tokens), so the ring's copy of stage 0 is exercised like every other;
- its copies' weights are never refreshed in steady state (``_exec_recv_weights`` returns at
  once; no schedule issues ``SendWeights``); ours are kept bit-identical by joining the layer's
  gradient reduction and optimizer step (``oobleck.runtime.topology``), which exactness needs;
- ours keep the copy where the stage's own state is (on this harness's CPU runs host and device
  memory are the same); where Bamboo keeps what is the memory model's business
  (``baselines.bamboo.memory``);
- a failure here discards the step in flight everywhere and the new generation redoes it
  (``DESIGN.md``, section 4), so every mode recomputes the interrupted step after a failover:
  eager's kept activations save Bamboo a recompute mid-iteration, which this harness never
  does; the cost model charges lazy's recompute and host-to-device copy
  (``baselines.bamboo.memory.failover_extra_seconds``).
"""

from __future__ import annotations

from oobleck.errors import PlanningError
from oobleck.planning.outputs import REDUNDANCY_MODES, ExecutionPlan
from oobleck.schedules.ops import Op, OpKind


def shadow_range(plan: ExecutionPlan, rank: int) -> tuple[int, int] | None:
    """Layers ``[start, end)`` of the shadow copy rank ``rank`` holds, or None."""
    layers = plan.assignments()[rank].shadow_layers
    if not layers:
        return None
    start, end = layers[0], layers[-1] + 1
    if tuple(layers) != tuple(range(start, end)):
        raise PlanningError(f"rank {rank}'s shadow copy {list(layers)} is not one contiguous layer range")
    return start, end


def place_redundant_forwards(plan: ExecutionPlan, ranks: list[list[Op]], mode: str) -> list[list[Op]]:
    """``ranks`` (lowered 1F1B lists) with each shadow holder's redundant forwards placed by ``mode``."""
    if mode not in REDUNDANCY_MODES:
        raise PlanningError(f"redundancy={mode!r} is not one of {', '.join(REDUNDANCY_MODES)}")
    if mode == "lazy":
        return ranks
    result = []
    for rank, ops in enumerate(ranks):
        shadow = shadow_range(plan, rank)
        result.append(ops if shadow is None else _with_redundant(ops, shadow, mode))
    return result


def _with_redundant(ops: list[Op], shadow: tuple[int, int], mode: str) -> list[Op]:
    out = list(ops)
    for op in ops:
        if op.kind is not OpKind.FORWARD:
            continue
        redundant = Op(
            OpKind.REDUNDANT_FORWARD, op.microbatch, shadow[0], shadow[1], op.lo, op.hi, keep=mode == "eager"
        )
        out.insert(_slot(out, op, shadow, mode), redundant)
    return out


def _slot(ops: list[Op], forward: Op, shadow: tuple[int, int], mode: str) -> int:
    """Where the redundant forward of ``forward``'s microbatch goes in ``ops``."""
    mb = forward.microbatch
    after_forward = ops.index(forward) + 1
    if mode == "eager":
        wait_for_gradient = _first(ops, OpKind.RECV_B, mb, after_forward)
        if wait_for_gradient is not None:
            return wait_for_gradient
        if shadow[0] == 0:  # needs only the tokens: it may run before the wait for activations
            wait_for_input = _first(ops, OpKind.RECV_F, mb, 0)
            if wait_for_input is not None:
                return wait_for_input
        while after_forward < len(ops) and ops[after_forward].kind is OpKind.SEND_F:
            after_forward += 1  # no wait to fill: after the activations have left
    return after_forward


def _first(ops: list[Op], kind: OpKind, microbatch: int, start: int) -> int | None:
    for index in range(start, len(ops)):
        if ops[index].kind is kind and ops[index].microbatch == microbatch:
            return index
    return None
