"""Reconfiguration copies: relayed down chains when several workers need a layer, and what the cost
model charges for them (``pipeline_cost.copy_seconds``, what reconfiguration decides by).

The audit case (seed 6000474): two 4-node pipelines of 2 GPUs, 7 layers, 8.39 MB/s between nodes,
f = 1, 28 microbatches; node 71 fails and node 29, the same stage of the other pipeline, is the
only surviving holder of layer 3 (10.6 MB of parameters). A fresh plan of seven 1-node pipelines
needs it on the 12 workers of the 6 other nodes. Copied straight from node 29 that is 12 sends of
10.6 MB (45.5 s at 3 moved bytes per parameter byte); relayed, node 29 sends each byte once and
every node receives and forwards it once: the busiest node moves what it lacks, 10.8 MB (3.85 s),
plus the chain's fill. The layer times here are ours (the audit's profile was not kept), chosen
so that, as in the audit, the fresh plan is about 0.1 s per iteration faster than the regrouped
one (2.96 s against 3.07 s; the audit's 4.109 s against 4.222 s).
"""

from __future__ import annotations

import pytest

from oobleck.planning.inputs import LayerProfile, ModelProfile
from oobleck.planning.instantiate import build_plan
from oobleck.planning.outputs import LayerTransfer, StageSpec
from oobleck.planning.pipeline_cost import MOVED_BYTES_PER_PARAM_BYTE, copy_seconds
from oobleck.planning.reconfigure import plan_transfers, reconfigure
from oobleck.planning.templates import TemplateSet, make_template
from testing.plans import cluster

BYTES = (5472, 7888, 23200, 10608000, 4, 4, 129440)
BANDWIDTH = 8.39e6
LAYOUTS = {  # (start, end, node position): one stage of both GPUs per node
    1: [(0, 7, 0)],
    2: [(0, 3, 0), (3, 7, 1)],
    3: [(0, 3, 0), (3, 4, 1), (4, 7, 2)],
    4: [(0, 3, 0), (3, 4, 1), (4, 6, 2), (6, 7, 3)],
}


@pytest.fixture(scope="module")
def audit_case():
    seconds = (0.1, 0.1, 0.1, 0.02, 0.02, 0.02, 0.02)
    layers = tuple(LayerProfile(f"l{i}", t / 3, 2 * t / 3, b, 0, 0) for i, (t, b) in enumerate(zip(seconds, BYTES)))
    profile = ModelProfile("seed6000474", 1, "synthetic", layers)
    spec = cluster(8, gpus=2, intra=1e10, inter=BANDWIDTH)
    templates = TemplateSet(
        min_nodes=1,
        max_nodes=4,
        templates={
            n: make_template(profile, spec, [StageSpec(a, b, node, 0, 2) for a, b, node in layout], 4)
            for n, layout in LAYOUTS.items()
        },
        num_layers=7,
        gpus_per_node=2,
        layer_param_bytes=BYTES,
        intra_node_bandwidth=spec.intra_node_bandwidth,
        inter_node_bandwidth=BANDWIDTH,
    )
    old = build_plan(templates, [4, 4], [[26, 29, 27, 28], [68, 71, 69, 70]], 28, 1, 1)
    return templates, old


def _direct_seconds(transfers) -> float:
    """What the copies cost if every worker that needs a chunk got it from the chunk's surviving
    holder (no relays): the busiest node's bytes over the link."""
    holder = {(t.layer, t.chunk): t.source[0] for t in transfers if t.hop == 0}
    into: dict[int, int] = {}
    out: dict[int, int] = {}
    for t in transfers:
        source = holder[(t.layer, t.chunk)]
        if source != t.target[0]:
            into[t.target[0]] = into.get(t.target[0], 0) + t.nbytes
            out[source] = out.get(source, 0) + t.nbytes
    return MOVED_BYTES_PER_PARAM_BYTE * max([*into.values(), *out.values()]) / BANDWIDTH


def test_the_audit_case_charges_the_fresh_plan_its_relayed_copy(audit_case):
    templates, old = audit_case
    result = reconfigure(old, templates, removed=[71], fault_tolerance=1)
    assert result.replanned and [len(p.nodes) for p in result.new.pipelines] == [1] * 7
    transfers = result.transfers
    # Node 29 sends every byte of the layer only it holds once, not once per worker needing it.
    only_29 = BYTES[3]
    sent_by_29 = sum(t.nbytes for t in transfers if t.source[0] == 29 and t.target[0] != 29)
    assert only_29 <= sent_by_29 <= only_29 + sum(BYTES) - BYTES[3]  # (and passes on what it receives)
    assert _direct_seconds(transfers) == pytest.approx(12 * only_29 * 3 / BANDWIDTH) == pytest.approx(45.5, abs=0.1)
    charged = copy_seconds(transfers, BANDWIDTH)
    into: dict[int, int] = {}
    out: dict[int, int] = {}
    for t in transfers:
        if t.source[0] != t.target[0]:
            into[t.target[0]] = into.get(t.target[0], 0) + t.nbytes
            out[t.source[0]] = out.get(t.source[0], 0) + t.nbytes
    busiest = 3 * max([*into.values(), *out.values()]) / BANDWIDTH
    # At least what a node that held layers 0-2 lacks (the audit: "at least 3.85 s" with relays).
    assert 3 * (sum(BYTES) - sum(BYTES[:3])) / BANDWIDTH <= busiest < 3.9
    assert busiest <= charged < 7.0
    # The regrouped plan (the intact pipeline kept) is slower per iteration: with relayed copies
    # the fresh one repays its extra copying within the 100-step horizon; charged 45.5 s it would not.
    regrouped = reconfigure(old, templates, removed=[71], fault_tolerance=1, replan_horizon_steps=0)
    gain = 100 * (regrouped.new.predicted_iteration_s - result.new.predicted_iteration_s)
    extra = charged - copy_seconds(regrouped.transfers, BANDWIDTH)
    assert extra < gain < _direct_seconds(transfers) - copy_seconds(regrouped.transfers, BANDWIDTH)


