"""Every command line of the README's bash blocks is checked: none can name a removed key, a group
option that does not exist, or a schedule that cannot run (issue 28).

Each command is checked the way its program checks it before starting anything: its Hydra
overrides composed and validated (``validate``), a training run's failure schedule built for its
nodes and steps, every point of a sweep composed with the launcher preset it names. Commands that
are cheap to run for real (the local ``oobleck-run`` examples and ``oobleck-plan``) also run in
``tests/test_readme_runs.py`` (slow: it starts processes), and the main job in
``tests/elastic/test_run_cli.py``; scripts (``python benchmarks/...``, ``python -m analysis...``)
have their options checked there against their ``--help``. A command no rule below covers fails
the test, so an example added to the README is checked too.
"""

from __future__ import annotations

import pytest

from oobleck.config import compose_config, validate
from oobleck.faults.schedule import build_schedule
from oobleck.run import sweep_points
from testing.readme import SCRIPT, Command, readme_commands, with_overrides

COMMANDS = readme_commands()
HYDRA_PROGRAMS = ("oobleck-run", "oobleck-plan", "oobleck-profile", "oobleck-simulate")
# Run for real elsewhere: the local training runs and the planner (seconds each).
RUN_FOR_REAL = ("oobleck-run", "oobleck-plan")
# Neither run nor composed: installing the package, and the test suite itself.
NOT_RUN = {"pip": "installs the package the tests run from", "python -m pytest": "the test suite itself"}
# The Slurm scripts pass their arguments to these programs after their own overrides
# (slurm/run.sbatch: cluster=slurm, the allocation's node count, job.resume=auto).
SBATCH_SCRIPTS = {"slurm/run.sbatch": "oobleck-run", "slurm/simulate.sbatch": "oobleck-simulate"}
# The one placeholder the README's commands hold, and what the check puts there.
PLACEHOLDERS = {"<partition>": "debug"}


def _hydra_program(program: str) -> str | None:
    """``oobleck-run`` for ``oobleck-run`` and ``python -m oobleck.run`` (likewise the others)."""
    name = "oobleck-" + program.removeprefix("python -m oobleck.") if program.startswith("python -m ") else program
    return name if name in HYDRA_PROGRAMS else None


def _kind(command: Command) -> str:
    if command.program in NOT_RUN:
        return "not run"
    if SCRIPT.match(command.program):  # options checked against --help in tests/test_readme_runs.py
        return "script"
    if command.program == "sbatch":
        return "sbatch"
    return "hydra" if _hydra_program(command.program) else "unknown"


def _fill(word: str) -> str:
    key, _, value = word.partition("=")
    return f"{key}={PLACEHOLDERS[value]}" if value in PLACEHOLDERS else word


def _sbatch(command: Command) -> tuple[str, tuple[str, ...]]:
    """An sbatch line's program (what its script runs) and the Hydra overrides it gets."""
    words = command.arguments
    script = next(w for w in words if w.endswith(".sbatch"))
    options, overrides = words[: words.index(script)], words[words.index(script) + 1 :]
    program = SBATCH_SCRIPTS[script]
    if program != "oobleck-run":
        return program, overrides
    nodes = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("cluster.nodes=")), None)
    if nodes is None:  # cluster.nodes follows the allocation (sbatch -N)
        nodes = int(next(options[i + 1] for i, o in enumerate(options) if o == "-N"))
    return program, ("cluster=slurm", *with_overrides(overrides, cluster__nodes=nodes), "job.resume=auto")


def _check(program: str, arguments: tuple[str, ...]) -> int:
    """Composes and validates every job of ``program arguments`` as the program does before it
    starts anything; returns the number of jobs checked."""
    sweep = "-m" in arguments or "--multirun" in arguments
    overrides = tuple(_fill(w) for w in arguments if not w.startswith("-"))
    points = sweep_points(overrides) if sweep else [list(overrides)]
    hydra = tuple(o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/")))
    for point in points:
        if hydra:  # Hydra's own settings (a launcher preset and its keys) compose with the job's
            compose_config(*hydra, *point, return_hydra_config=True)
        cfg = compose_config(*point)
        validate(cfg)
        if program == "oobleck-run":
            build_schedule(cfg.failures, nodes=int(cfg.cluster.nodes), steps=int(cfg.job.steps))
    return len(points)


def test_the_readme_has_its_examples():
    """The extraction finds the README's examples (a broken fence or reader would check nothing)."""
    programs = {c.program for c in COMMANDS}
    assert {"oobleck-run", "oobleck-plan", "oobleck-profile", "oobleck-simulate", "sbatch"} <= programs
    assert sum(c.program == "oobleck-run" for c in COMMANDS) >= 4


def test_commands_are_read_as_the_shell_reads_them():
    text = (
        "prose\n```bash\npip install . && oobleck-run failures=demo   # a comment\n"
        "oobleck-run a=1 \\\n    'b=[{x:1},{y:2}]'  # trace node k -> k\n```\n"
        "```python\nnot=a command\n```\n```bash\n# only a comment\n"
        "sbatch -N 4 slurm/run.sbatch c=3\n```\n"
    )
    commands = readme_commands(text)
    assert [(c.words, c.line) for c in commands] == [
        (("pip", "install", "."), 3),
        (("oobleck-run", "failures=demo"), 3),
        (("oobleck-run", "a=1", "b=[{x:1},{y:2}]"), 4),
        (("sbatch", "-N", "4", "slurm/run.sbatch", "c=3"), 12),
    ]
    assert [c.program for c in commands] == ["pip", "oobleck-run", "oobleck-run", "sbatch"]
    assert with_overrides(("job.steps=100", "a=1"), job__steps=3, b=2) == ("job.steps=3", "a=1", "b=2")


def test_every_command_is_covered_by_a_check():
    unknown = [str(c) for c in COMMANDS if _kind(c) == "unknown"]
    assert not unknown, f"README commands no check covers (add a rule to this module): {unknown}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) in ("hydra", "sbatch")], ids=str)
def test_every_hydra_command_composes_and_validates(command):
    """As written (a removed key, a misspelt option, a schedule striking more nodes than there are
    fails here); sbatch lines with the overrides their script adds."""
    if _kind(command) == "sbatch":
        program, arguments = _sbatch(command)
    else:
        program, arguments = str(_hydra_program(command.program)), command.arguments
    assert _check(program, arguments) >= 1


def test_the_check_fails_on_a_typo_and_on_an_impossible_schedule():
    """The check above can fail: a misspelt key, a group option that does not exist, and events
    striking more nodes than the run has are refused."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from oobleck.errors import ConfigError

    with pytest.raises((HydraException, OmegaConfBaseException)):
        _check("oobleck-run", ("job.stpes=3",))
    with pytest.raises((HydraException, OmegaConfBaseException)):
        _check("oobleck-simulate", ("experiment=paper_failure_frequenzy",))
    with pytest.raises(ConfigError, match="strikes more nodes"):
        _check(
            "oobleck-run", ("cluster.nodes=2", "failures=explicit", "failures.events=[{action:remove,step:1,count:3}]")
        )
    with pytest.raises((HydraException, OmegaConfBaseException)):
        _check(
            "oobleck-simulate",
            ("-m", "hydra/launcher=slurm_cpu", "hydra.launcher.partitio=debug", "sim.figures=false,true"),
        )
