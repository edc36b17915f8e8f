"""Planner inputs: a model's per-layer profile and the cluster it runs on.

A ``ModelProfile`` is what the profiler measures (or the analytic model predicts) for one
microbatch size on one device type. Profiles are saved as JSON with a schema version; loading
validates every field and raises ``ProfileError`` naming the file, the layer and the field.
This module imports no torch: profiles are produced elsewhere and consumed by the planner and
the simulator.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oobleck.errors import ConfigError, ProfileError

PROFILE_SCHEMA_VERSION = 1
GB = 1e9
# Limits of physically meaningful inputs: beyond them a value is a typo, not a model or a cluster.
# The planner computes in float64, which counts bytes exactly up to 2**53 (9 PB).
MAX_BYTES = 2**53
# A link slower than one byte per second (1e-9 GB/s) moves nothing a training run could use.
MIN_BANDWIDTH_BYTES_PER_S = 1.0
# No layer takes a day for one microbatch on any device a profile could have measured.
MAX_LAYER_SECONDS = 86_400.0


# Backward for inputs and backward for weights each take half of a layer's backward when a
# profile does not give them: every matrix product of the forward pass has two of equal FLOPs in
# the backward, one for the input gradient and one for the weight gradient (Qi et al., "Zero Bubble
# Pipeline Parallelism", ICLR'24, Table 1: a transformer layer's input backward 24bsh^2 + 8bs^2h
# FLOPs, weight backward 24bsh^2: half each where the hidden size h dominates the sequence s).
# oobleck/profiling/analytic.py derives both from each layer kind's FLOPs instead.
DEFAULT_BACKWARD_INPUT_FRACTION = 0.5


@dataclass(frozen=True)
class LayerProfile:
    """One layer for one microbatch on one device: times in seconds, sizes in bytes.

    ``backward_input_s`` and ``backward_weight_s`` are the two halves of a split backward pass
    (the gradient of the layer's input; then of its weights), as zero-bubble and ReCycle-style
    schedules run it; None (a profile that does not give them) means ``backward_s`` split by
    ``DEFAULT_BACKWARD_INPUT_FRACTION``, which ``backward_split`` applies.
    """

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int  # parameters only (fp32: 4 bytes per parameter)
    activation_bytes: int  # kept from forward until backward, per microbatch
    output_bytes: int  # the boundary tensor sent to the next stage, per microbatch
    # None when not measured: ``backward_split`` applies the default split. The first layer's
    # input pass is 0 (token ids take no gradient).
    backward_input_s: float | None = None
    backward_weight_s: float | None = None

    @property
    def params(self) -> int:
        return self.param_bytes // 4

    @property
    def backward_split(self) -> tuple[float, float]:
        """(backward for inputs, backward for weights) seconds: the profile's, or the default split."""
        inputs, weights = self.backward_input_s, self.backward_weight_s
        if inputs is None:  # the default split, or (only the weight half given) the rest
            inputs = (
                self.backward_s * DEFAULT_BACKWARD_INPUT_FRACTION
                if weights is None
                else max(0.0, self.backward_s - weights)
            )
        if weights is None:
            weights = max(0.0, self.backward_s - inputs)
        return float(inputs), float(weights)


# LayerProfile fields a profile file may leave out (written before they existed, or not measured).
OPTIONAL_LAYER_FIELDS = ("backward_input_s", "backward_weight_s")


@dataclass(frozen=True)
class AllReduceSample:
    """A measured all-reduce: ``seconds`` to reduce ``nbytes`` over ``group_size`` ranks."""

    group_size: int
    nbytes: int
    seconds: float
    scope: str = "cross_node"  # in_node | cross_node


@dataclass(frozen=True)
class ModelProfile:
    model: str
    microbatch_size: int
    device: str  # e.g. "cpu", "cuda:NVIDIA H200", "analytic:A100-40GB"
    layers: tuple[LayerProfile, ...]
    source: str = "synthetic"  # measured | analytic | synthetic
    # Pairs of layer indices that share one parameter tensor (tied embedding and LM head).
    tied_layers: tuple[tuple[int, int], ...] = ()
    allreduce: tuple[AllReduceSample, ...] = ()
    cache_key: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_profile(self)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema_version"] = PROFILE_SCHEMA_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "profile") -> ModelProfile:
        if not isinstance(data, dict):
            raise ProfileError(f"{origin}: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise ProfileError(
                f"{origin}: schema_version={version!r}, this version reads {PROFILE_SCHEMA_VERSION}; "
                "re-create it with python -m oobleck.profile"
            )
        try:
            layers = tuple(
                LayerProfile(
                    **{
                        k: layer[k]
                        for k in LayerProfile.__dataclass_fields__
                        if k in layer or k not in OPTIONAL_LAYER_FIELDS
                    }
                )
                for layer in data["layers"]
            )
            allreduce = tuple(AllReduceSample(**sample) for sample in data.get("allreduce", ()))
            return cls(
                model=data["model"],
                microbatch_size=data["microbatch_size"],
                device=data["device"],
                layers=layers,
                source=data.get("source", "measured"),
                tied_layers=tuple(tuple(pair) for pair in data.get("tied_layers", ())),  # type: ignore[misc]
                allreduce=allreduce,
                cache_key=data.get("cache_key", ""),
                metadata=dict(data.get("metadata", {})),
            )
        except ProfileError as error:
            raise ProfileError(f"{origin}: {error}") from None
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileError(f"{origin}: missing or malformed field ({error!r}); re-create the profile") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        path = Path(path)
        if path.is_dir():
            raise ProfileError(
                f"profile path {path} is a directory; give the profile JSON file written by python -m oobleck.profile"
            )
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist; write one with python -m oobleck.profile")
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ProfileError(
                f"{path}: not UTF-8 text (byte {error.start}), so not a profile JSON; re-create it with python -m oobleck.profile"
            ) from None
        except json.JSONDecodeError as error:
            raise ProfileError(
                f"{path}: not valid JSON ({error}); re-create it with python -m oobleck.profile"
            ) from None
        except OSError as error:
            raise ProfileError(
                f"{path}: cannot be read ({error.strerror}); check the file and its permissions"
            ) from None
        return cls.from_dict(data, origin=str(path))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON true is not 1.0 s


def validate_profile(profile: ModelProfile) -> None:
    if not profile.layers:
        raise ProfileError(f"profile of {profile.model!r} has no layers")
    if (
        not isinstance(profile.microbatch_size, int)
        or isinstance(profile.microbatch_size, bool)
        or profile.microbatch_size <= 0
    ):
        raise ProfileError(f"microbatch_size={profile.microbatch_size!r} must be a positive integer")
    for index, layer in enumerate(profile.layers):
        for name in ("forward_s", "backward_s"):
            value = getattr(layer, name)
            if not _is_number(value) or not math.isfinite(value) or not 0 < value <= MAX_LAYER_SECONDS:
                raise ProfileError(
                    f"layer {index} ({layer.name}): {name}={value!r} must be a positive number of seconds "
                    f"(at most {MAX_LAYER_SECONDS:.0f}); re-create the profile"
                )
        for name in OPTIONAL_LAYER_FIELDS:
            value = getattr(layer, name)
            if value is not None and (
                not _is_number(value) or not math.isfinite(value) or not 0 <= value <= MAX_LAYER_SECONDS
            ):
                raise ProfileError(
                    f"layer {index} ({layer.name}): {name}={value!r} must be a non-negative number of seconds "
                    f"(at most {MAX_LAYER_SECONDS:.0f}) or null (half of backward_s); re-create the profile"
                )
        for name in ("param_bytes", "activation_bytes", "output_bytes"):
            value = getattr(layer, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BYTES:
                raise ProfileError(
                    f"layer {index} ({layer.name}): {name}={value!r} must be a non-negative integer of at most "
                    f"2**53 bytes; re-create the profile"
                )
    for pair in profile.tied_layers:
        if len(pair) != 2 or not all(0 <= i < len(profile.layers) for i in pair):
            raise ProfileError(f"tied_layers entry {pair} must name two layer indices in 0..{len(profile.layers) - 1}")


@dataclass(frozen=True)
class ClusterSpec:
    """The hardware the planner plans for. Bandwidths in bytes/s, memory in bytes per device."""

    nodes: int
    gpus_per_node: int
    device_memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    @classmethod
    def from_config(cls, cluster: Any) -> ClusterSpec:
        """Build from ``cfg.cluster`` (``ClusterConfig`` or its DictConfig); ``ConfigError`` names
        the first value no cluster can have (NaN, infinite, zero, or beyond the limits above)."""
        for key in ("nodes", "gpus_per_node"):
            value = getattr(cluster, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"cluster.{key}={value} must be a positive integer")
        memory = float(cluster.device_memory_gb)
        if not math.isfinite(memory) or not 0 < memory * GB <= MAX_BYTES:
            raise ConfigError(
                f"cluster.device_memory_gb={cluster.device_memory_gb} must be a finite number of GB in (0, {MAX_BYTES / GB:.0f}]"
            )
        for key in ("intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            value = float(getattr(cluster, key))
            if not math.isfinite(value) or value * GB < MIN_BANDWIDTH_BYTES_PER_S:
                raise ConfigError(
                    f"cluster.{key}={getattr(cluster, key)} must be a finite number of GB/s, at least "
                    f"{MIN_BANDWIDTH_BYTES_PER_S / GB:g} (one byte per second)"
                )
        return cls(
            nodes=int(cluster.nodes),
            gpus_per_node=int(cluster.gpus_per_node),
            device_memory_bytes=float(cluster.device_memory_gb) * GB,
            intra_node_bandwidth=float(cluster.intra_node_bandwidth_gbps) * GB,
            inter_node_bandwidth=float(cluster.inter_node_bandwidth_gbps) * GB,
        )
