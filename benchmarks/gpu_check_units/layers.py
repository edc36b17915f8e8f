"""Per-layer forward and backward (fused, and split into its input and weight passes) measured on
the device against the analytic profile, by layer type and microbatch size.

On a GPU: gpt2_medium, gpt3_medium and llama3_8b (one block each: every block of a model is the
same layer) in fp32 with TF32 off (how the harness trains) and under bf16 autocast (what the
analytic profiles of ``conf/gpu/`` assume), against the analytic profile of the ``conf/gpu/``
entry of this GPU. The achieved fraction of a pass is its FLOPs (the family's count,
``Architecture.layer_cost``) over the seconds measured, divided by the GPU's dense peak; the
fraction that makes the analytic compute time of the compute-bound layers equal the measured
time is ``sum FLOPs / (peak * sum seconds)`` over them. On a CPU (the rehearsal) the same runs
on the tiny models, with the rate a dense matrix product reaches on this CPU as the "peak".
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from gpu_check_units.common import Settings, cuda_reason, free_device_memory, tf32_off
from oobleck.config import load_model_config
from oobleck.models import architecture
from oobleck.profiling import analytic_profile, gpu_names, load_gpu_config, measure_profile
from oobleck.profiling.analytic import compute_bound
from oobleck.profiling.feasibility import matmul_flop_rate

TFLOP = 1e12
COPY_PROBE_BYTES = 64 << 20
COPY_PROBE_RUNS = 5
PASSES = ("forward", "backward", "backward_input", "backward_weight")


def gpu_config_for(device_name: str) -> tuple[str, Any]:
    """The ``conf/gpu/`` entry of the device called ``device_name`` (``h200`` when none matches)."""
    simple = device_name.lower().replace("nvidia", "").replace(" ", "").replace("-", "")
    for name in gpu_names():
        gpu = load_gpu_config(name)
        if str(gpu.name).lower().replace("-", "").replace(" ", "") in simple:
            return name, gpu
    return "h200", load_gpu_config("h200")


def cpu_device_config() -> Any:
    """This CPU as a ``cluster.gpu`` entry: its probed fp32 matrix-product rate and copy bandwidth as
    the peaks, fractions 1, fp32 activations (what the CPU rehearsal profiles against)."""
    from omegaconf import OmegaConf

    source = torch.empty(COPY_PROBE_BYTES // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(COPY_PROBE_RUNS):
        target.copy_(source)
    bandwidth = 2 * COPY_PROBE_BYTES * COPY_PROBE_RUNS / (time.perf_counter() - start)  # read + write
    return OmegaConf.create(
        {
            "name": "cpu",
            "peak_tflops": matmul_flop_rate(torch.device("cpu"), 1) / TFLOP,
            "memory_gb": 0.0,
            "memory_bandwidth_gbps": bandwidth / 1e9,
            "achieved_flop_fraction": 1.0,
            "achieved_bandwidth_fraction": 1.0,
            "activation_bytes_per_value": 4,
        }
    )


def pass_flops(cost: Any) -> dict[str, float]:
    return {
        "forward": cost.forward_flops,
        "backward": cost.backward_flops,
        "backward_input": cost.backward_input_flops,
        "backward_weight": cost.backward_weight_flops,
    }


def rate(flops: float, seconds: float | None, unit: float) -> float | None:
    """FLOPs per second in ``unit``s; None for a pass that did no work or was not timed."""
    return flops / seconds / unit if seconds and flops else None


def measured_seconds(layer: Any) -> dict[str, float | None]:
    return {
        "forward": layer.forward_s,
        "backward": layer.backward_s,
        "backward_input": layer.backward_input_s,
        "backward_weight": layer.backward_weight_s,
    }


def compare(model_cfg: Any, gpu_cfg: Any, peak_flops: float, measured: Any, analytic: Any) -> dict[str, Any]:
    """Per layer: measured and analytic seconds, achieved TFLOP/s and fraction of ``peak_flops`` per
    pass, the analytic bound; and the achieved_flop_fraction the compute-bound layers imply.

    A layer the analytic model finds compute-bound takes ``(F_fwd + F_bwd) / (peak * fraction)``
    for forward plus backward, so the fraction that reproduces a measured time ``t`` is
    ``(F_fwd + F_bwd) / (peak * t)``; over several layers, ``sum F / (peak * sum t)``.
    """
    arch = architecture(model_cfg)
    width = int(gpu_cfg.activation_bytes_per_value)
    rows, work, seconds = [], 0.0, 0.0
    for index, (m, a) in enumerate(zip(measured.layers, analytic.layers, strict=True)):
        cost = arch.layer_cost(index, measured.microbatch_size, width)
        flops, times = pass_flops(cost), measured_seconds(m)
        bound = compute_bound(cost, gpu_cfg) and cost.kind != "embedding"
        measured_s, analytic_s = m.forward_s + m.backward_s, a.forward_s + a.backward_s
        row: dict[str, Any] = {
            "layer": m.name,
            "kind": cost.kind,
            "analytic_bound": "compute" if bound else "memory",
            "measured_s": times,
            "analytic_s": {"forward": a.forward_s, "backward": a.backward_s},
            "ratio": measured_s / analytic_s,
            "achieved_tflops": {p: rate(flops[p], times[p], TFLOP) for p in PASSES},
            "fraction_of_peak": {p: rate(flops[p], times[p], peak_flops) for p in PASSES},
            "implied_flop_fraction": (flops["forward"] + flops["backward"]) / (peak_flops * measured_s)
            if bound
            else None,
        }
        if bound:
            work, seconds = work + flops["forward"] + flops["backward"], seconds + measured_s
        rows.append(row)
    return {
        "layers": rows,
        "by_kind": {
            kind: {
                p: statistics.median(r["fraction_of_peak"][p] for r in rows if r["kind"] == kind)
                if all(r["fraction_of_peak"][p] is not None for r in rows if r["kind"] == kind)
                else None
                for p in PASSES
            }
            for kind in sorted({r["kind"] for r in rows})
        },
        "total_ratio": sum(m.forward_s + m.backward_s for m in measured.layers)
        / sum(a.forward_s + a.backward_s for a in analytic.layers),
        "implied_flop_fraction": work / (peak_flops * seconds) if seconds else None,
        "configured_flop_fraction": float(gpu_cfg.achieved_flop_fraction),
    }


@contextlib.contextmanager
def precision(name: str, device: str) -> Iterator[None]:
    if device == "cuda":
        tf32_off()
    if name == "bf16_autocast":
        with torch.autocast(device, dtype=torch.bfloat16):
            yield
    else:
        yield


def unit_layers(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    cuda = cuda_reason() is None
    device = "cuda" if cuda else "cpu"
    if cuda:
        conf_name, gpu_cfg = gpu_config_for(torch.cuda.get_device_name())
        peak, peak_source = float(gpu_cfg.peak_tflops) * TFLOP, f"conf/gpu/{conf_name}.yaml peak_tflops (datasheet)"
        models, microbatches = s.profile_models, s.profile_microbatches
        precisions: tuple[str, ...] = ("fp32", "bf16_autocast")
    else:
        torch.set_num_threads(1)
        conf_name, gpu_cfg = "", cpu_device_config()
        peak = float(gpu_cfg.peak_tflops) * TFLOP
        peak_source = "the fp32 matrix-product rate this CPU reached on one thread (CPU rehearsal)"
        models, microbatches, precisions = s.cpu_profile_models, s.cpu_profile_microbatches, ("fp32",)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "analytic": f"conf/gpu/{conf_name}.yaml" if conf_name else "this CPU's probed rates (cpu_device_config)",
        "peak_tflops": peak / TFLOP,
        "peak_source": peak_source,
        "microbatch_sizes": list(microbatches),
        "warmup": s.profile_warmup,
        "repeats": s.profile_repeats,
        "models": {},
    }
    implied: dict[str, list[float]] = {kind: [] for kind in precisions}
    for name, overrides in models:
        model_cfg = load_model_config(name, **dict(overrides))
        entry: dict[str, Any] = {"overrides": dict(overrides)}
        for kind in precisions:
            entry[kind] = {}
            for b in microbatches:
                with precision(kind, device):
                    measured = measure_profile(
                        model_cfg, b, device, warmup=s.profile_warmup, repeats=s.profile_repeats, seed=0
                    )
                table = compare(model_cfg, gpu_cfg, peak, measured, analytic_profile(model_cfg, gpu_cfg, b))
                entry[kind][str(b)] = {"profiling_s": measured.metadata["profiling_seconds"], **table}
                if table["implied_flop_fraction"] is not None:
                    implied[kind].append(table["implied_flop_fraction"])
                free_device_memory(cuda)
        result["models"][name] = entry
    result["summary"] = {
        f"achieved_flop_fraction_{kind}": statistics.median(values) if values else None
        for kind, values in implied.items()
    }
    if not cuda:
        why = f"bf16 autocast and the GPU's models are measured on a GPU only: {cuda_reason()}"
        result["skipped_parts"] = {"summary.achieved_flop_fraction_bf16_autocast": why}
    return {"status": "ok", **result}
