"""Single-process training of the same model on the same global batches: the truth to compare with.

Same layers (the model's ``ModelSpec.reference_model``, tied weights as one parameter), the spec's
loss, same sampler, loss scaled by 1/global batch, ``clip_grad_norm_`` and one ``torch.optim.AdamW`` with the same hyper-parameters and
learning-rate schedule as the runtime. Used by the exactness tests and the benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oobleck.data import GlobalBatchSampler, build_dataset, collate
from oobleck.models.spec import model_spec
from oobleck.runtime.state import learning_rate


@dataclass
class ReferenceResult:
    losses: list[float]  # mean loss of each step (what metrics.csv reports)
    layers: dict[int, dict[str, torch.Tensor]]  # final state_dict of each layer (on the CPU)
    # time.perf_counter() after each step's optimizer update (for throughput comparisons)
    step_ends: list[float] = field(default_factory=list)


def train_reference(
    cfg: Any,
    steps: int | None = None,
    *,
    device: str = "cpu",
    batches: Sequence[int] | None = None,
    microbatches: Sequence[Sequence[int]] | None = None,
) -> ReferenceResult:
    """Train on ``device`` (the truth is the CPU; a GPU run measures its kernels against it).

    Update k trains on the sampler's global batch of step ``batches[k]`` (default: k), with the
    learning rate of step k: the truth for a strategy that skips batches by design (torchft).
    ``microbatches[k]``, when given, lists the microbatches (of ``job.microbatch_size``) of that
    batch update k trains, repeats counting twice, and the loss is their mean: the truth for a
    strategy that trains part of a batch by design (torchft's replicas each on a fixed shard)."""
    job, model_cfg = cfg.job, cfg.model
    if batches is None:
        batches = range(int(job.steps) if steps is None else steps)
    batches = list(batches)[:steps]
    steps = len(batches)
    if int(cfg.cluster.torch_threads) > 0:
        torch.set_num_threads(int(cfg.cluster.torch_threads))  # as the workers do
    torch.manual_seed(int(job.seed))
    spec = model_spec(model_cfg, int(job.seed))
    model = spec.reference_model(device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=float(job.lr),
        betas=(float(job.beta1), float(job.beta2)),
        weight_decay=float(job.weight_decay),
    )
    dataset = build_dataset(job, model_cfg)
    batch, micro = int(job.global_batch_size), int(job.microbatch_size)
    sampler = GlobalBatchSampler(len(dataset), batch, int(job.seed))
    losses, step_ends = [], []
    for step in range(steps):
        total = 0.0
        trained = list(microbatches[step]) if microbatches is not None else list(range(batch // micro))
        samples = len(trained) * micro
        for mb in trained:
            inputs, targets = collate(dataset, sampler.microbatch_indices(batches[step], mb, micro))
            loss = spec.loss(model(inputs.to(device)), targets.to(device))
            (loss / samples).backward()
            total += float(loss.detach())
        if float(job.grad_clip) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(job.grad_clip))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(job, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / samples)
        step_ends.append(time.perf_counter())
    layers = {
        i: {k: v.detach().to("cpu", copy=True) for k, v in layer.state_dict().items()} for i, layer in enumerate(model)
    }
    return ReferenceResult(losses=losses, layers=layers, step_ends=step_ends)
