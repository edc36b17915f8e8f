"""``oobleck.simulate`` shares an experiment's parts over processes: forked where the process runs
no other thread, started by a fork server where it does (a fork copies locks other threads held;
a child crashed in its first garbage collection so). Either way, the same results as one process."""

from __future__ import annotations

import threading

import pandas as pd
import pytest

from oobleck.simulate import run
from testing.configs import composed

pytestmark = pytest.mark.slow  # starts processes

TRACE = [f"0,add,n{i}" for i in range(8)] + ["1800000,remove,n2", "3000000,add,n9"]


def test_parts_shared_beside_another_thread_match_one_process(tmp_path):
    trace = tmp_path / "short.csv"
    trace.write_text("\n".join(TRACE) + "\n")
    overrides = (
        "experiment=paper_spot",
        "sim.models=[gpt2_small]",
        f"sim.traces=[{trace}]",
        "sim.strategies=[oobleck,varuna]",
        "sim.duration_h=1",
        "sim.trace_starts=1",
        "sim.band_samples=1",  # the nominal point and three band points: four parts
        "sim.figures=false",
        "logger.progress_bar=false",
        "logger.wandb.mode=disabled",
    )
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True, name="another")
    other.start()
    try:
        run(composed(*overrides, "sim.processes=2"), tmp_path / "two")
    finally:
        idle.set()
        other.join()
    run(composed(*overrides, "sim.processes=1"), tmp_path / "one")
    for name in ("sim_summary.csv", "sim_band.csv"):
        two, one = pd.read_csv(tmp_path / "two" / name), pd.read_csv(tmp_path / "one" / name)
        assert len(one) > 1
        pd.testing.assert_frame_equal(two[["strategy", "throughput"]], one[["strategy", "throughput"]])
