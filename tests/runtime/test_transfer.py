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

pytestmark = pytest.mark.slow  # starts processes

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


def test_a_layer_relayed_down_chains_arrives_bit_for_bit(shared_store):
    """Rank 0 is the only holder of layer 0 and rank 1 of layer 1's second half; ranks 2 and 3
    both need both layers. Layer 0 goes 0 -> 2 -> 3 in three pieces; layer 1's two chunks go
    0 -> 2 -> 3 and 1 -> 3 -> 2 in two pieces each (rank 2 relays to 3 what it is still
    receiving, and the reverse). Every receiver ends with its sources' state exactly, each holder
    sent each chunk once, and the relays count what they sent."""
    cfg = tiny_config()
    job = cfg.job
    spec = model_spec(cfg.model, int(job.seed))
    everything = template([(0, spec.num_layers, 0, 0, 1)])
    plan = hand_plan([(everything, (n,), 2) for n in range(4)], batch=16, micro=2, layers=spec.num_layers, f=3, gpus=1)
    transfers = (
        LayerTransfer(layer=0, source=(0, 0), target=(2, 0), chunk=0, chunks=1, nbytes=0, hop=0, pieces=3),
        LayerTransfer(layer=0, source=(2, 0), target=(3, 0), chunk=0, chunks=1, nbytes=0, hop=1, pieces=3),
        LayerTransfer(layer=1, source=(0, 0), target=(2, 0), chunk=0, chunks=2, nbytes=0, hop=0, pieces=2),
        LayerTransfer(layer=1, source=(2, 0), target=(3, 0), chunk=0, chunks=2, nbytes=0, hop=1, pieces=2),
        LayerTransfer(layer=1, source=(1, 0), target=(3, 0), chunk=1, chunks=2, nbytes=0, hop=0, pieces=2),
        LayerTransfer(layer=1, source=(3, 0), target=(2, 0), chunk=1, chunks=2, nbytes=0, hop=1, pieces=2),
    )
    reconfiguration = ReconfigurationPlan(plan, plan, (), (2, 3), transfers)

    def rank(topology, comm):
        held = {0: (0, 1), 1: (1,)}.get(topology.rank, ())
        layers = {i: trained(spec, job, i) for i in held}
        moved = transfer_state(
            topology,
            comm,
            reconfiguration,
            layers,
            lambda i: layer_state(spec, job, i, "cpu", initialise=False),
            committed=COMMITTED,
            generation=20,
        )
        return moved, {i: layer.flat.clone() for i, layer in layers.items()}

    (out0, src0), (out1, src1), (got2, dst2), (got3, dst3) = run_ranks(
        plan, rank, store=shared_store, generation=20, reconfiguration=reconfiguration
    )
    n0, n1 = src0[0].shape[1], src0[1].shape[1]
    half = n1 // 2
    assert torch.equal(src0[1], src1[1])
    for received in (dst2, dst3):
        assert torch.equal(received[0], src0[0]) and torch.equal(received[1], src0[1])
    assert (out0.bytes_out, out0.copied_out) == (4 * 3 * (n0 + half), (0, 1))  # each chunk once
    assert (out1.bytes_out, out1.copied_out) == (4 * 3 * (n1 - half), (1,))
    assert got2.bytes_in == got3.bytes_in == 4 * 3 * (n0 + n1)
    assert got2.bytes_out == 4 * 3 * (n0 + half) and got2.copied_out == (0, 1)  # relayed layer 0, chunk 0
    assert got3.bytes_out == 4 * 3 * (n1 - half) and got3.copied_out == (1,)  # relayed chunk 1


def test_a_recovery_relaying_from_a_sole_holder_equals_single_process_training(tmp_path, monkeypatch):
    """A real run (5 local nodes, SIGKILL at step 2) whose reconfiguration makes every survivor a
    1-node pipeline: node 0 is then the only holder of layers 0-1 and node 1 of layer 2, each
    needed by three other nodes, so those copies are relayed down chains. Losses and final
    parameters equal single-process training."""
    from oobleck.elastic.job import launch
    from oobleck.planning.reconfigure import plan_transfers
    from oobleck.strategies.oobleck import Oobleck, plan_layout
    from oobleck.strategy import Decision, Kind
    from testing import assert_matches_reference

    cfg = tiny_config(
        **{
            "cluster.nodes": 5,
            "job.fault_tolerance": 1,
            "job.steps": 5,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 2, "nodes": [3], "phase": "backward"}],
        }
    )
    three = template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1), (4, 6, 2, 0, 1)])
    two = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    start = hand_plan([(three, (0, 1, 2), 4), (two, (3, 4), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)
    everything = template([(0, 6, 0, 0, 1)])
    decided = []

    def every_node_its_own_pipeline(self, state):
        alive = sorted(set(state.layout.nodes) - set(state.removed))
        new = hand_plan([(everything, (n,), 2) for n in alive], batch=16, micro=2, layers=6, f=1, gpus=1)
        transfers = plan_transfers(state.layout.plan, new, state.removed, self.context.layer_param_bytes)
        decided.append(transfers)
        return Decision(Kind.RECONFIGURE, plan_layout(new), transfers=transfers, reason="every node its own pipeline")

    monkeypatch.setattr(Oobleck, "on_change", every_node_its_own_pipeline)
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=start)
    assert len(decided) == 1 and [r["removed"] for r in outcome.recoveries] == [[3]]
    relayed = {t.layer for t in decided[0] if t.hop > 0}
    assert {0, 1, 2} <= relayed  # the sole holders' layers went down chains
    for layer in relayed:  # down a chain, nobody sends the same chunk twice
        sends = [(t.chunk, t.source) for t in decided[0] if t.layer == layer]
        assert len(set(sends)) == len(sends)
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    assert all(r["replicas_identical"] for r in outcome.recoveries)
