"""Old public names keep working, with a warning, after a move."""

import importlib
import sys
import warnings

from oobleck.strategies.oobleck import Oobleck
from oobleck.strategy import strategy_class


def test_the_old_oobleck_strategy_target_still_resolves_with_a_warning():
    sys.modules.pop("oobleck.policy", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("oobleck.policy")
    assert module.Oobleck is Oobleck
    assert any(
        issubclass(w.category, DeprecationWarning) and "oobleck.strategies.oobleck" in str(w.message) for w in caught
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert strategy_class({"name": "oobleck", "_target_": "oobleck.policy.Oobleck"}) is Oobleck
