"""Torch parts every family shares: seeded per-parameter initial values, building a layer without
paying torch's default initialisation, the language-model loss, and the ``ModelSpec`` of a
decoder laid out as ``oobleck.models.decoder`` says.

Initial weights depend only on ``(seed, layer index, parameter name)`` and the family's rule:
every parameter is drawn from its own ``torch.Generator`` seeded from those, on the CPU in fp32,
so any process that builds layer l gets the same bits whatever else it builds and on whichever
device it puts them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oobleck.errors import ConfigError
from oobleck.models.architecture import Architecture
from oobleck.models.spec import ModelSpec


def seeded_generator(seed: int, index: int, param: str) -> torch.Generator:
    """A CPU generator for parameter ``param`` of layer ``index`` under model seed ``seed``."""
    # A stable 63-bit seed per (model seed, layer, parameter): Python's hash() is salted per
    # process, so derive it with a fixed digest instead.
    digest = hashlib.sha256(f"oobleck-init:{seed}:{index}:{param}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def materialise(make: Callable[[], nn.Module], device: torch.device | str | None) -> nn.Module:
    """``make()`` built on the meta device, then given (uninitialised) memory on ``device``.

    The family's initialiser sets every parameter afterwards, so torch's own default
    initialisation (a second random fill of every weight, a large share of building an embedding
    of 50k x 768) would be thrown away; with ``initialise`` false a layer whose state is about to
    be overwritten (a copy, a checkpoint) never pays for values at all.
    """
    with torch.device("meta"):
        module = make()
    return module.to_empty(device=device if device is not None else "cpu")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed-over-samples language-model loss of a microbatch.

    Cross entropy summed over every token (``reduction="sum"``) and divided by the sequence
    length: the sum over samples of each sample's mean token loss. The runtime divides by the
    number of samples in the global batch, which makes the total exactly the usual mean token
    cross entropy of the global batch, however the batch is split into microbatches.
    """
    vocab = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


def decoder_spec(
    architecture: Architecture,
    make: Callable[[str], nn.Module],
    initialise: Callable[[nn.Module, int], None],
) -> ModelSpec:
    """The runtime's view of a decoder (``oobleck.models.decoder``'s layout): layer ``i`` is
    ``make(kind)`` for its kind (embedding, block or head), built without values
    (``materialise``) and then given them by ``initialise(module, i)``; every layer but the head
    hands the next the residual stream ``[rows, seq_len, width]`` in fp32; the loss is ``lm_loss``."""

    def build(index: int, device: str | None = None, initialise_values: bool = True) -> nn.Module:
        kinds = architecture.layer_kinds
        if not 0 <= index < len(kinds):
            raise ConfigError(f"layer index {index} is outside 0..{len(kinds) - 1} for model {architecture.name!r}")
        module = materialise(lambda: make(kinds[index]), device)
        if initialise_values:
            initialise(module, index)
        return module

    def boundary(index: int, rows: int) -> tuple[int, ...]:
        return (rows, architecture.seq_len, architecture.width)

    return ModelSpec(
        architecture=architecture,
        build_layer=build,
        initialise=initialise,
        loss=lm_loss,
        boundary_shape=boundary,
        boundary_dtype=torch.float32,
    )
