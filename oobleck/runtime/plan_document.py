"""The plan document: what the controller publishes for every generation (``keys.plan(g)``).

One frozen, typed object, shared by the controller (which builds and publishes it) and the workers
(which read it, and act on nothing else of the generation): the execution plan, the
reconfiguration it follows from, the step to resume at, the checkpoint to load, the incarnation
of every node's workers, and who writes which layer of a checkpoint. Torch-free, like ``keys``.

The JSON is derived from the field types, so a field is one line here: a type (``int``, ``float``,
``str``, ``bool``, ``X | None``, ``tuple[...]``, ``dict[int | str, X]``, a nested frozen dataclass, or
a class with ``to_dict``/``from_dict`` such as ``ExecutionPlan``) and, for a document written
without it, a default. ``from_json`` validates what it reads: a document that is not JSON, lacks a
field without a default, has a field this version does not know, or holds a value of the wrong
type raises one ``PlanDocumentError`` naming the field and the value, never a ``KeyError`` deep
inside a worker.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oobleck.errors import RunError
from oobleck.planning.outputs import ExecutionPlan, ReconfigurationPlan, Worker


class PlanDocumentError(RunError):
    """A plan document that cannot be read: the message names the generation, the field and the value."""


@dataclass(frozen=True)
class CheckpointPlan:
    """What a generation's workers need to know about checkpoints."""

    dir: str  # where checkpoints of this run go (step-NNNNNNNN dirs)
    every_steps: int  # a checkpoint after every this many committed steps (0: only when asked)
    # layer -> the worker that writes its shard; named even without periodic checkpoints, since
    # one may be asked for at any step boundary (a planned restart, a signal before a time limit).
    writers: dict[int, Worker] = field(default_factory=dict)

    def layers_written_by(self, worker: Worker) -> list[int]:
        return sorted(layer for layer, writer in self.writers.items() if writer == worker)


@dataclass(frozen=True)
class PlanDocument:
    """Generation ``generation`` of the run (see the module docstring)."""

    generation: int
    plan: ExecutionPlan
    resume_step: int  # steps committed before this generation: its first step
    checkpoint: CheckpointPlan
    # The plan this one replaces and the layer copies between them (None: a start, a resume or a
    # restart, where every worker builds or loads its layers itself).
    reconfiguration: ReconfigurationPlan | None = None
    load_checkpoint: str | None = None  # a step dir every worker loads its layers from
    # node -> its workers' incarnation: a worker of an older incarnation was replaced by a restart.
    incarnations: dict[int, int] = field(default_factory=dict)
    # The kind of the decision this generation carries out (oobleck.strategy.Kind's value: start,
    # reconfigure, failover, reroute, restart, continue): a reroute's plan moves no layer state.
    decision: str = "start"

    def incarnation(self, node: int) -> int:
        return self.incarnations.get(node, 0)

    def to_json(self) -> str:
        return json.dumps(_encode(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PlanDocument:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise PlanDocumentError(f"a plan document is not JSON ({error}): {_shown(text)}") from None
        where = f"plan/{data.get('generation', '?')}" if isinstance(data, dict) else "a plan document"
        return _decode(cls, data, where)


# ---------------------------------------------------------------------- the codec


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not hasattr(value, "to_dict"):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(key): _encode(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(kind: Any, data: Any, where: str) -> Any:
    """``data`` (parsed JSON) as a value of type ``kind``; ``where`` names it in errors."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, data, where)
    if isinstance(kind, type) and hasattr(kind, "from_dict"):
        if not isinstance(data, dict):
            raise _wrong(where, data, f"an object ({kind.__name__})")
        try:
            return kind.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            raise PlanDocumentError(f"{where} is not a valid {kind.__name__} ({error!r}): {_shown(data)}") from None
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _decode_dataclass(kind, data, where)
    if origin in (dict, Mapping):
        key_type, value_type = args
        if not isinstance(data, dict):
            raise _wrong(where, data, "an object")
        return {_key(key_type, k, where): _decode(value_type, v, f"{where}[{k}]") for k, v in data.items()}
    if origin is tuple:
        if not isinstance(data, list):
            raise _wrong(where, data, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(data))
        if len(data) != len(args):
            raise _wrong(where, data, f"a list of {len(args)}")
        return tuple(_decode(a, item, f"{where}[{i}]") for i, (a, item) in enumerate(zip(args, data)))
    if kind is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if kind in (int, str, bool) and type(data) is kind:
        return data
    raise _wrong(where, data, getattr(kind, "__name__", str(kind)))


def _decode_dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _wrong(where, data, f"an object ({cls.__name__})")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlanDocumentError(
            f"{where} has fields {unknown} that {cls.__name__} does not know (controller and worker of "
            f"different versions?); it knows {sorted(known)}"
        )
    types_ = _field_types(cls)
    values = {}
    for name, spec in known.items():
        if name in data:
            values[name] = _decode(types_[name], data[name], f"{where}.{name}")
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise PlanDocumentError(f"{where} has no field {name!r} ({cls.__name__} needs it): {_shown(data)}")
    return cls(**values)


def _key(kind: Any, key: str, where: str) -> Any:
    if kind is int:
        try:
            return int(key)
        except ValueError:
            raise _wrong(f"{where} key", key, "an integer") from None
    return key


def _wrong(where: str, value: Any, expected: str) -> PlanDocumentError:
    return PlanDocumentError(f"{where} must be {expected}, not {_shown(value)}")


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
