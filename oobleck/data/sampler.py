"""The step-indexed global batch sampler: global step ``s`` always means the same sample indices.

The sample order is a sequence of epochs; epoch ``e`` is a permutation of all samples drawn from
``(seed, e)`` alone. Each epoch holds ``num_samples // global_batch_size`` whole batches (the
remainder is dropped so no step straddles two epochs or repeats a sample). Step ``s`` takes batch
``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``. Nothing depends on the plan, the
number of pipelines or any earlier step, so any process can start (or resume) at any step, and
splitting a step into microbatches only partitions its fixed list of indices.
"""

from __future__ import annotations

import numpy as np

from oobleck.errors import ConfigError

_SAMPLER_STREAM = 0  # see oobleck.data.dataset._SYNTHETIC_STREAM


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if global_batch_size <= 0:
            raise ConfigError(f"job.global_batch_size={global_batch_size} must be > 0")
        if num_samples < global_batch_size:
            raise ConfigError(
                f"job.global_batch_size={global_batch_size} exceeds the dataset's {num_samples} samples; "
                "lower the batch, shorten model.seq_len, or use job.dataset=synthetic with more job.synthetic_samples"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.steps_per_epoch = num_samples // global_batch_size
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # steps are usually asked for in order: keep the current epoch
            rng = np.random.default_rng([self.seed, _SAMPLER_STREAM, epoch])
            self._order = rng.permutation(self.num_samples)
            self._epoch = epoch
        return self._order

    def step_indices(self, step: int) -> list[int]:
        """The ``global_batch_size`` sample indices of global step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        order = self._permutation(self.epoch_of(step))
        start = (step % self.steps_per_epoch) * self.global_batch_size
        return [int(i) for i in order[start : start + self.global_batch_size]]

    def microbatch_indices(self, step: int, microbatch: int, microbatch_size: int) -> list[int]:
        """Indices of microbatch ``microbatch`` (0-based) when step ``step`` is cut into pieces of
        ``microbatch_size``; the pieces of one step partition ``step_indices(step)`` in order."""
        if microbatch_size <= 0 or self.global_batch_size % microbatch_size:
            raise ConfigError(
                f"job.microbatch_size={microbatch_size} must be > 0 and divide "
                f"job.global_batch_size={self.global_batch_size}"
            )
        count = self.global_batch_size // microbatch_size
        if not 0 <= microbatch < count:
            raise ValueError(f"microbatch={microbatch} is outside 0..{count - 1} for step {step}")
        return self.step_indices(step)[microbatch * microbatch_size : (microbatch + 1) * microbatch_size]
