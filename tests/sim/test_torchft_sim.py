"""torchft in the simulator (issue 26): its replica groups of n0 nodes, what it trains per step,
the recovery its own workers carry out, and its place in the paper's experiments."""

from __future__ import annotations

import pytest
from simhelpers import make_context, make_strategy

from baselines.torchft.policy import TorchftLayout, shard_sizes
from oobleck.errors import ConfigError
from oobleck.faults.trace import parse_trace
from oobleck.sim.charges import decision_downtime
from oobleck.sim.engine import simulate
from oobleck.sim.progress import BREAKDOWN
from oobleck.strategy import Kind, RunInfo, RunState

# torchft's own deployment at the planner's fewest nodes per group.
PAPER = {"nodes_per_replica": "min", "deployment": "torchft"}


@pytest.fixture(scope="module")
def context():
    # 63 microbatches: no number of groups of 2 of these 8 nodes divides them. n0 = 2 nodes.
    return make_context(memory_gb=2.0, nodes=8, batch=63)


def _change(layout, alive, removed=(), joined=()):
    return RunState(layout, tuple(sorted(alive)), tuple(removed), tuple(joined), step=5)


def test_shards_are_equal_for_the_harness_and_differ_by_one_for_torchfts_sampler():
    assert shard_sizes(64, 4, equal=True) == (16,) * 4
    assert shard_sizes(63, 4, equal=False) == (15, 16, 16, 16)
    assert sum(shard_sizes(819, 30, equal=False)) == 819 and set(shard_sizes(819, 30, equal=False)) == {27, 28}


def test_min_groups_of_n0_start_where_the_harness_deployment_stops(context):
    assert context.templates(0).min_nodes == 2
    harness = make_strategy(context, "torchft", nodes_per_replica=2).start(range(8))
    assert harness.kind is Kind.STOP and "63 microbatches" in harness.reason and "divide evenly" in harness.reason
    start = make_strategy(context, "torchft", **PAPER).start(range(8))
    layout = start.layout
    assert start.kind is Kind.START and isinstance(layout, TorchftLayout)
    assert [g.nodes for g in layout.groups] == [(0, 1), (2, 3), (4, 5), (6, 7)] and layout.shards == (15, 16, 16, 16)
    assert layout.samples_per_iteration == 63 and layout.nodes == tuple(range(8))
    assert layout.iteration_s == pytest.approx(layout.plan.predicted_iteration_s)
    # Its sampler is built for the most groups the cluster makes: 7 nodes now, 8 at most.
    fewer = make_strategy(context, "torchft", **PAPER).start(range(7)).layout
    assert len(fewer.groups) == 3 and fewer.standby == (6,) and fewer.shards == (15, 16, 16, 16)
    assert fewer.samples_per_iteration == 15 + 16 + 16


def test_a_lost_group_skips_its_shard_and_free_nodes_form_a_new_group_that_heals(context):
    strategy = make_strategy(context, "torchft", **PAPER)
    start = strategy.start(range(8)).layout
    lost = strategy.on_change(_change(start, [0, 1, 2, 4, 5, 6, 7], removed=[3]))
    assert lost.kind is Kind.CONTINUE and "[3]" in lost.reason and lost.layout.plan == start.plan
    assert [g.shard for g in lost.layout.groups] == [0, 2, 3] and lost.layout.standby == (2,)
    assert lost.layout.samples_per_iteration == 63 - 16 and lost.layout.nodes == (0, 1, 4, 5, 6, 7)
    assert lost.layout.iteration_s <= start.iteration_s  # the same shards, a reduction over fewer groups
    # The next loss frees node 4; with node 2 they make a group, on the vacant shard 1.
    again = strategy.on_change(_change(lost.layout, [0, 1, 2, 4, 6, 7], removed=[5]))
    assert again.kind is Kind.CONTINUE and "heal from a live peer" in again.reason
    assert [(g.nodes, g.shard) for g in again.layout.groups] == [((0, 1), 0), ((6, 7), 3), ((2, 4), 1)]
    assert again.layout.samples_per_iteration == 63 - 16 and again.layout.standby == ()
    # The harness's runtime has no such scheduler: the survivors leave, a joiner stands by.
    harness = make_strategy(make_context(nodes=8, batch=64), "torchft", nodes_per_replica=2)
    ran = harness.start(range(8)).layout
    broken = harness.on_change(_change(ran, [0, 1, 2, 4, 5, 6, 7], removed=[3])).layout
    later = harness.on_change(_change(broken, [0, 1, 2, 4, 6, 7, 8], removed=[5], joined=[8]))
    assert [g.nodes for g in later.layout.groups] == [(0, 1), (6, 7)] and later.layout.standby == (8,)
    assert later.layout.samples_per_iteration == 32


