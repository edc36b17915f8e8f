"""Measured per-layer profiles: a real forward and a real backward of every layer, one at a time.

Each layer is built alone (as a stage would build it) and run on a microbatch shaped like the one
it receives in a pipeline: token ids for the embedding, a ``[b, T, C]`` activation that requires
grad for the others (so backward also computes the input gradient a stage sends upstream). The
last layer's forward includes the loss and its backward starts from it, as on the last stage.
Times are medians over ``repeats`` after ``warmup`` runs; on CUDA each phase is synchronised.

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
from oobleck.models import build_layer, layer_name, loss_fn, num_layers, tied_parameters
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


def measure_layer(
    model_cfg: Any,
    index: int,
    microbatch_size: int,
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    seed: int,
) -> LayerProfile:
    """Forward and backward seconds, parameter, activation and boundary bytes of one layer."""
    last = num_layers(model_cfg) - 1
    layer = build_layer(model_cfg, index, seed, device=device)
    layer.train()
    generator = torch.Generator(device="cpu").manual_seed(seed + index)
    shape = (microbatch_size, model_cfg.seq_len)
    ids = torch.randint(0, model_cfg.vocab_size, shape, generator=generator).to(device)
    targets = torch.randint(0, model_cfg.vocab_size, shape, generator=generator).to(device)
    hidden = torch.randn(*shape, model_cfg.n_embd, generator=generator).to(device)
    sync = _sync(device)
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def forward() -> torch.Tensor:
        if index == 0:
            return layer(ids)
        x = hidden.detach().requires_grad_(True)
        out = layer(x)
        return loss_fn(out, targets) if index == last else out

    out, activation_bytes = _saved_bytes(forward, param_ptrs)
    output_bytes = 0 if index == last else out.numel() * out.element_size()
    grad_out = None if index == last else torch.randn_like(out)
    del out

    forward_times: list[float] = []
    backward_times: list[float] = []
    for attempt in range(warmup + repeats):
        layer.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        out = forward()
        sync()
        middle = time.perf_counter()
        out.backward(grad_out)
        sync()
        end = time.perf_counter()
        if attempt >= warmup:
            forward_times.append(middle - start)
            backward_times.append(end - middle)
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    return LayerProfile(
        name=layer_name(model_cfg, index),
        forward_s=statistics.median(forward_times),
        backward_s=statistics.median(backward_times),
        param_bytes=int(param_bytes),
        activation_bytes=int(activation_bytes),
        output_bytes=int(output_bytes),
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
) -> ModelProfile:
    """Measure every layer of ``model_cfg`` for one microbatch on ``device``.

    ``threads`` (if > 0) sets torch's intra-op threads while measuring, to match the workers
    (``cluster.torch_threads``). ``progress(done, total)`` is called after each layer.
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
    try:
        total = num_layers(model_cfg)
        layers = []
        for index in range(total):
            layers.append(
                measure_layer(model_cfg, index, microbatch_size, device, warmup=warmup, repeats=repeats, seed=seed)
            )
            if progress is not None:
                progress(index + 1, total)
    finally:
        torch.set_num_threads(previous_threads)
    return ModelProfile(
        model=str(model_cfg.name),
        microbatch_size=int(microbatch_size),
        device=device_label(device),
        layers=tuple(layers),
        source="measured",
        tied_layers=tuple(t.layers for t in tied_parameters(model_cfg)),
        metadata={
            "torch": torch.__version__,
            "threads": threads or previous_threads,
            "warmup": warmup,
            "repeats": repeats,
            "host": platform.node(),
            "profiling_seconds": time.perf_counter() - started,
        },
    )
