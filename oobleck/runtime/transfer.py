"""Moving layer state between live workers when a generation starts (a reconfiguration's copies).

The controller's reconfiguration plan lists ``LayerTransfer``s: chunk ``k`` of ``n`` of a layer's
elements, from a surviving holder to a new one. ``transfer_state`` runs this rank's part of them:

- a chunk (elements ``[a, b)``) is three contiguous slices of the rows of the layer's flat state
  (``oobleck.runtime.state``): sent from the source's live state and received straight into the
  new holder's, with no packing, copying or checksumming on either side;
- every send and receive is issued at once on its channel (one two-rank channel per source and
  target, each with its own gloo thread), so the chunks of a layer split over several sources
  arrive side by side;
- a chunk relayed down a chain (``LayerTransfer.hop`` > 0: several workers need the layer) moves
  in ``pieces``; a relaying rank posts its receives with the others and forwards each piece as
  soon as that piece has arrived, so the chain streams. Both ends of a channel issue its
  operations in one order, (hop, layer, chunk, piece), and a relay of hop h waits only on a
  receive of hop h - 1, which its sender issued earlier in that order: no rank waits on one that
  waits on it;
- a received layer joins the worker's layers only once every chunk has arrived, so an abort in
  the middle leaves nothing half-copied behind;
- the receive buffers can be made ahead (``PreparedLayers``): allocated, and their pages faulted
  in, on a background thread while the generation's process groups are created. On a CPU a
  receive into fresh memory pays the page faults as the bytes arrive: a 353 MB gloo receive ran
  at 800 MB/s into fresh memory against 3100 MB/s into touched memory on this machine
  (``benchmarks/bench_runtime.py``, section transfer).

Integrity is checked end to end once, after the generation is established: every rank hashes
every layer it holds *and every layer it sent* (``copied_out``), and the controller requires all
hashes of a layer to agree (``StepLedger.check_established``), so a copy that differs from its
source by a bit stops the run. A per-chunk checksum on both sides of the wire would be a second
full pass over the bytes at each end, which on this machine halved the copy's rate.

``probe_links`` times a raw gloo send/recv on the same channels, the peer figure for the copy's
rate (``benchmarks/bench_runtime.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck.errors import RunError
from oobleck.planning.outputs import LayerTransfer, ReconfigurationPlan
from oobleck.runtime.comm import Communicator, channel_name
from oobleck.runtime.state import STATE_KINDS, LayerState, chunk_bounds, chunk_rows, set_step
from oobleck.runtime.topology import Topology, rank_of


@dataclass(frozen=True)
class Moved:
    """What one rank's part of the copies moved."""

    bytes_in: int
    bytes_out: int
    copied_out: tuple[int, ...]  # layers this rank sent (their hashes are compared too)


def incoming_layers(topology: Topology, reconfiguration: ReconfigurationPlan | None) -> tuple[int, ...]:
    """The layers this rank receives in the plan's copies."""
    if reconfiguration is None:
        return ()
    ranks = rank_of(topology.plan)
    me = topology.rank
    return tuple(
        sorted({t.layer for t in reconfiguration.transfers if ranks[t.target] == me and ranks[t.source] != me})
    )


class PreparedLayers:
    """Receive buffers made on a background thread: ``make(index)`` for each incoming layer,
    its whole state then written once (zeros) so that every page is mapped before the copy.

    ``take(index)`` waits for the thread (it only allocates and writes local memory, so the
    wait is bounded by that work) and hands the layer over; ``seconds`` is the thread's time and
    ``waited_s`` how much of it the caller still waited for (the part not hidden)."""

    def __init__(self, indices: tuple[int, ...], make: Callable[[int], LayerState]) -> None:
        self.make = make
        self.seconds = 0.0
        self.waited_s = 0.0
        self._layers: dict[int, LayerState] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._prepare, args=(indices,), daemon=True, name="oobleck-prefault")
        self._thread.start()

    def _prepare(self, indices: tuple[int, ...]) -> None:
        started = time.monotonic()
        try:
            for index in indices:
                layer = self.make(index)
                layer.flat.zero_()
                self._layers[index] = layer
        except BaseException as error:  # re-raised by take, in the worker's own thread
            self._error = error
        self.seconds = time.monotonic() - started

    def join(self) -> None:
        if self._thread.is_alive():
            started = time.monotonic()
            self._thread.join()
            self.waited_s += time.monotonic() - started
        if self._error is not None:
            raise self._error

    def take(self, index: int) -> LayerState:
        self.join()
        layer = self._layers.pop(index, None)
        return layer if layer is not None else self.make(index)


