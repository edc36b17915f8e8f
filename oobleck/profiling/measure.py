"""Measured per-layer profiles: a real forward and a real backward of every layer, one at a time.

Each layer is built alone from the model's ``ModelSpec`` (as a stage would build it) and run on a
microbatch shaped like the one it receives in a pipeline: token ids for the first layer, the
boundary activation (``ModelSpec.boundary_shape``) that requires grad for the others (so backward
also computes the input gradient a stage sends upstream). The last layer's forward includes the
loss and its backward starts from it, as on the last stage. Times are medians over ``repeats``
after ``warmup`` runs; on CUDA each phase is synchronised.

Each run is measured twice: with one fused backward (``backward_s``, what 1F1B runs), and with the
backward split into its input pass and its weight pass (``backward_input_s``,
``backward_weight_s``: what zero-bubble schedules run apart), by torch's own split-backward helpers
(``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``, which
its zero-bubble schedules use: the input pass keeps the gradients of the intermediates the weights
need, the weight pass starts from them). The first layer's input is token ids, which take no
gradient: its input pass is empty (0 s) and its weight pass is its whole backward. The helpers
walk the autograd graph in Python on every call, which on layers as small as the tiny models'
costs more than the passes themselves (split > fused there); on layers of GPU size it does not.
The two passes are taken as fractions of the fused backward measured in the same repeat (the
fused and the split backward of one repeat run back to back, so a burst of other load that slows
one repeat moves both), the median fraction of each times the median fused backward; with
``split_backward_max_ratio`` (``profile.split_backward_max_ratio``) their sum is clamped to that
multiple of the fused backward (both scaled alike): on a loaded host a median of 5 split runs
still came out up to 15x the fused backward, which made every re-routed and zero-bubble plan look
that much slower at operation level (``oobleck.schedules.cost``). ``split_backward_passes`` does
this and is tested on its own.

Memory: ``param_bytes`` from the parameters; ``activation_bytes`` = the bytes autograd saves for
backward during one forward (captured with saved-tensor hooks, parameters excluded, each storage
counted once), which is what a pipeline stage keeps per in-flight microbatch; ``output_bytes`` =
the boundary tensor sent to the next stage (0 for the last layer, which sends nothing).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from oobleck.errors import ProfileError
from oobleck.models.spec import ModelSpec, model_spec
from oobleck.planning.inputs import LayerProfile, ModelProfile


def device_label(device: torch.device) -> str:
    """``cpu`` or ``cuda:<device name>``: what a profile was measured on (part of the cache key)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _saved_bytes(run: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[torch.Tensor, int]:
    """Run ``run()`` and count the bytes of distinct tensors autograd saved for backward."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.device.type != "meta" and tensor.numel():
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if key[0] not in exclude and key not in seen:
                seen.add(key)
                total += key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, total


def _split_backward(out: torch.Tensor, grad_out: torch.Tensor | None, x: torch.Tensor | None, layer: Any) -> Any:
    """The input pass of a split backward; returns the weight pass to run next (a callable)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    if x is None:  # token ids: no input gradient, the weight pass is the whole backward
        return lambda: out.backward(grad_out)
    params = list(layer.parameters())
    _, groups = stage_backward_input([out], None if grad_out is None else [grad_out], [x], iter(params))
    return lambda: stage_backward_weight(iter(params), groups)


def split_backward_passes(
    backward: list[float], inputs: list[float], weights: list[float], max_ratio: float | None = None
) -> tuple[float, float]:
    """(input pass, weight pass) seconds from per-repeat measurements: each repeat's passes as
    fractions of the same repeat's fused ``backward``, the median fraction of each times the
    median fused backward, their sum clamped to ``max_ratio`` times the fused backward (both
    scaled alike; None: no clamp). A repeat whose fused backward took no measurable time is
    left out."""
    if not (len(backward) == len(inputs) == len(weights)) or not backward:
        raise ProfileError(
            f"split backward: {len(backward)} fused, {len(inputs)} input and {len(weights)} weight "
            "timings; every repeat measures all three"
        )
    if max_ratio is not None and not max_ratio > 0:
        raise ProfileError(f"profile.split_backward_max_ratio={max_ratio} must be > 0 (or null: no bound)")
    fused = statistics.median(backward)
    paired = [(i / b, w / b) for b, i, w in zip(backward, inputs, weights) if b > 0]
    if not paired or fused <= 0:
        return statistics.median(inputs), statistics.median(weights)
    input_fraction = statistics.median(p[0] for p in paired)
    weight_fraction = statistics.median(p[1] for p in paired)
    total = input_fraction + weight_fraction
    if max_ratio is not None and total > max_ratio:
        input_fraction, weight_fraction = (f * max_ratio / total for f in (input_fraction, weight_fraction))
    return input_fraction * fused, weight_fraction * fused


def measure_layer(
    spec: ModelSpec,
    index: int,
    microbatch_size: int,
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    seed: int,
    split_backward_max_ratio: float | None = None,
) -> LayerProfile:
    """Forward, backward (fused, and split into input and weight passes) seconds, parameter,
    activation and boundary bytes of layer ``index`` of ``spec``."""
    arch = spec.architecture
    last = arch.num_layers - 1
    layer = spec.build_layer(index, str(device), True)
    layer.train()
    generator = torch.Generator(device="cpu").manual_seed(seed + index)
    tokens = (microbatch_size, arch.seq_len)
    ids = torch.randint(0, arch.vocab_size, tokens, generator=generator).to(device)
    targets = torch.randint(0, arch.vocab_size, tokens, generator=generator).to(device)
    hidden = None
    if index > 0:
        shape = spec.boundary_shape(index - 1, microbatch_size)
        hidden = torch.randn(*shape, generator=generator).to(device=device, dtype=spec.boundary_dtype)
    sync = _sync(device)
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden is None:
            return layer(ids), None
        x = hidden.detach().requires_grad_(True)
        out = layer(x)
        return (spec.loss(out, targets) if index == last else out), x

    out, activation_bytes = _saved_bytes(lambda: forward()[0], param_ptrs)
    output_bytes = 0 if index == last else out.numel() * out.element_size()
    grad_out = None if index == last else torch.randn_like(out)
    del out

    times: dict[str, list[float]] = {"forward": [], "backward": [], "input": [], "weight": []}
    for attempt in range(warmup + repeats):
        for split in (False, True):
            layer.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            out, x = forward()
            sync()
            middle = time.perf_counter()
            if split:
                weight_pass = _split_backward(out, grad_out, x, layer)
                sync()
                between = time.perf_counter()
                weight_pass()
                sync()
                end = time.perf_counter()
                passes = {"input": (between - middle) if x is not None else 0.0, "weight": end - between}
            else:
                out.backward(grad_out)
                sync()
                end = time.perf_counter()
                passes = {"backward": end - middle}
            if attempt >= warmup:
                times["forward"].append(middle - start)
                for kind, seconds in passes.items():
                    times[kind].append(seconds)
            del out, x
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    backward_input, backward_weight = split_backward_passes(
        times["backward"], times["input"], times["weight"], split_backward_max_ratio
    )
    return LayerProfile(
        name=arch.layer_names[index],
        forward_s=statistics.median(times["forward"]),
        backward_s=statistics.median(times["backward"]),
        param_bytes=int(param_bytes),
        activation_bytes=int(activation_bytes),
        output_bytes=int(output_bytes),
        backward_input_s=backward_input,
        backward_weight_s=backward_weight,
    )


def measure_profile(
    model_cfg: Any,
    microbatch_size: int,
    device: torch.device | str,
    *,
    warmup: int,
    repeats: int,
    seed: int,
    threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    split_backward_max_ratio: float | None = None,
) -> ModelProfile:
    """Measure every layer of ``model_cfg`` for one microbatch on ``device``.

    ``threads`` (if > 0) sets torch's intra-op threads while measuring, to match the workers
    (``cluster.torch_threads``). ``progress(done, total)`` is called after each layer.
    ``split_backward_max_ratio``: the bound on the split backward's passes (module docstring).
    """
    if repeats <= 0 or warmup < 0:
        raise ProfileError(f"profile.repeats={repeats} must be > 0 and profile.warmup={warmup} >= 0")
    if microbatch_size <= 0:
        raise ProfileError(f"job.microbatch_size={microbatch_size} must be > 0")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            "cluster.device=cuda but CUDA is not available here; use cluster.device=cpu or profile.source=analytic"
        )
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    spec = model_spec(model_cfg, seed)
    try:
        total = spec.num_layers
        layers = []
        for index in range(total):
            layers.append(
                measure_layer(
                    spec,
                    index,
                    microbatch_size,
                    device,
                    warmup=warmup,
                    repeats=repeats,
                    seed=seed,
                    split_backward_max_ratio=split_backward_max_ratio,
                )
            )
            if progress is not None:
                progress(index + 1, total)
    finally:
        torch.set_num_threads(previous_threads)
    return ModelProfile(
        model=spec.name,
        microbatch_size=int(microbatch_size),
        device=device_label(device),
        layers=tuple(layers),
        source="measured",
        tied_layers=spec.architecture.tied_pairs,
        metadata={
            "torch": torch.__version__,
            "threads": threads or previous_threads,
            "warmup": warmup,
            "repeats": repeats,
            "split_backward_max_ratio": split_backward_max_ratio,
            "host": platform.node(),
            "profiling_seconds": time.perf_counter() - started,
        },
    )
