"""Moving layer state between live workers when a generation starts (a reconfiguration's copies).

The controller's reconfiguration plan lists ``LayerTransfer``s: chunk ``k`` of ``n`` of a layer's
elements, from a surviving holder to a new one. ``transfer_state`` runs this rank's part of them:

- a chunk (elements ``[a, b)``) travels as pieces of at most ``piece_elements``: contiguous
  slices of the rows of the layer's flat state (``oobleck.runtime.state``), sent from the
  source's live state and received straight into the new holder's, with no packing on either
  side, then one tensor of the pieces' CRC32s;
- every send and receive is issued at once on its channel (one two-rank channel per source and
  target, so the chunks of a layer split over several sources arrive side by side), and each
  side computes a piece's CRC32 while the next pieces are on the wire (zlib releases the GIL);
- a received layer joins the worker's layers only once every chunk has arrived and checked, so
  an abort in the middle leaves nothing half-copied behind.

``probe_links`` times a raw gloo send/recv on the same channels, the peer figure for the copy's
rate (``benchmarks/bench_runtime.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from oobleck.errors import RunError
from oobleck.planning.plan import ReconfigurationPlan
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.state import LayerState, chunk_bounds, chunk_rows, crc32, set_step
from oobleck.runtime.topology import Topology, rank_of


@dataclass
class _Chunk:
    """One chunk of a layer copy on one channel, as this rank sends or receives it."""

    layer: int
    a: int
    b: int
    source: int  # the rank sending it
    channel: str
    pieces: list[torch.Tensor]  # views of the layer's flat state
    works: list[Any]  # one broadcast per piece, then (last) the checksums'
    checksums: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pieces)

    @property
    def what(self) -> str:
        return f"layer {self.layer} [{self.a}, {self.b})"


def pieces(rows: list[torch.Tensor], elements: int) -> list[torch.Tensor]:
    """The rows cut into contiguous pieces of at most ``elements`` (views, no copies)."""
    return [row[k : k + elements] for row in rows for k in range(0, row.numel(), elements)]


def transfer_state(
    topology: Topology,
    comm: Communicator,
    reconfiguration: Optional[ReconfigurationPlan],
    layers: dict[int, LayerState],
    empty_layer: Callable[[int], LayerState],
    *,
    committed: int,
    generation: int,
    piece_elements: int,
) -> tuple[int, int]:
    """This rank's sends and receives of the plan's layer copies (see the module docstring);
    received layers are added to ``layers`` (made by ``empty_layer(index)``, AdamW step set to
    ``committed``). Returns ``(bytes received, bytes sent)``."""
    if reconfiguration is None:
        return 0, 0
    ranks = rank_of(topology.plan)
    me = topology.rank
    chunks: list[_Chunk] = []
    arriving: dict[int, LayerState] = {}
    covered: dict[int, int] = {}
    for transfer in reconfiguration.transfers:
        src, dst = ranks[tuple(transfer.source)], ranks[tuple(transfer.target)]  # type: ignore[index]
        if me not in (src, dst) or src == dst:
            continue
        if me == src:
            if transfer.layer not in layers:
                raise RunError(f"generation {generation}: rank {me} must send layer {transfer.layer} but does not hold it")
            layer = layers[transfer.layer]
        else:
            if transfer.layer not in arriving:
                arriving[transfer.layer] = empty_layer(transfer.layer)
            layer = arriving[transfer.layer]
            covered[transfer.layer] = covered.get(transfer.layer, 0)
        a, b = chunk_bounds(layer.numel, transfer.chunk, transfer.chunks)
        cut = pieces(chunk_rows(layer, a, b), piece_elements)
        name = channel_name(src, dst, "xfer")
        chunks.append(_Chunk(transfer.layer, a, b, src, name, cut, [comm.broadcast(name, p, src) for p in cut]))
        if me == dst:
            covered[transfer.layer] += b - a
    # A chunk's checksums follow all the pieces on its channel, in the order the chunks are listed
    # (a channel matches broadcasts by their order on both sides). A source checksums each piece
    # while the channel is sending it.
    for chunk in chunks:
        if chunk.source == me:
            chunk.checksums = torch.tensor([crc32(p) for p in chunk.pieces], dtype=torch.int64)
        else:
            chunk.checksums = torch.zeros(len(chunk.pieces), dtype=torch.int64)
        chunk.works.append(comm.broadcast(chunk.channel, chunk.checksums, chunk.source))
    # A target checks each piece as it lands, while the next ones arrive.
    for chunk in (c for c in chunks if c.source != me):
        found = []
        for work, piece in zip(chunk.works, chunk.pieces):
            comm.waiter.work(work, f"receiving {chunk.what}")
            found.append(crc32(piece))
        comm.waiter.work(chunk.works[-1], f"receiving {chunk.what}'s checksums")
        if found != chunk.checksums.tolist():
            raise RunError(f"generation {generation}: {chunk.what} arrived corrupted (checksum mismatch)")
    for chunk in (c for c in chunks if c.source == me):
        for work in chunk.works:
            comm.waiter.work(work, f"sending {chunk.what}")
    for index, layer in arriving.items():
        if covered[index] != layer.numel:
            raise RunError(f"generation {generation}: layer {index} received {covered[index]} of {layer.numel} elements")
        set_step(layer, committed)
        layers[index] = layer
    received = sum(c.nbytes for c in chunks if c.source != me)
    return received, sum(c.nbytes for c in chunks) - received


def probe_links(topology: Topology, comm: Communicator, reconfiguration: Optional[ReconfigurationPlan], nbytes: int) -> dict[str, float]:
    """Raw gloo send/recv bandwidth (bytes/s, as the receiver measured it) of ``nbytes`` on every
    copy channel of this rank, just before the copy: ``"src->dst": rate`` for the channels it
    receives on."""
    if reconfiguration is None:
        return {}
    ranks = rank_of(topology.plan)
    pairs = sorted({(ranks[tuple(t.source)], ranks[tuple(t.target)]) for t in reconfiguration.transfers})  # type: ignore[index]
    rates = {}
    for src, dst in pairs:
        if topology.rank in (src, dst) and src != dst:
            seconds = comm.probe_link(channel_name(src, dst, "xfer"), src, nbytes)
            if topology.rank == dst:
                rates[f"{src}->{dst}"] = nbytes / seconds
    return rates
