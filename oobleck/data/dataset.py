"""Token datasets: the shipped text corpus (byte-level) and seeded synthetic tokens.

Sample ``i`` is a fixed window of ``seq_len + 1`` tokens: inputs are its first ``seq_len``
tokens and targets the same window shifted by one. For the corpus, window ``i`` starts at token
``i * seq_len`` of the byte stream (consecutive windows share one token); for synthetic data it
is drawn from a generator seeded by ``(job.seed, i)``. Either way a sample depends only on its
index, the seed and the config, never on which process asks for it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oobleck.errors import ConfigError

CORPUS_PATH = Path(__file__).resolve().parent / "corpus" / "python_reference.txt"
BYTE_VOCAB = 256
# Keeps the synthetic stream independent of the sampler's shuffles for the same seed.
_SYNTHETIC_STREAM = 1


@functools.lru_cache(maxsize=4)
def _read_bytes(path: str) -> torch.Tensor:
    data = Path(path).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def byte_tokenize(text: str) -> torch.Tensor:
    """The byte-level tokenizer: the UTF-8 bytes of ``text`` as token ids in 0..255."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def byte_detokenize(ids: torch.Tensor) -> str:
    return bytes(int(i) for i in ids.tolist()).decode("utf-8", errors="replace")


class TokenDataset:
    """Fixed windows of a token stream, or seeded random windows (``stream=None``)."""

    def __init__(
        self,
        name: str,
        seq_len: int,
        vocab_size: int,
        *,
        stream: torch.Tensor | None = None,
        num_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        if seq_len <= 0:
            raise ConfigError(f"model.seq_len={seq_len} must be > 0")
        self.name = name
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self._stream = stream
        if stream is not None:
            self._len = (len(stream) - 1) // seq_len
            if self._len <= 0:
                raise ConfigError(
                    f"dataset {name!r} has {len(stream)} tokens, too few for one window of "
                    f"model.seq_len={seq_len}+1; lower model.seq_len or set job.dataset=synthetic"
                )
        else:
            if num_samples is None or num_samples <= 0:
                raise ConfigError(f"job.synthetic_samples={num_samples} must be > 0")
            self._len = num_samples

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} is outside 0..{self._len - 1} of dataset {self.name!r}")
        if self._stream is not None:
            start = index * self.seq_len
            window = self._stream[start : start + self.seq_len + 1]
        else:
            rng = np.random.default_rng([self.seed, _SYNTHETIC_STREAM, index])
            window = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64))
        return window[:-1].clone(), window[1:].clone()


def corpus_dataset(seq_len: int, vocab_size: int, path: Path = CORPUS_PATH) -> TokenDataset:
    if vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is below the byte-level corpus vocabulary {BYTE_VOCAB}; "
            f"use model.vocab_size>={BYTE_VOCAB} or job.dataset=synthetic"
        )
    if not path.is_file():
        raise ConfigError(f"corpus file {path} is missing; reinstall the package or set job.dataset=synthetic")
    return TokenDataset(f"corpus:{path.name}", seq_len, vocab_size, stream=_read_bytes(str(path)))


def build_dataset(job_cfg: Any, model_cfg: Any) -> TokenDataset:
    """``job.dataset``: ``corpus`` (shipped text, byte-level) or ``synthetic`` (seeded by ``job.seed``)."""
    kind = job_cfg.dataset
    if kind == "corpus":
        return corpus_dataset(int(model_cfg.seq_len), int(model_cfg.vocab_size))
    if kind == "synthetic":
        return TokenDataset(
            "synthetic",
            int(model_cfg.seq_len),
            int(model_cfg.vocab_size),
            num_samples=int(job_cfg.synthetic_samples),
            seed=int(job_cfg.seed),
        )
    raise ConfigError(f"job.dataset={kind!r} is not one of corpus, synthetic; set job.dataset=<one of them>")


def collate(dataset: TokenDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the samples at ``indices`` into ``([b, T] inputs, [b, T] targets)``."""
    if not indices:
        raise ValueError("collate needs at least one sample index")
    inputs, targets = zip(*(dataset[i] for i in indices))
    return torch.stack(inputs), torch.stack(targets)
