"""The operation IR: what one rank does in one training step, in order.

A schedule is, for every rank of a plan, an ordered tuple of ``Op``. The vocabulary mirrors
``torch.distributed.pipelining``'s action IR (``_ComputationType``: F, B, I, W, SEND_F, RECV_F,
SEND_B, RECV_B, REDUCE_GRAD, with the same short names), extended where our plans need more
than it can say:

- torch names a stage by its index and maps each stage to one rank; here a stage may be sharded
  over several devices of a node (each takes rows ``[lo, hi)`` of every microbatch) and a
  microbatch may leave its own pipeline (a re-routed stage runs on a peer pipeline's rank), so
  compute ops name the *layers* they run and the *rows*, and communication ops name the *peer
  rank* and the rows that cross;
- ``RF`` (redundant forward): Bamboo's forward pass of the layers of a shadow copy, thrown away
  (or, with ``keep``, kept with its autograd graph until the step ends, as Bamboo's eager mode
  keeps them for a failover);
- ``REDUCE_GRAD`` is not per stage within one pipeline group as torch's is: a rank's gradients
  are all-reduced per layer across every pipeline that holds the layer (``GradientReducer``). The
  op marks the point after which no op of the rank adds to a gradient; the B or W op with
  ``final`` set is the last one that does, during which the buckets of its layers are launched
  as their gradients become final (the overlap of reduction and backward).

Microbatch indices are the plan's global ones (``PipelineInstance.first_microbatch`` onwards), so
a step's ops name the same samples on every rank. Everything here is pure data (frozen
dataclasses of ints and strings) and round-trips through ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class OpKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients at once
    BACKWARD_INPUT = "I"  # the gradient of the stage's input only (the critical path)
    BACKWARD_WEIGHT = "W"  # the weight gradients of a microbatch whose I ran (may be deferred)
    REDUNDANT_FORWARD = "RF"
    SEND_F = "SEND_F"  # activations to the next stage (asynchronous)
    RECV_F = "RECV_F"  # activations from the previous stage (blocking)
    SEND_B = "SEND_B"  # the input gradient to the previous stage (asynchronous)
    RECV_B = "RECV_B"  # the output gradient from the next stage (blocking)
    REDUCE_GRAD = "REDUCE_GRAD"


COMPUTE = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT})
GRADIENT = frozenset({OpKind.BACKWARD, OpKind.BACKWARD_WEIGHT})  # ops that add to weight gradients
SENDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
RECEIVES = frozenset({OpKind.RECV_F, OpKind.RECV_B})


@dataclass(frozen=True)
class Op:
    """One operation of one rank.

    Compute ops (F, B, I, W, RF) run layers ``[start, end)`` on rows ``[lo, hi)`` of
    ``microbatch``. A send or receive moves rows ``[lo, hi)`` of ``microbatch`` to or from
    ``peer``; its ``start``/``end`` are the layers of the compute op on this side (a RECV_F feeds a
    forward of ``[start, end)``, so it carries the output of layer ``start - 1``; a RECV_B or
    SEND_F the output (gradient) of layer ``end - 1``; a SEND_B the gradient of layer ``start - 1``).
    """

    kind: OpKind
    microbatch: int = -1
    start: int = 0
    end: int = 0
    lo: int = 0
    hi: int = 0
    peer: int = -1
    final: bool = False  # B or W: the last op adding to this rank's gradients of [start, end)
    keep: bool = False  # RF: keep the output and its graph until the step ends

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE or self.kind is OpKind.REDUNDANT_FORWARD

    def __str__(self) -> str:
        kind = self.kind.value
        if self.kind is OpKind.REDUCE_GRAD:
            return kind
        where = f"[{self.start}:{self.end})"
        rows = f"r{self.lo}:{self.hi}"
        if self.kind in SENDS or self.kind in RECEIVES:
            return f"{kind}{self.microbatch}{where}{rows}@{self.peer}"
        flags = "*" if self.final else ""
        return f"{kind}{self.microbatch}{where}{rows}{flags}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "microbatch": self.microbatch,
            "start": self.start,
            "end": self.end,
            "lo": self.lo,
            "hi": self.hi,
            "peer": self.peer,
            "final": self.final,
            "keep": self.keep,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Op:
        return cls(**{**data, "kind": OpKind(data["kind"])})


@dataclass(frozen=True)
class Schedule:
    """Every rank's ops for one step of a plan (``ranks[r]`` is rank r's list), and how it was made."""

    ranks: tuple[tuple[Op, ...], ...]
    generator: str  # e.g. "1f1b", "bamboo-eager", "recycle"
    microbatch_size: int
    num_layers: int

    def of(self, rank: int) -> tuple[Op, ...]:
        return self.ranks[rank]

    def format(self, rank: int | None = None) -> str:
        """One line per rank (or the one asked for): its ops in order."""
        chosen = range(len(self.ranks)) if rank is None else [rank]
        return "\n".join(f"rank {r}: " + " ".join(str(op) for op in self.ranks[r]) for r in chosen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator,
            "microbatch_size": self.microbatch_size,
            "num_layers": self.num_layers,
            "ranks": [[op.to_dict() for op in ops] for ops in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        return cls(
            ranks=tuple(tuple(Op.from_dict(op) for op in ops) for ops in data["ranks"]),
            generator=str(data["generator"]),
            microbatch_size=int(data["microbatch_size"]),
            num_layers=int(data["num_layers"]),
        )
