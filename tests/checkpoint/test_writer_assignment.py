"""Each layer is written once, by one of its holders, with the bytes spread over the nodes."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck.checkpoint.assignment import assign_checkpoint_writers
from oobleck.errors import PlanningError
from testing import hand_plan, template


def node_load(writers, sizes):
    load = Counter()
    for layer, (node, _) in writers.items():
        load[node] += sizes[layer]
    return load


def test_a_real_plan_spreads_writers_over_every_node():
    # Two pipelines over four nodes: [0,1] and [2,3], each holding all 6 layers in 2 stages; the
    # second stage of the first pipeline is sharded over 2 GPUs.
    two_stages = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 2)])
    plan = hand_plan([(two_stages, (0, 1), 4), (two_stages, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=2)
    sizes = {0: 50, 1: 10, 2: 10, 3: 10, 4: 10, 5: 50}
    writers = assign_checkpoint_writers(plan.layer_holders(), sizes)
    holders = plan.layer_holders()
    assert sorted(writers) == list(range(6)) and all(writers[layer] in holders[layer] for layer in writers)
    load = node_load(writers, sizes)
    assert len(load) == 4 and max(load.values()) == 50  # each big layer alone on a node, the rest spread
    # the same input in another order gives the same answer (every process computes it)
    shuffled = {layer: tuple(reversed(h)) for layer, h in reversed(list(holders.items()))}
    assert assign_checkpoint_writers(shuffled, dict(reversed(list(sizes.items())))) == writers


def test_a_layer_without_holders_is_an_error():
    with pytest.raises(PlanningError, match=r"layers \[1\] have no live holder"):
        assign_checkpoint_writers({0: [(0, 0)], 1: []}, {0: 1, 1: 1})
    with pytest.raises(ValueError, match=r"layer_bytes lacks layers \[1\]"):
        assign_checkpoint_writers({0: [(0, 0)], 1: [(0, 0)]}, {0: 1})


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=12),
    nodes=st.integers(1, 5),
    gpus=st.integers(1, 2),
    data=st.data(),
)
def test_writers_are_holders_and_balanced(sizes, nodes, gpus, data):
    workers = [(n, g) for n in range(nodes) for g in range(gpus)]
    layer_bytes = dict(enumerate(sizes))
    holders = {layer: data.draw(st.lists(st.sampled_from(workers), min_size=1, unique=True)) for layer in layer_bytes}
    writers = assign_checkpoint_writers(holders, layer_bytes)
    assert all(writers[layer] in holders[layer] for layer in layer_bytes)
    # With every node holding every layer, greedy largest-first keeps each node within one layer
    # of the mean (the LPT bound), so no node writes everything when there is enough to share.
    everywhere = assign_checkpoint_writers({layer: workers for layer in layer_bytes}, layer_bytes)
    load = node_load(everywhere, layer_bytes)
    assert max(load.values()) <= sum(sizes) / nodes + max(sizes)
    if nodes > 1 and len(sizes) > 1:
        assert len(load) > 1
