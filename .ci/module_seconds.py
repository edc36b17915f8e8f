"""Each test module's seconds in a pytest run, for the suite's longest-first order.

    python -m pytest -q --durations=0 -p no:xdist > durations.log
    python .ci/module_seconds.py durations.log [ci.log ...] > tests/module_seconds.json

Reads the ``--durations`` lines (setup, call and teardown of every test) and sums them by module,
taking a module's largest sum over the logs (a local run skips the Slurm tests; a CI log has them);
``tests/conftest.py`` hands the modules to the xdist workers longest first, so that no long module
starts last while the other worker idles. A serial run gives the truest figures; the order only
needs them roughly right.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

LINE = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?\.py)::")


def module_seconds(logs: list[list[str]]) -> dict[str, int]:
    seconds: Counter[str] = Counter()
    for lines in logs:
        these: Counter[str] = Counter()
        for line in lines:
            match = LINE.match(line)
            if match:
                these[match.group(2)] += float(match.group(1))
        for module, total in these.items():
            seconds[module] = max(seconds[module], total)
    return {module: max(1, round(total)) for module, total in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python .ci/module_seconds.py DURATIONS_LOG [MORE_LOGS ...] > tests/module_seconds.json")
    logs = []
    for path in sys.argv[1:]:
        with open(path) as log:
            logs.append(log.readlines())
    print(json.dumps(module_seconds(logs), indent=1))
