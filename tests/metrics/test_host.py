"""Every run records its host: cores, load at the start and the end, its own processes (summary.json
and the wandb config), and flags a run whose processes outnumbered the cores or whose host was
loaded beyond them."""

from __future__ import annotations

import json
import os

from oobleck.elastic.accounting import HostReport
from oobleck.metrics import RunRecorder
from oobleck.metrics.host import HostSnapshot, host_record, run_processes
from oobleck.metrics.offline import find_offline_runs
from testing import config_section, tiny_config

FINISH_S = 60.0  # wandb's service writes the run file after finish() returns: a hang guard


def snapshot(load: float, cpus: int = 2) -> HostSnapshot:
    return HostSnapshot("box", cpus, cpus, (load, load, load))


def test_the_snapshot_reads_this_machine():
    now = HostSnapshot.now()
    assert now.cpu_count == os.cpu_count() and 1 <= now.usable_cpus <= now.cpu_count
    assert len(now.load_avg) == 3 and all(v >= 0 for v in now.load_avg)


def test_the_flags_say_when_a_measurement_is_not_to_be_trusted():
    calm = host_record(snapshot(0.5), snapshot(1.5), run_processes=5, training_processes=2)
    assert calm["overloaded"] is False and calm["oversubscribed"] is False
    assert calm["load_avg_start"] == [0.5] * 3 and calm["load_avg_end"] == [1.5] * 3 and calm["cpu_count"] == 2
    ended_loaded = host_record(snapshot(0.5), snapshot(2.5), run_processes=5, training_processes=2)
    assert ended_loaded["overloaded"] is True and ended_loaded["oversubscribed"] is False
    crowded = host_record(snapshot(0.1), snapshot(0.1), run_processes=15, training_processes=6)
    assert crowded["oversubscribed"] is True and crowded["overloaded"] is False


def test_the_run_processes_count_every_part_on_this_host():
    assert run_processes(nodes_on_host=6, gpus_per_node=1, fork_server=True) == 1 + 1 + 6 * 2
    assert run_processes(nodes_on_host=1, gpus_per_node=4, fork_server=False) == 1 + 5


def test_the_host_report_counts_the_nodes_a_local_run_used_at_most():
    from oobleck.strategies.oobleck import plan_layout
    from testing import two_pipelines_of_two_nodes

    cfg = tiny_config(**{"cluster.nodes": 5})
    report = HostReport(cfg, snapshot(0.0))
    plan = two_pipelines_of_two_nodes()

    class Document:
        pass

    document = Document()
    document.plan = plan
    report.published(document, plan_layout(plan, standby=[4]))
    record = report.record()
    # 4 nodes train (4 workers), 5 nodes keep an agent and a worker each, plus controller and fork server.
    assert record["training_processes"] == 4 and record["run_processes"] == 2 + 5 * 2
    assert record["oversubscribed"] is (4 > record["usable_cpus"])


def test_the_host_goes_to_summary_json_and_the_wandb_config(tmp_path):
    settings = config_section("logger", wandb={"mode": "offline"}).wandb
    start = snapshot(0.25)
    config = {"model": {"name": "gpt3_tiny"}, "cluster": {"nodes": 2}, "strategy": {"name": "oobleck"}}
    recorder = RunRecorder(tmp_path, config, total_steps=1, wandb=settings, progress_bar=False, host=start.as_start())
    recorder.step(step=0, samples=8, samples_per_s=4.0, loss=5.5, generation=0, pipelines=1, attempts=1)
    host = host_record(start, snapshot(3.0), run_processes=6, training_processes=2)
    recorder.finish(steps=1, host=host)
    assert json.loads((tmp_path / "summary.json").read_text())["host"] == host
    (run,) = find_offline_runs(tmp_path, complete_within_s=FINISH_S)
    assert run.config["host"] == host  # the start's, replaced by the whole record at the end
