"""The README's command lines, as a shell would read them, for the tests that run or check each one.

``readme_commands`` reads every ``bash`` block of README.md: a line ending in a backslash goes on
on the next one, ``#`` starts a comment outside quotes, quotes are removed (``shlex``, as the
shell does), and ``a && b`` is two commands. Each command keeps the line of the README it starts
on, so a failing test names it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
# Programs that are scripts, not Hydra apps: benchmarks and the analysis tools.
SCRIPT = re.compile(r"^python (benchmarks/\w+\.py|-m analysis\.\w+)$")


@dataclass(frozen=True)
class Command:
    """One command of a README bash block: its words (quotes removed) and the README line it is on."""

    words: tuple[str, ...]
    line: int

    @property
    def program(self) -> str:
        """``oobleck-run``, ``sbatch``, ..., or ``python -m <module>`` / ``python <script>``."""
        if self.words[0] == "python" and len(self.words) > 1:
            return " ".join(self.words[:3]) if self.words[1] == "-m" else " ".join(self.words[:2])
        return self.words[0]

    @property
    def arguments(self) -> tuple[str, ...]:
        return self.words[len(self.program.split()) :]

    def __str__(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.words)}"


def readme_commands(text: str | None = None) -> list[Command]:
    """Every command of the README's bash blocks, in order."""
    text = README.read_text() if text is None else text
    commands = []
    for block in _BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        index = 0
        while index < len(lines):
            start, logical = index, lines[index]
            while logical.endswith("\\") and index + 1 < len(lines):
                index += 1
                logical = logical[:-1] + " " + lines[index]
            index += 1
            words = shlex.split(logical, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                if cut:
                    commands.append(Command(tuple(words[:cut]), first + start))
                words = words[cut + 1 :]
    return commands


def with_overrides(arguments: tuple[str, ...], **values: object) -> tuple[str, ...]:
    """``arguments`` (Hydra overrides) with ``key=value`` for each of ``values`` (dotted keys given
    with ``__`` for the dots): replaced where the README gives the key, appended where it does not."""
    out = list(arguments)
    for name, value in values.items():
        key = name.replace("__", ".")
        given = [i for i, word in enumerate(out) if word.split("=", 1)[0] == key]
        if given:
            out[given[0]] = f"{key}={value}"
        else:
            out.append(f"{key}={value}")
    return tuple(out)
