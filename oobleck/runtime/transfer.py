"""Moving layer state between live workers when a generation starts (a reconfiguration's copies).

The controller's reconfiguration plan lists ``LayerTransfer``s: chunk ``k`` of ``n`` of a layer's
elements, from a surviving holder to a new one. ``transfer_state`` runs this rank's part of them:

- a chunk (elements ``[a, b)``) is three contiguous slices of the rows of the layer's flat state
  (``oobleck.runtime.state``): sent from the source's live state and received straight into the
  new holder's, with no packing, copying or checksumming on either side;
- every send and receive is issued at once on its channel (one two-rank channel per source and
  target, each with its own gloo thread), so the chunks of a layer split over several sources
  arrive side by side;
- a received layer joins the worker's layers only once every chunk has arrived, so an abort in
  the middle leaves nothing half-copied behind.

Integrity is checked end to end once, after the generation is established: every rank hashes
every layer it holds *and every layer it sent* (``copied_out``), and the controller requires all
hashes of a layer to agree (``StepLedger.check_established``), so a copy that differs from its
source by a bit stops the run. A per-chunk checksum on both sides of the wire would be a second
full pass over the bytes at each end, which on this machine halved the copy's rate.

``probe_links`` times a raw gloo send/recv on the same channels, the peer figure for the copy's
rate (``benchmarks/bench_runtime.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from oobleck.errors import RunError
from oobleck.planning.plan import ReconfigurationPlan
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.state import LayerState, chunk_bounds, chunk_rows, set_step
from oobleck.runtime.topology import Topology, rank_of


@dataclass(frozen=True)
class Moved:
    """What one rank's part of the copies moved."""

    bytes_in: int
    bytes_out: int
    copied_out: tuple[int, ...]  # layers this rank sent (their hashes are compared too)


def transfer_state(
    topology: Topology,
    comm: Communicator,
    reconfiguration: Optional[ReconfigurationPlan],
    layers: dict[int, LayerState],
    empty_layer: Callable[[int], LayerState],
    *,
    committed: int,
    generation: int,
) -> Moved:
    """This rank's sends and receives of the plan's layer copies (see the module docstring);
    received layers are added to ``layers`` (made by ``empty_layer(index)``, AdamW step set to
    ``committed``)."""
    if reconfiguration is None:
        return Moved(0, 0, ())
    ranks = rank_of(topology.plan)
    me = topology.rank
    pending: list[tuple[Any, str]] = []
    arriving: dict[int, LayerState] = {}
    covered: dict[int, int] = {}
    sent: set[int] = set()
    bytes_in = bytes_out = 0
    for transfer in reconfiguration.transfers:
        src, dst = ranks[tuple(transfer.source)], ranks[tuple(transfer.target)]  # type: ignore[index]
        if me not in (src, dst) or src == dst:
            continue
        if me == src:
            if transfer.layer not in layers:
                raise RunError(f"generation {generation}: rank {me} must send layer {transfer.layer} but does not hold it")
            layer = layers[transfer.layer]
            sent.add(transfer.layer)
        else:
            if transfer.layer not in arriving:
                arriving[transfer.layer] = empty_layer(transfer.layer)
            layer = arriving[transfer.layer]
        a, b = chunk_bounds(layer.numel, transfer.chunk, transfer.chunks)
        name = channel_name(src, dst, "xfer")
        what = f"{'sending' if me == src else 'receiving'} layer {transfer.layer} [{a}, {b})"
        for row in chunk_rows(layer, a, b):
            pending.append((comm.broadcast(name, row, src), what))
            if me == src:
                bytes_out += row.numel() * row.element_size()
            else:
                bytes_in += row.numel() * row.element_size()
        if me == dst:
            covered[transfer.layer] = covered.get(transfer.layer, 0) + (b - a)
    for work, what in pending:
        comm.waiter.work(work, what)
    for index, layer in arriving.items():
        if covered[index] != layer.numel:
            raise RunError(f"generation {generation}: layer {index} received {covered[index]} of {layer.numel} elements")
        set_step(layer, committed)
        layers[index] = layer
    return Moved(bytes_in, bytes_out, tuple(sorted(sent)))


def probe_links(topology: Topology, comm: Communicator, reconfiguration: Optional[ReconfigurationPlan], nbytes: int) -> dict[str, dict[str, float]]:
    """Raw gloo send/recv bandwidth (bytes/s, as the receiver measured it) of ``nbytes`` on every
    copy channel of this rank, just before the copy: ``{"cold": {"src->dst": rate}, "warm":
    {...}}`` (into fresh memory, and into the same memory again) for the channels it receives on."""
    rates: dict[str, dict[str, float]] = {"cold": {}, "warm": {}}
    if reconfiguration is None:
        return rates
    ranks = rank_of(topology.plan)
    pairs = sorted({(ranks[tuple(t.source)], ranks[tuple(t.target)]) for t in reconfiguration.transfers})  # type: ignore[index]
    for src, dst in pairs:
        if topology.rank in (src, dst) and src != dst:
            cold, warm = comm.probe_link(channel_name(src, dst, "xfer"), src, nbytes)
            if topology.rank == dst:
                rates["cold"][f"{src}->{dst}"] = nbytes / cold
                rates["warm"][f"{src}->{dst}"] = nbytes / warm
    return rates