def transfer_state(
    topology: Topology,
    comm: Communicator,
    reconfiguration: ReconfigurationPlan | None,
    layers: dict[int, LayerState],
    empty_layer: Callable[[int], LayerState],
    *,
    committed: int,
    generation: int,
) -> Moved:
    """This rank's sends, receives and relays of the plan's layer copies (see the module
    docstring); received layers are added to ``layers`` (made by ``empty_layer(index)``, AdamW
    step set to ``committed``)."""
    if reconfiguration is None:
        return Moved(0, 0, ())
    ranks = rank_of(topology.plan)
    me = topology.rank
    arriving: dict[int, LayerState] = {}
    covered: dict[int, int] = {}
    sent: set[int] = set()
    bytes_in = bytes_out = 0
    pending: list[tuple[Any, str]] = []
    received: dict[tuple[int, int, int], list[Any]] = {}  # (layer, chunk, piece) -> its receives
    relays: list[tuple[LayerTransfer, int, int, int]] = []
    # Both ends of a channel issue its operations in one order: (hop, layer, chunk, piece).
    mine = sorted(
        (t for t in reconfiguration.transfers if me in (ranks[t.source], ranks[t.target])),
        key=lambda t: (t.hop, t.layer, t.chunk),
    )
    for transfer in mine:
        src, dst = ranks[transfer.source], ranks[transfer.target]
        if src == dst:
            continue
        if me == dst:
            if transfer.layer not in arriving:
                arriving[transfer.layer] = empty_layer(transfer.layer)
            layer = arriving[transfer.layer]
        elif transfer.layer in layers:
            layer = layers[transfer.layer]
        elif transfer.hop > 0:
            relayed = arriving.get(transfer.layer)  # relayed: it arrives here first
            if relayed is None:
                raise RunError(
                    f"generation {generation}: rank {me} must relay layer {transfer.layer} chunk {transfer.chunk} "
                    "but receives no part of it"
                )
            layer = relayed
        else:
            raise RunError(f"generation {generation}: rank {me} must send layer {transfer.layer} but does not hold it")
        name = channel_name(src, dst, "xfer")
        for piece, (a, b) in enumerate(_pieces(layer.numel, transfer)):
            if b == a:
                continue
            if me == dst:
                what = f"receiving layer {transfer.layer} [{a}, {b})"
                works = [comm.broadcast(name, row, src) for row in chunk_rows(layer, a, b)]
                received[(transfer.layer, transfer.chunk, piece)] = works
                pending += [(work, what) for work in works]
                bytes_in += STATE_KINDS * (b - a) * layer.flat.element_size()
                covered[transfer.layer] = covered.get(transfer.layer, 0) + (b - a)
            elif transfer.layer in layers:
                what = f"sending layer {transfer.layer} [{a}, {b})"
                pending += [(comm.broadcast(name, row, src), what) for row in chunk_rows(layer, a, b)]
                bytes_out += STATE_KINDS * (b - a) * layer.flat.element_size()
                sent.add(transfer.layer)
            else:
                relays.append((transfer, piece, a, b))
    # Relays, in the channels' order: each piece forwarded once its own receive is done. A relay
    # at hop h waits only on sends of hop h - 1 (earlier in every rank's order), so none waits
    # on a rank that waits on it.
    for transfer, piece, a, b in relays:
        layer = arriving[transfer.layer]
        for work in received.pop((transfer.layer, transfer.chunk, piece), ()):
            comm.waiter.work(work, f"receiving layer {transfer.layer} [{a}, {b}) to relay it")
        src, dst = ranks[transfer.source], ranks[transfer.target]
        what = f"relaying layer {transfer.layer} [{a}, {b})"
        pending += [(comm.broadcast(channel_name(src, dst, "xfer"), row, src), what) for row in chunk_rows(layer, a, b)]
        bytes_out += STATE_KINDS * (b - a) * layer.flat.element_size()
        sent.add(transfer.layer)
    for work, what in pending:
        comm.waiter.work(work, what)
    for index, layer in arriving.items():
        if covered[index] != layer.numel:
            raise RunError(
                f"generation {generation}: layer {index} received {covered[index]} of {layer.numel} elements"
            )
        set_step(layer, committed)
        layers[index] = layer
    return Moved(bytes_in, bytes_out, tuple(sorted(sent)))


def _pieces(numel: int, transfer: LayerTransfer) -> list[tuple[int, int]]:
    """Element ranges of the pieces of ``transfer``'s chunk, in order."""
    a, b = chunk_bounds(numel, transfer.chunk, transfer.chunks)
    return [(a + lo, a + hi) for lo, hi in (chunk_bounds(b - a, q, transfer.pieces) for q in range(transfer.pieces))]


def probe_links(
    topology: Topology, comm: Communicator, reconfiguration: ReconfigurationPlan | None, nbytes: int
) -> dict[str, dict[str, float]]:
    """Raw gloo send/recv bandwidth (bytes/s, as the receiver measured it) of ``nbytes`` on every
    copy channel of this rank, just before the copy: ``{"cold": {"src->dst": rate}, "warm":
    {...}}`` (into fresh memory, and into the same memory again) for the channels it receives on."""
    rates: dict[str, dict[str, float]] = {"cold": {}, "warm": {}}
    if reconfiguration is None:
        return rates
    ranks = rank_of(topology.plan)
    pairs = sorted({(ranks[t.source], ranks[t.target]) for t in reconfiguration.transfers})
    for src, dst in pairs:
        if topology.rank in (src, dst) and src != dst:
            cold, warm = comm.probe_link(channel_name(src, dst, "xfer"), src, nbytes)
            if topology.rank == dst:
                rates["cold"][f"{src}->{dst}"] = nbytes / cold
                rates["warm"][f"{src}->{dst}"] = nbytes / warm
    return rates
