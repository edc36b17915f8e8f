"""Helpers for the tests and the benchmarks; not part of the installed package.

They live at the top of the checkout, beside ``tests/`` and ``benchmarks/``, and are imported as
``testing`` with the checkout on ``sys.path`` (pytest's ``pythonpath`` setting; the benchmarks put
it there themselves). Nothing in ``oobleck``, ``baselines`` or ``analysis`` imports them
(``tests/test_imports.py`` checks).

- ``configs``: ``tiny_config`` (gpt3_tiny, a 4-step job) and ``config_section``;
- ``plans``: ``template``, ``hand_plan``, ``two_pipelines_of_two_nodes``: plans built by hand;
- ``checks``: ``assert_matches_reference`` (a real run equals single-process training),
  ``cached_reference`` (that training, computed once per process for each input) and ``tcp_states``;
- ``stopping``: ``StopWhen`` and ``launch_until`` (a run stopped a few steps after it has seen
  what its test is about) and ``assert_stopped_run_matches_reference``.
"""

from testing.checks import TCP_STATES, assert_matches_reference, cached_reference, ports_still_listening, tcp_states
from testing.configs import config_section, tiny_config
from testing.plans import hand_plan, template, two_pipelines_of_two_nodes

__all__ = [
    "TCP_STATES",
    "assert_matches_reference",
    "cached_reference",
    "config_section",
    "hand_plan",
    "ports_still_listening",
    "tcp_states",
    "template",
    "tiny_config",
    "two_pipelines_of_two_nodes",
]
