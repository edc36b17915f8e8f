"""What one torchft worker computes each step: the whole model, or its stage of a replica group.

- ``WholeModel`` (``strategy.nodes_per_replica=1``, torchft's ``train_ddp.py``): the reference model
  wrapped in torchft's own ``DistributedDataParallel`` (``torchft/ddp.py``): torch's DDP over a
  dummy process group whose comm hook all-reduces each gradient bucket through
  ``Manager.allreduce`` (an average over the quorum's participants) as the bucket becomes ready in
  the backward pass; microbatches accumulate under ``no_sync`` and the last one's backward reduces.
  On CPU and gloo that hook waits for each bucket inside the backward (``work.wait()`` blocks the
  autograd thread), so reduction and backward interleave rather than overlap, as torchft does it.
  The hook is restated here (``_TorchftDDP``) for two reasons: the harness's ``allreduce`` fault
  point fires inside it, and torchft 0.2.0's own hook fails its ``assert fut._fut`` when the
  reduction failed (a peer died during it: the chain of futures is never set) or the Manager had
  already errored (``_DummyWork``'s plain future), which raises out of the backward instead of
  failing the vote; here DDP then gets the bucket as it is, and the vote fails as torchft means.
- ``PipelineStage`` (``nodes_per_replica`` > 1, torchft's HSDP-style groups with a pipeline in
  place of FSDP): this node's stage of the planner's template; the group's stages pass
  activations and gradients over a gloo group of their own (all forwards, then the backwards,
  GPipe's order), then the stage's gradient is averaged over the quorum with one
  ``Manager.allreduce`` of the whole stage (each group rank has its own Manager and cross-replica
  group, as torchft's replica groups of several ranks do), the tied weight's two copies are summed
  inside the group, and the clipping norm is summed over the group's stages. Reducing after the
  backward costs what torchft's waiting hook costs on CPU. A failure inside the group (a stage's
  peer gone) raises ``GroupLost``: the group cannot train any more.

Both scale each microbatch's summed loss by ``scale`` before its backward, so that the quorum's
average of the replicas' gradients is the gradient of the mean loss over the samples they trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from oobleck.models.spec import model_spec
from oobleck.runtime.state import tensor_hash

Load = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # microbatch -> (inputs, targets)
Phase = Callable[[str], None]  # the harness's fault points: forward, backward, allreduce


class GroupLost(Exception):
    """A peer of this node's replica group is gone: the group is broken for good."""