def test_a_new_group_takes_no_shard_twice_under_torchfts_scheduler(context):
    strategy = make_strategy(context, "torchft", **PAPER)
    start = strategy.start(range(8)).layout
    joined = strategy.on_change(_change(start, [*range(8), 8, 9], joined=[8, 9]))
    # Every shard is trained: the joiners stand by (a torchft job launches at most its sampler's groups).
    assert joined.kind is Kind.CONTINUE and joined.layout.standby == (8, 9) and len(joined.layout.groups) == 4
    one_node = make_strategy(make_context(nodes=8, memory_gb=8.0, batch=63), "torchft", **PAPER)
    assert one_node.group_nodes() == 1
    ones = one_node.start(range(8)).layout
    assert ones.shards == shard_sizes(63, 8, equal=False) and ones.samples_per_iteration == 63


def test_the_simulator_charges_what_torchfts_workers_do_and_counts_what_they_train(context):
    strategy = make_strategy(context, "torchft", **PAPER, costs={"detect_s": 3.0, "warmup_s": 0.5})
    start = strategy.start(range(8)).layout
    lost = strategy.on_change(_change(start, [0, 1, 2, 4, 5, 6, 7], removed=[3]))
    downtime, parts = decision_downtime(lost, strategy, previous=start, failure=True)
    assert dict(parts) == {"detect": 3.0, "state_copy": 0.0, "warmup": 0.5} and downtime == pytest.approx(3.5)
    healed = strategy.on_change(_change(lost.layout, [0, 1, 2, 4, 6, 7], removed=[5]))
    _, parts = decision_downtime(healed, strategy, previous=lost.layout, failure=True)
    # Node 2 and node 4 receive a stage's parameters and Adam moments from a peer, over one link.
    largest = max(
        sum(context.profile.layers[i].param_bytes for i in stage.layers) * 3
        for stage in start.plan.pipelines[0].template.stages
    )
    assert dict(parts)["state_copy"] == pytest.approx(largest / context.cluster.inter_node_bandwidth)
    # A join that only adds a standby node costs nothing.
    idle = strategy.on_change(_change(healed.layout, [0, 1, 2, 4, 6, 7, 8], joined=[8]))
    assert idle.layout.standby == (8,) and decision_downtime(idle, strategy, previous=healed.layout)[0] == 0.0

    trace = parse_trace("\n".join([f"0,add,n{i}" for i in range(8)] + ["1000000,remove,n3"]) + "\n", origin="t.csv")
    result = simulate(strategy, trace, duration_s=2000.0)
    kinds = [e["kind"] for e in result.events]
    assert kinds == ["start", "failure", "continue"]
    (recovery,) = [e for e in result.events if e["kind"] == "continue"]
    assert recovery["failure"] and recovery["downtime_s"] == pytest.approx(3.5)
    s = result.summary
    assert s["n_continue"] == 1 and s["n_restart"] == 0 and s["ran"] and not s["oom"]
    assert sum(s[f"{k}_node_s"] for k in BREAKDOWN) == pytest.approx(s["node_seconds"])
    assert s["lost_node_s"] > 0  # the step in flight did not commit
    # After the loss it trains 47 of 63 samples a step, at the step time of three groups.
    after = [r for r in result.segments if r["phase"] == "running" and r["t_start_s"] >= 1000.0]
    assert after and after[0]["samples_per_s"] == pytest.approx(47 / lost.layout.iteration_s)
    assert after[0]["nodes_used"] == 6 and s["idle_node_s"] == pytest.approx(1 * (2000.0 - 1000.0 - 3.5), rel=0.01)


