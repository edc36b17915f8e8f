"""Strategy constants: the shipped YAML files parse, and a wrong key or value is one clear error."""

from __future__ import annotations

import pytest

from oobleck.errors import ConfigError
from oobleck.sim.params import BambooParams, OobleckParams, VarunaParams, parse_params, strategy_params


def test_shipped_strategy_files_parse_with_their_sources_values():
    varuna = parse_params("varuna", strategy_params("varuna"))
    assert isinstance(varuna, VarunaParams)
    assert varuna.checkpoint_interval == 10  # artifact: checkpoint_per_iter=10
    assert varuna.restart_s_by_model["gpt3_6_7b"] == 701.0
    bamboo = parse_params("bamboo", strategy_params("bamboo"))
    assert isinstance(bamboo, BambooParams) and bamboo.failover_slowdown is None and bamboo.min_pipeline_depth == 2
    oobleck = parse_params("oobleck", strategy_params("oobleck"))
    assert isinstance(oobleck, OobleckParams) and oobleck.checkpoint_interval == 0 and oobleck.reconfigure_fixed_s == 2.0


def test_overrides_win_and_the_composed_section_replaces_the_file():
    params = strategy_params("varuna", {"checkpoint_interval": 50})
    assert parse_params("varuna", params).checkpoint_interval == 50
    section = {"name": "varuna", "checkpoint_interval": 0, "params": {}}
    assert parse_params("varuna", strategy_params("varuna", section=section)).checkpoint_interval == 0


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"restart_seconds": 3}, "unknown parameter restart_seconds=3"),
        ({"failover_s": "soon"}, "failover_s='soon' must be a number"),
        ({"failover_s": -1}, "failover_s=-1 must be >= 0"),
        ({"restart_s_by_model": 5}, "must be a mapping"),
    ],
)
def test_bad_constants_name_strategy_key_and_value(params, fragment):
    with pytest.raises(ConfigError, match="strategy bamboo") as info:
        parse_params("bamboo", params)
    assert fragment in str(info.value)