def layer_checksums(layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per layer: a hash of its parameters and AdamW moments (equal on every replica, bit for bit)."""
    result = {}
    for index, layer in layers.items():
        pieces = []
        for p in layer.parameters():
            state = optimizer.state.get(p, {})
            pieces += [p.detach().reshape(-1)] + [state[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq") if k in state]
        result[str(index)] = tensor_hash(torch.cat(pieces))
    return result


def _adamw(params: Sequence[nn.Parameter], job: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=float(job.lr), betas=(float(job.beta1), float(job.beta2)), weight_decay=float(job.weight_decay)
    )


def _ddp_class() -> type:
    from torchft.ddp import DistributedDataParallel

    class _TorchftDDP(DistributedDataParallel):
        """torchft's DDP wrapper; its comm hook restated (see the module docstring)."""

        def __init__(self, manager: Any, module: nn.Module, on_allreduce: Callable[[], None]) -> None:
            object.__setattr__(self, "_on_allreduce", on_allreduce)  # before nn.Module's own init
            super().__init__(manager, module)

        def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
            super().register_comm_hook((state, self._on_allreduce), type(self)._reduce)

        # No annotations: DDP checks a hook's annotations against the real types, and this module's
        # postponed annotations are strings.
        @staticmethod
        def _reduce(state, bucket):
            manager, on_allreduce = state
            on_allreduce()
            work = manager.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            # The Manager errored (this reduction failed, or an earlier one did): the step will not
            # commit, so hand DDP the bucket as it is.
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return _TorchftDDP


class WholeModel:
    """One node holds the whole model (module docstring)."""

    reports_steps = True  # this worker computes the loss and reports the step

    def __init__(
        self, cfg: Any, manager: Any, on_allreduce: Callable[[], None], wait_quorum: Callable[[], None]
    ) -> None:
        job = cfg.job
        self.spec = model_spec(cfg.model, int(job.seed))
        self.model = self.spec.reference_model()
        self.params = list(self.model.parameters())  # a tied weight is one parameter, counted once
        self.optimizer = _adamw(self.params, job)
        self.wait_quorum = wait_quorum
        self.ddp = _ddp_class()(manager, self.model, on_allreduce)

    def train(self, load: Load, microbatches: Sequence[int], scale: float, phase: Phase) -> float:
        """Forward and backward of ``microbatches``; the last backward reduces over the quorum. A
        participant with no share backpropagates one microbatch at weight 0, so that its hooks
        reduce zeros with the others."""
        loss_sum = 0.0
        work = list(microbatches) or [0]
        weight = scale if microbatches else 0.0
        phase("forward")
        for index, mb in enumerate(work):
            last = index == len(work) - 1
            inputs, targets = load(mb)
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                loss = self.spec.loss(self.ddp(inputs), targets)
                if index == 0:
                    phase("backward")
                if last:
                    self.wait_quorum()  # where DDP's hook would wait for it: the caller times it
                (loss * weight).backward()
            if microbatches:
                loss_sum += float(loss.detach())
        return loss_sum

    def finish_gradients(self, phase: Phase) -> None:
        """Nothing left: DDP's hooks reduced during the last backward."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, max_norm: float, lr: float) -> None:
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def layers(self) -> dict[int, nn.Module]:
        return dict(enumerate(self.model))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def close(self) -> None:
        pass


class PipelineStage:
    """This node's stage of a replica group of several nodes (module docstring)."""

    def __init__(
        self,
        cfg: Any,
        manager: Any,
        layers: range,
        group_rank: int,
        group_size: int,
        group_store: Any,
        pg_timeout_s: float,
        wait_quorum: Callable[[], None],
        cross_replica_bound_s: float,
    ) -> None:
        job = cfg.job
        self.spec = model_spec(cfg.model, int(job.seed))
        self.indices = layers
        self.modules = {i: self.spec.build_layer(i, None, True) for i in layers}
        self.params = [p for i in layers for p in self.modules[i].parameters()]
        self.optimizer = _adamw(self.params, job)
        self.manager = manager
        self.wait_quorum = wait_quorum
        self.rank, self.size = group_rank, group_size
        self.reports_steps = group_rank == group_size - 1
        self.timeout = timedelta(seconds=pg_timeout_s)
        self.pg: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("torchft/pipeline", group_store), group_rank, group_size, self.timeout
        )
        # The group's collectives after the quorum and the cross-replica all-reduce (the tied
        # weight's sum, the gradient norm) wait for peers that may each still be inside those for
        # up to ``cross_replica_bound_s`` when another replica group fails: a lost peer replica is
        # torchft's to handle (a failed vote), not a reason for this group to break. A peer of this
        # group that dies meanwhile is still seen at once (its sockets close) or by the harness's
        # heartbeats (PeerWatch).
        self.after_reduce_timeout = timedelta(seconds=pg_timeout_s + cross_replica_bound_s)
        self.after_reduce_pg: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("torchft/after_reduce", group_store), group_rank, group_size, self.after_reduce_timeout
        )
        # The tied weight's two copies (embedding on the first stage, head on the last) are summed
        # over a group of those two stages.
        tied = {i: name for i, name in self.spec.tied_names.items()}
        self.tied_param: nn.Parameter | None = None
        self.tied_pg: Any = None
        self.skip_in_norm: nn.Parameter | None = None  # the second copy: counted once in the norm
        if tied and group_size > 1:
            first, last = min(tied), max(tied)
            ends = {0: first, group_size - 1: last}
            if group_rank in ends and ends[group_rank] in self.modules:
                self.tied_param = self.modules[ends[group_rank]].get_parameter(tied[ends[group_rank]])
                pair_rank = 0 if group_rank == 0 else 1
                self.tied_pg = dist.ProcessGroupGloo(
                    dist.PrefixStore("torchft/tied", group_store), pair_rank, 2, self.after_reduce_timeout
                )
                if group_rank == group_size - 1:
                    self.skip_in_norm = self.tied_param

    # ------------------------------------------------------------------ the pipeline
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.indices:
            x = self.modules[i](x)
        return x

    def _wait(self, work: Any, what: str, timeout: timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout)
        except Exception as error:  # gloo: the peer died (reset) or never answered (timeout)
            raise GroupLost(f"{what}: {error}") from None

    def _recv(self, rows: int, src: int, tag: int, what: str) -> torch.Tensor:
        buffer = torch.empty(self.spec.boundary_shape(self.indices[0] - 1, rows), dtype=self.spec.boundary_dtype)
        self._wait(self.pg.recv([buffer], src, tag), what)
        return buffer

    def train(self, load: Load, microbatches: Sequence[int], scale: float, phase: Phase) -> float:
        first, last = self.rank == 0, self.rank == self.size - 1
        micro = None
        kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        sends: list[Any] = []
        loss_sum = 0.0
        phase("forward")
        for tag, mb in enumerate(microbatches):
            inputs, targets = load(mb)
            micro = inputs.shape[0]
            x = inputs if first else self._recv(micro, self.rank - 1, tag, "receiving an activation").requires_grad_()
            out = self._forward(x)
            if last:
                if tag == 0:
                    phase("backward")
                loss = self.spec.loss(out, targets)
                (loss * scale).backward()
                loss_sum += float(loss.detach())
                if not first:
                    sends.append(self.pg.send([_input_grad(x)], self.rank - 1, tag))
            else:
                sends.append(self.pg.send([out.detach().contiguous()], self.rank + 1, tag))
                kept.append((None if first else x, out))
        if not last:
            phase("backward")
            for tag, (kept_x, out) in enumerate(kept):
                grad = self._recv(out.shape[0], self.rank + 1, tag, "receiving a gradient")
                out.backward(grad)
                if kept_x is not None:
                    sends.append(self.pg.send([_input_grad(kept_x)], self.rank - 1, tag))
        for work in sends:
            self._wait(work, "sending to the next stage")
        return loss_sum

    def finish_gradients(self, phase: Phase) -> None:
        """Average the stage over the quorum (one bucket), then sum the tied weight's copies."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.wait_quorum()
        phase("allreduce")
        self.manager.allreduce(flat).wait()
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if self.tied_pg is not None and self.tied_param is not None:
            self._wait(
                self.tied_pg.allreduce([self.tied_param.grad]),
                "summing the tied weight's gradient",
                self.after_reduce_timeout,
            )

    def grad_norm(self) -> float:
        total = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and p is not self.skip_in_norm:
                total += p.grad.detach().double().pow(2).sum()
        self._wait(
            self.after_reduce_pg.allreduce([total]),
            "summing the gradient norm over the group",
            self.after_reduce_timeout,
        )
        return float(total.sqrt())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, max_norm: float, lr: float) -> None:
        """``clip_grad_norm_``'s scaling (max/(norm+1e-6), at most 1) with the group's norm, then AdamW."""
        if max_norm > 0:
            coefficient = max_norm / (self.grad_norm() + 1e-6)
            if coefficient < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coefficient)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def layers(self) -> dict[int, nn.Module]:
        return dict(self.modules)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {str(i): m.state_dict() for i, m in self.modules.items()},
            "optim": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, module in self.modules.items():
            module.load_state_dict(state["model"][str(i)])
        self.optimizer.load_state_dict(state["optim"])

    def close(self) -> None:
        pass


def _input_grad(x: torch.Tensor) -> torch.Tensor:
    """The gradient backward left on a received activation, to send back to the previous stage."""
    assert x.grad is not None, "backward did not reach the stage's input"
    return x.grad.contiguous()
