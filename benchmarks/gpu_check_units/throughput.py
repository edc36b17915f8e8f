"""Steady samples/s of training through the runtime's executor against a plain PyTorch loop on the
same model, batches and optimizer, alternated in the same run (gpt3_medium on a GPU, gpt3_tiny on
a CPU); the ratio is executor / plain."""

from __future__ import annotations

import platform
import statistics
from typing import Any

import torch

from gpu_check_units.common import Settings, cuda_reason, free_device_memory, tf32_off, train_solo
from oobleck.config import load_model_config
from oobleck.runtime.reference import train_reference
from testing import tiny_config


def unit_throughput(s: Settings, context: dict[str, Any]) -> dict[str, Any]:
    cuda = cuda_reason() is None
    device, model = ("cuda", "gpt3_medium") if cuda else ("cpu", "gpt3_tiny")
    steps = s.throughput_warmup + s.throughput_steps
    cfg = tiny_config(
        **{
            "job.steps": steps,
            "job.global_batch_size": s.throughput_batch,
            "job.microbatch_size": s.throughput_microbatch,
            "job.dataset": "synthetic",
            "runtime.save_final_params": False,
        }
    )
    cfg.model = load_model_config(model)
    if cuda:
        tf32_off()

    def rate(ends: list[float]) -> float:
        # step k's time = end(k) - end(k-1): both sides sync at each microbatch's loss, the same way
        intervals = [b - a for a, b in zip(ends[s.throughput_warmup - 1 :], ends[s.throughput_warmup :])]
        return s.throughput_batch / statistics.median(intervals)

    rounds = []
    for _ in range(s.throughput_rounds):  # alternate the two sides against drift
        executor = rate(train_solo(cfg, device, steps, with_state=False).step_ends)
        free_device_memory(cuda)
        plain = rate(train_reference(cfg, device=device).step_ends)
        free_device_memory(cuda)
        rounds.append({"executor_samples_per_s": executor, "plain_samples_per_s": plain})
    executor = statistics.median(r["executor_samples_per_s"] for r in rounds)
    plain = statistics.median(r["plain_samples_per_s"] for r in rounds)
    return {
        "status": "ok",
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "model": model,
        "precision": "fp32 (TF32 off)" if cuda else "fp32",
        "global_batch_size": s.throughput_batch,
        "microbatch_size": s.throughput_microbatch,
        "warmup_steps": s.throughput_warmup,
        "measured_steps": s.throughput_steps,
        "executor_samples_per_s": executor,
        "plain_samples_per_s": plain,
        "ratio": executor / plain,
        "rounds": rounds,
    }
