"""``transfer_state``: a reconfiguration's layer copies arrive bit for bit, from one source or
split over several.

Three ranks in threads of this process on real gloo groups (``inprocess.run_ranks``): ranks 0 and
1 hold trained replicas of layers 0 and 1 (identical, with non-zero AdamW moments); rank 2 holds
nothing and receives layer 0 from rank 0 alone and layer 1 in two chunks, one from each source.
What arrives equals the sources' state exactly (so its hash, which the controller compares with
the sources', agrees), with the AdamW step set to the committed steps; the byte counts add up and
each source names the layers it copied out. With ``prepared`` the receiver's buffers are made
ahead on a background thread (``PreparedLayers``, the runtime's ``runtime.prefault_copies``) and
the copy lands in those very buffers.
"""

from __future__ import annotations

import pytest
import torch
from inprocess import run_ranks

from oobleck.layer_state import layer_checksum, layer_state
from oobleck.models.spec import model_spec
from oobleck.planning.outputs import LayerTransfer, ReconfigurationPlan
from oobleck.runtime.transfer import PreparedLayers, incoming_layers, transfer_state
from testing import hand_plan, template, tiny_config

COMMITTED = 3


def trained(spec, job, index: int):
    layer = layer_state(spec, job, index, "cpu")
    for p in layer.params:
        p.grad = torch.linspace(-1.0, 1.0, p.numel()).view_as(p)
    layer.optimizer.step()
    return layer


@pytest.mark.parametrize("prepared", [False, True], ids=["allocated-as-it-arrives", "prepared-ahead"])
def test_a_layer_split_over_two_sources_arrives_bit_for_bit(shared_store, prepared):
    cfg = tiny_config()
    job = cfg.job
    spec = model_spec(cfg.model, int(job.seed))
    everything = template([(0, spec.num_layers, 0, 0, 1)])
    plan = hand_plan(
        [(everything, (n,), 8 // 3 + (n < 8 % 3)) for n in range(3)],
        batch=16,
        micro=2,
        layers=spec.num_layers,
        f=2,
        gpus=1,
    )
    transfers = (
        LayerTransfer(layer=0, source=(0, 0), target=(2, 0), chunk=0, chunks=1, nbytes=0),
        LayerTransfer(layer=1, source=(0, 0), target=(2, 0), chunk=0, chunks=2, nbytes=0),
        LayerTransfer(layer=1, source=(1, 0), target=(2, 0), chunk=1, chunks=2, nbytes=0),
    )
    reconfiguration = ReconfigurationPlan(plan, plan, (), (2,), transfers)

    def rank(topology, comm):
        layers = {i: trained(spec, job, i) for i in (0, 1)} if topology.rank < 2 else {}
        made: list = []

        def empty(i):
            made.append(layer_state(spec, job, i, "cpu", initialise=False))
            return made[-1]

        incoming = incoming_layers(topology, reconfiguration)
        assert incoming == ((0, 1) if topology.rank == 2 else ())
        ahead = PreparedLayers(incoming, empty) if prepared else None
        moved = transfer_state(
            topology, comm, reconfiguration, layers, ahead.take if ahead else empty, committed=COMMITTED, generation=0
        )
        if topology.rank == 2:  # the copy landed in the buffers made for it, one per layer
            assert sorted(id(layer) for layer in layers.values()) == sorted(id(layer) for layer in made)
        states = {
            i: (layer.flat.clone(), [layer.optimizer.state[p]["step"].item() for p in layer.params])
            for i, layer in layers.items()
        }
        return moved, states, {i: layer_checksum(layer) for i, layer in layers.items()}

    (out0, src0, hash0), (out1, src1, hash1), (got, dst, hash2) = run_ranks(
        plan, rank, store=shared_store, generation=10 + prepared, reconfiguration=reconfiguration
    )
    n0, n1 = src0[0][0].shape[1], src0[1][0].shape[1]
    assert (out0.bytes_in, out0.bytes_out, out0.copied_out) == (0, 4 * 3 * (n0 + n1 // 2), (0, 1))
    assert (out1.bytes_in, out1.bytes_out, out1.copied_out) == (0, 4 * 3 * (n1 - n1 // 2), (1,))
    assert (got.bytes_in, got.bytes_out, got.copied_out) == (4 * 3 * (n0 + n1), 0, ())
    assert hash0 == hash1 == hash2
    for i in (0, 1):
        assert torch.equal(dst[i][0], src0[i][0]) and torch.equal(src0[i][0], src1[i][0])
        assert set(dst[i][1]) == {float(COMMITTED)}


def test_a_copy_one_bit_off_its_source_stops_the_run():
    """The end-to-end integrity check that replaces per-chunk checksums: once a generation is
    established, the controller's ledger compares the hashes every rank reports (of the layers it
    holds and of those it copied out); a copy one bit off its source is refused."""
    import json

    import pytest
    import torch.distributed as dist

    from oobleck.elastic.ledger import StepLedger
    from oobleck.errors import RunError
    from oobleck.runtime import keys
    from oobleck.runtime.sealed_store import SealedStore
    from oobleck.strategy import Layout

    cfg = tiny_config()
    spec = model_spec(cfg.model, int(cfg.job.seed))
    everything = template([(0, spec.num_layers, 0, 0, 1)])
    plan = hand_plan([(everything, (n,), 4) for n in range(2)], batch=16, micro=2, layers=spec.num_layers, f=1, gpus=1)
    source = trained(spec, cfg.job, 1)
    copy = layer_state(spec, cfg.job, 1, "cpu", initialise=False)
    copy.flat.copy_(source.flat)
    assert layer_checksum(copy) == layer_checksum(source)
    copy.flat.view(-1).view(torch.int32)[12345] ^= 1  # one bit of one element
    for number, received in enumerate((source, copy)):
        store = SealedStore(dist.HashStore(), keys.KeySpace("transfer tests"))
        ledger = StepLedger(store, 4, 16, on_step=lambda row: None)
        ledger.publish(number, Layout(plan, 1.0, "2 x 1"), 0)
        store.set(keys.established(number), keys.YES)
        for rank, layer in ((0, source), (1, received)):
            store.set(keys.timing(number, rank), "{}")
            store.set(keys.probe(number, rank), "{}")
            store.set(keys.checksums(number, rank), json.dumps({"1": layer_checksum(layer)}))
        if received is source:
            assert ledger.check_established().replicas_identical
        else:
            with pytest.raises(RunError, match="checksum mismatch"):
                ledger.check_established()


def test_a_failure_preparing_receive_buffers_is_raised_where_the_copy_takes_them():
    def make(index):
        raise MemoryError(f"no memory for layer {index}")

    ahead = PreparedLayers((4,), make)
    with pytest.raises(MemoryError, match="layer 4"):
        ahead.take(4)
