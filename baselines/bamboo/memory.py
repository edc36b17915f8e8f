"""What Bamboo keeps where, per redundancy mode, and what its failover recomputes.

From Bamboo's DeepSpeed fork (github.com/uclasystem/bamboo, ``deepspeed/runtime/pipe/engine.py``;
the modes themselves: ``oobleck.schedules.bamboo``), for one device of stage i of a pipeline of P
stages running m microbatches, the stage on g devices (each keeps 1/g of every activation):

- every mode: the stage's own state (``own_state``: parameters, gradients, Adam's two moments) and
  the activations of the ``P - i`` microbatches 1F1B keeps in flight there, on the device; and,
  for a stage that is not the first, the gradient of its input for every microbatch in host
  memory (``input_grad_<stage>``: ``inputs.clone().detach().to('cpu')`` once redundancy is on), so
  that a failed-over predecessor can be fed;
- ``eager``: the copy of the successor's layers is built on the device with its optimizer state
  (``build_layers`` then ``allocate_state`` on ``self.device``): its whole state on the device;
  the redundant forward's outputs, with their graph, for every microbatch of the iteration
  (its buffers are indexed by microbatch and released only by the next ``train_batch``);
- ``lazy`` (Bamboo's default): the copy's parameters and optimizer state (no gradients) in host
  memory (``allocate_param(stage_id, ..., 'cpu')``, ``allocate_state``), and each stage's output
  for every microbatch, moved to host memory after its backward (``outputs.clone().detach()
  .to('cpu')``; the last stage's output is the loss and is not kept);
- ``inline`` (not one of Bamboo's): the copy's whole state on the device, and, with
  ``keep_redundant_activations``, the redundant forward's activations of the microbatches in
  flight (a memory model kept for the paper experiments; the runtime throws them away).

On a failover the predecessor of the lost stage resumes the interrupted iteration
(``NextStageFailoverSchedule``): it redoes the lost stage's commands of the steps already done,
skipping forwards whose outputs it holds (eager: ``_exec_forward_pass`` returns at once when the
output buffer is filled); lazy first builds the copy on the device from host memory.
``failover_extra_seconds`` is that extra work; this harness's own runtime redoes the whole
interrupted step in every mode instead (its commit protocol discards the step everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.planning.outputs import REDUNDANCY_MODES

# Bamboo's copy in host memory: fp32 parameters and Adam's two moments, no gradients (bytes per
# fp32 parameter byte).
HOST_COPY_BYTES_PER_PARAM_BYTE = 3


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes one device of a stage needs on the device, and in its node's host memory."""

    device_bytes: float
    host_bytes: float


def stage_memory(
    mode: str,
    *,
    own_state: float,
    own_activations: float,
    copy_param_bytes: float,
    copy_state: float,
    copy_activations: float,
    input_bytes: float,
    output_bytes: float,
    stage: int,
    stages: int,
    microbatches: int,
    gpus: int,
    keep_redundant_activations: bool = True,
) -> StageMemory:
    """Bytes per device of stage ``stage`` of ``stages`` (see the module docstring).

    ``own_state`` / ``copy_state``: the stage's and its copy's device state (16 bytes per fp32
    parameter: parameters, gradients, two moments); ``copy_param_bytes``: the copy's fp32 parameter
    bytes; ``own_activations`` / ``copy_activations``: activations kept for backward per microbatch
    (whole stage); ``input_bytes`` / ``output_bytes``: the stage's boundary tensors per microbatch.
    """
    if mode not in REDUNDANCY_MODES:
        raise ValueError(f"redundancy={mode!r} is not one of {', '.join(REDUNDANCY_MODES)}")
    in_flight = stages - stage
    device = own_state + own_activations * in_flight / gpus
    host = input_bytes * microbatches / gpus if stage > 0 else 0.0
    if mode == "eager":
        device += copy_state + (copy_activations * microbatches / gpus if keep_redundant_activations else 0.0)
    elif mode == "inline":
        device += copy_state + (copy_activations * in_flight / gpus if keep_redundant_activations else 0.0)
    else:
        host += HOST_COPY_BYTES_PER_PARAM_BYTE * copy_param_bytes
        host += output_bytes * microbatches / gpus if stage < stages - 1 else 0.0
    return StageMemory(device, host)


def failover_extra_seconds(
    mode: str,
    *,
    lost_forward_s: float,
    lost_backward_s: float,
    done_forwards: int,
    done_backwards: int,
    copy_param_bytes: float,
    host_to_device_bytes_per_s: float,
) -> float:
    """Seconds Bamboo's predecessor spends before it is back where the lost stage was: redoing the
    lost stage's ``done_forwards`` forwards (per microbatch ``lost_forward_s``; none in eager mode,
    which holds their outputs) and ``done_backwards`` backwards of the interrupted iteration, after
    (lazy) moving the copy's parameters and moments from host to device memory."""
    if mode not in REDUNDANCY_MODES:
        raise ValueError(f"redundancy={mode!r} is not one of {', '.join(REDUNDANCY_MODES)}")
    seconds = done_backwards * lost_backward_s
    if mode != "eager":
        seconds += done_forwards * lost_forward_s
    if mode == "lazy":
        seconds += HOST_COPY_BYTES_PER_PARAM_BYTE * copy_param_bytes / host_to_device_bytes_per_s
    return seconds