def test_chains_send_each_chunk_once_per_holder_and_enter_each_node_once(audit_case):
    templates, old = audit_case
    new = reconfigure(old, templates, removed=[71], fault_tolerance=1).new
    transfers = plan_transfers(old, new, [71], BYTES)
    chains: dict[tuple[int, int], list[LayerTransfer]] = {}
    for t in transfers:
        chains.setdefault((t.layer, t.chunk), []).append(t)
    for chain in chains.values():
        chain.sort(key=lambda t: t.hop)
        senders = [t.source for t in chain]
        assert len(set(senders)) == len(senders)  # nobody sends the same chunk twice
        assert [t.hop for t in chain] == list(range(len(chain)))
        nodes = [chain[0].source[0]] + [t.target[0] for t in chain]
        entered = [b for a, b in zip(nodes, nodes[1:]) if a != b]
        assert len(entered) == len(set(entered))  # a node's workers are consecutive in the chain
        assert len({t.pieces for t in chain}) == 1
    # Chunks of one layer start on different nodes.
    firsts = {}
    for (layer, _chunk), chain in chains.items():
        firsts.setdefault(layer, set()).add(min(chain, key=lambda t: t.hop).target[0])
    assert any(len(nodes) > 1 for nodes in firsts.values())


def test_copy_seconds_adds_the_fill_of_the_longest_chain():
    # One chunk of 8 MB in 4 pieces down a chain crossing nodes 0 -> 1 -> 2 -> 3.
    chain = [LayerTransfer(0, (n, 0), (n + 1, 0), 0, 1, 8_000_000, hop=n, pieces=4) for n in range(3)]
    busiest = 8_000_000  # every node sends or receives the chunk once
    fill = 2 * 8_000_000 / 4  # the last node gets its first piece two pieces late
    assert copy_seconds(chain, 1e6) == pytest.approx(3 * (busiest + fill) / 1e6)
    # Copies made directly (tuples, or hop 0 in one piece) are the busiest node's bytes alone.
    direct = [LayerTransfer(0, (0, 0), (n, 0), 0, 1, 8_000_000) for n in (1, 2, 3)]
    assert copy_seconds(direct, 1e6) == pytest.approx(3 * 3 * busiest / 1e6)
    assert copy_seconds([(0, n, 8_000_000) for n in (1, 2, 3)], 1e6) == copy_seconds(direct, 1e6)


def test_copies_match_the_straightforward_computation():
    """Over seeded random plans, failures and re-plans (multi-GPU nodes, few and many sources):
    ``_copies`` (interval arithmetic on held ranges, least-loaded holders without a full sort)
    returns exactly the rows of the straightforward computation, with held layers given as ranges
    and as sets."""
    import random

    from planning_brute import straightforward_copies

    from oobleck.errors import PlanningError
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.layer_copies import _check_replicas, _copies, _held_ranges
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    rng = random.Random(30)
    compared = 0
    while compared < 60:
        layers, nodes, f, gpus = rng.randint(2, 10), rng.randint(2, 10), rng.randint(0, 2), rng.choice([1, 2, 4])
        profile = synthetic_profile(layers, seed=rng.randint(0, 10**6), jitter=0.6)
        try:
            templates = generate_templates(profile, cluster(nodes, gpus=gpus), f)
            old = instantiate(templates, range(nodes), rng.choice([4, 16, 64]), 1, f)
            others = rng.sample(range(nodes + 2), rng.randint(1, nodes + 2))  # other template sizes too
            new = instantiate(templates, others, old.global_batch_size, 1, rng.randint(0, f))
        except PlanningError:
            continue
        gone = set(rng.sample(old.nodes, rng.randint(0, f)))
        live = {layer: tuple(w for w in workers if w[0] not in gone) for layer, workers in old.layer_holders().items()}
        if not all(live.values()):
            continue
        held = {w: range(a, b) for w, (a, b) in _held_ranges(old, gone).items()}
        sources = rng.choice([1, 2, 4])
        expected = straightforward_copies(new, held, live, templates.layer_param_bytes, sources, 2**20)
        assert _copies(new, held, live, templates.layer_param_bytes, sources, 2**20) == expected
        # The surviving holders as reconfiguration finds them: sorted, one tuple per stage segment.
        shared = _check_replicas(old, gone)
        assert {layer: tuple(sorted(workers)) for layer, workers in live.items()} == shared
        assert _copies(new, held, shared, templates.layer_param_bytes, sources, 2**20) == expected
        shuffled = {layer: tuple(rng.sample(workers, len(workers))) for layer, workers in live.items()}
        assert _copies(new, held, shuffled, templates.layer_param_bytes, sources, 2**20) == expected
        as_sets = {w: set(r) for w, r in held.items()}
        assert _copies(new, as_sets, live, templates.layer_param_bytes, sources, 2**20) == expected
        compared += 1


