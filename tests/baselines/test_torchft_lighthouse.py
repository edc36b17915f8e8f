"""A torchft lighthouse that stops answering ends the run with its cause (issue 28, point 7).

torchft's Manager gets every step's quorum from the lighthouse (which the controller runs); when
the lighthouse does not answer within ``strategy.quorum_timeout_s`` its quorum call fails with
"Timeout expired" and nothing else, and the run's ``stopped`` field said no more than that. Here a
real 2-node torchft run has every packet to and from the lighthouse's port dropped (iptables,
``testing.firewall``) once step ``CUT_AFTER`` committed: the run stops with an error whose first
line (the one summary.json keeps) names the quorum timeout and the lighthouse's address.
"""

from __future__ import annotations

import json
from urllib.parse import urlparse

import pytest

from oobleck.elastic.job import launch
from oobleck.errors import RunError
from oobleck.runtime import keys
from testing import tiny_config
from testing.firewall import DropRules, iptables_unusable

pytestmark = pytest.mark.slow  # starts processes

pytest.importorskip("torchft", reason="strategy=torchft needs pip install -e '.[peers]'")

CUT_AFTER = 3
QUORUM_TIMEOUT_S = 5  # torchft's default is 60 s: the run waits this long before it stops


def test_an_unreachable_lighthouse_stops_the_run_with_its_cause(tmp_path):
    reason = iptables_unusable()
    if reason is not None:
        pytest.skip(reason)
    cfg = tiny_config(
        "strategy=torchft",
        **{
            "cluster.nodes": 2,
            "job.steps": 1000,  # never reached: the run stops at the cut
            "job.global_batch_size": 16,
            "strategy.quorum_timeout_s": QUORUM_TIMEOUT_S,
        },
    )
    rules = DropRules()
    lighthouse: list[str] = []

    def on_start(controller) -> None:
        def on_step(row: dict) -> None:
            if row["step"] == CUT_AFTER and not rules.installed:
                address = json.loads(controller.store.get(keys.SERVICES))["lighthouse"]
                lighthouse.append(address)
                url = urlparse(address)
                rules.drop_tcp_port(str(url.hostname), int(url.port))

        controller.on_step = on_step

    try:
        with pytest.raises(RunError) as caught:
            launch(cfg, tmp_path / "run", on_start=on_start)
    finally:
        rules.heal()
    assert lighthouse, "the run never reached the step to cut the lighthouse at"
    first = str(caught.value).splitlines()[0]
    assert f"torchft: no quorum within strategy.quorum_timeout_s={QUORUM_TIMEOUT_S} s" in first, first
    assert f"the lighthouse at {lighthouse[0]} did not answer" in first, first
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert f"the lighthouse at {lighthouse[0]} did not answer" in summary["stopped"], summary["stopped"]
    assert summary["steps"] > CUT_AFTER