def test_a_real_run_refuses_what_only_the_simulator_models(context, tmp_path):
    run = RunInfo(host="127.0.0.1", store_address="127.0.0.1:1", run_id="r", run_dir=tmp_path)
    with pytest.raises(ConfigError, match="deployment=torchft .* simulator only"):
        make_strategy(context, "torchft", nodes_per_replica=2, deployment="torchft").services(run)
    for named in ("min", "fastest"):
        with pytest.raises(
            ConfigError, match=f"nodes_per_replica={named} is resolved by the simulator only.*nodes_per_replica=[25]$"
        ):
            make_strategy(context, "torchft", nodes_per_replica=named).services(run)
    for key, value, message in (
        ("deployment", "slurm", "must be one of harness, torchft"),
        ("nodes_per_replica", "max", "must be a number of nodes, min .* or fastest"),
    ):
        with pytest.raises(ConfigError, match=message):
            make_strategy(context, "torchft", **{key: value})
    assert not list(tmp_path.iterdir())  # no lighthouse started, nothing written


def test_the_paper_experiments_compare_torchft_in_its_own_deployment(make_config):
    for experiment in ("paper_failure_frequency", "paper_spot"):
        cfg = make_config(f"experiment={experiment}")
        assert cfg.sim.strategies == ["oobleck", "varuna", "bamboo", "torchft", "recycle"], experiment
        assert dict(cfg.sim.params.torchft) == {"nodes_per_replica": "fastest", "deployment": "torchft"}


def test_a_small_paper_experiment_gives_torchft_a_ratio_after_recovering_in_place(make_config, tmp_path):
    from oobleck.sim.experiment import run_experiment

    trace = tmp_path / "small.csv"
    trace.write_text("\n".join([f"0,add,n{i}" for i in range(8)] + ["1800000,remove,n3", "3600000,remove,n6"]) + "\n")
    cfg = make_config(
        "experiment=paper_failure_frequency",
        "sim.models=[gpt3_medium]",
        f"sim.traces=[{trace}]",
        "sim.strategies=[oobleck,torchft]",
        "sim.trace_starts=1",
        "sim.band_samples=1",
        "sim.duration_h=1.5",
    )
    result = run_experiment(cfg)
    torchft = result.summary.set_index("strategy").loc["torchft"]
    assert torchft["ran"] and not torchft["oom"] and torchft["n_continue"] == 2 and torchft["n_restart"] == 0
    recoveries = result.events[(result.events["strategy"] == "torchft") & (result.events["kind"] == "continue")]
    assert recoveries["failure"].all() and (recoveries["downtime_s"] > 0).all()
    # 819 microbatches over 8 one-node groups: shards of 102 and 103; two lost, two skipped.
    assert 0 < torchft["throughput"] and torchft["lost_node_s"] > 0
    ratio = result.ratios.set_index("baseline").loc["torchft"]
    assert ratio["note"] == "" and ratio["ratio_median"] > 0 and ratio["ratio_starts"] == 1


def test_fastest_groups_train_the_most_samples_per_second_of_every_size():
    """``fastest``: every template size of n0 nodes or more, the one whose start trains the most
    samples per second (as Varuna's layout is the planner's fastest)."""
    context = make_context(memory_gb=4.0, nodes=8, batch=63)  # n0 = 1: the whole model fits a node
    fastest = make_strategy(context, "torchft", nodes_per_replica="fastest", deployment="torchft")
    chosen = fastest.start(range(8)).layout
    rates = {}
    for k in context.templates(0).sizes:
        start = make_strategy(context, "torchft", nodes_per_replica=k, deployment="torchft").start(range(8))
        rates[k] = start.layout.samples_per_s
    best = max(rates, key=lambda k: (rates[k], -k))
    assert len(chosen.plan.pipelines[0].nodes) == best == fastest.group_nodes() != context.templates(0).min_nodes
    assert chosen.samples_per_s == pytest.approx(max(rates.values())) and len(set(rates.values())) > 1
    # The changes after it keep its groups' size.
    lost = fastest.on_change(_change(chosen, [n for n in range(8) if n != 0], removed=[0]))
    assert lost.kind is Kind.CONTINUE and all(len(g.nodes) == best for g in lost.layout.groups)