def test_missing_layers_of_ranges_are_the_set_difference():
    from oobleck.planning.layer_copies import _missing

    for a in range(6):
        for b in range(a, 7):
            for c in range(6):
                for d in range(c, 7):
                    expected = [layer for layer in range(a, b) if layer not in set(range(c, d))]
                    assert list(_missing(range(a, b), range(c, d))) == expected
                    assert list(_missing(range(a, b), set(range(c, d)))) == expected


def test_surviving_holders_of_plans_with_shadow_copies():
    """With shadow copies a layer's holders are no longer those of its stage segment: each layer's
    own holders, filtered and sorted."""
    import dataclasses

    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.layer_copies import _check_replicas
    from oobleck.planning.outputs import ShadowCopy
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    templates = generate_templates(synthetic_profile(6, seed=1), cluster(4, gpus=2, memory=1.6e9), 1)
    plan = instantiate(templates, [5, 1, 3, 0], 8, 1, 1)
    assert any(len(p.template.stages) > 1 for p in plan.pipelines)
    shadowed = dataclasses.replace(plan, shadows=(ShadowCopy(pipeline=0, stage=0, layers=(5,)),))
    for gone in ({1}, {5}, {0, 1}, set()):
        for subject in (plan, shadowed):
            expected = {
                layer: tuple(sorted(w for w in workers if w[0] not in gone))
                for layer, workers in subject.layer_holders().items()
            }
            assert _check_replicas(subject, gone) == expected


def test_transfers_of_rows_are_the_dataclass():
    rows = [(3, (1, 0), (2, 1), 0, 2, 400, 0, 1), (3, (2, 1), (4, 0), 1, 2, 404, 5, 7)]
    assert LayerTransfer.of_rows(rows) == tuple(LayerTransfer(*row) for row in rows)
    assert LayerTransfer.of_rows(rows)[1].pieces == 7


def test_reconfiguration_equals_the_straightforward_path(monkeypatch):
    """Over seeded random reconfigurations (failures, joins, re-plans, 1-8 GPUs per node), the
    plan ``reconfigure`` returns is the one it returns with the straightforward copies, holders
    filtered per layer and transfers built one ``LayerTransfer(*row)`` at a time, to the last
    field."""
    import random

    from planning_brute import straightforward_copies

    from oobleck.errors import PlanningError
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    # Patched where a reconfiguration looks them up: ``reconfigure`` checks the replicas, ``_place``
    # builds the copies.
    module = __import__("oobleck.planning.reconfigure", fromlist=["_check_replicas"])
    placement = __import__("oobleck.planning.placement", fromlist=["_copies"])
    rng = random.Random(3030)
    cases = []
    while len(cases) < 40:
        layers, nodes, f, gpus = rng.randint(2, 12), rng.randint(3, 12), rng.randint(0, 3), rng.choice([1, 2, 4, 8])
        profile = synthetic_profile(layers, seed=rng.randint(0, 10**6), jitter=0.6)
        try:
            templates = generate_templates(profile, cluster(nodes + 2, gpus=gpus), f)
            old = instantiate(templates, range(nodes), rng.choice([4, 16, 64]), 1, f)
            removed = rng.sample(old.nodes, rng.randint(0, f))
            joined = [100 + i for i in range(rng.randint(0, 2))]
            if not removed and not joined:
                continue
            args = dict(removed=removed, joined=joined, max_sources=rng.choice([1, 2, 4]), fault_tolerance=f)
            fast = reconfigure(old, templates, **args)
        except PlanningError:
            continue
        cases.append((old, templates, args, fast))

    def holders_per_layer(plan, removed):
        live = {
            layer: tuple(w for w in workers if w[0] not in removed) for layer, workers in plan.layer_holders().items()
        }
        if not all(live.values()):
            raise PlanningError("a layer lost every replica")
        return live

    monkeypatch.setattr(module, "_check_replicas", holders_per_layer)
    monkeypatch.setattr(placement, "_copies", lambda *a, relay=True: straightforward_copies(*a))
    monkeypatch.setattr(LayerTransfer, "of_rows", classmethod(lambda cls, rows: tuple(cls(*row) for row in rows)))
    for old, templates, args, fast in cases:
        templates.memo.clear()
        assert reconfigure(old, templates, **args) == fast
