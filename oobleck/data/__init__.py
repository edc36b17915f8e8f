"""Datasets (shipped byte-level corpus, seeded synthetic tokens) and the step-indexed global
batch sampler the runtime uses to cut every global step into the same samples whatever the plan."""

from oobleck.data.dataset import (
    BYTE_VOCAB,
    CORPUS_PATH,
    TokenDataset,
    build_dataset,
    byte_detokenize,
    byte_tokenize,
    collate,
)
from oobleck.data.sampler import GlobalBatchSampler

__all__ = [
    "BYTE_VOCAB",
    "CORPUS_PATH",
    "GlobalBatchSampler",
    "TokenDataset",
    "build_dataset",
    "byte_detokenize",
    "byte_tokenize",
    "collate",
]
