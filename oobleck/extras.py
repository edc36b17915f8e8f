"""The package's optional extras (``[project.optional-dependencies]`` in pyproject.toml) and the
one-line error a feature gives when it runs without the extra it needs, instead of a traceback
from deep inside an import."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from oobleck.errors import ConfigError

DISTRIBUTION = "oobleck-harness"


def missing(module: str) -> bool:
    """Whether ``module`` (dotted) cannot be imported here; a missing parent package counts."""
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def require(modules: Sequence[str], extra: str, feature: str) -> None:
    """Raise ``ConfigError`` naming ``extra`` when any of ``modules`` is not installed."""
    absent = [module for module in modules if missing(module)]
    if absent:
        raise ConfigError(
            f"{feature} needs the [{extra}] extra ({', '.join(absent)} not installed): "
            f"pip install '{DISTRIBUTION}[{extra}]', or pip install -e '.[{extra}]' in a checkout"
        )


# What Hydra needs to launch on Slurm: the launcher plugin, and submitit beneath it.
SLURM_LAUNCHER_MODULES = ("hydra_plugins.hydra_submitit_launcher", "submitit")


def check_launcher_overrides(arguments: Sequence[str]) -> None:
    """A ``hydra/launcher=<slurm preset or submitit_*>`` override needs the [slurm] extra."""
    for argument in arguments:
        key, _, value = argument.lstrip("+~").partition("=")
        if key == "hydra/launcher" and value.startswith(("slurm", "submitit")):
            require(SLURM_LAUNCHER_MODULES, "slurm", f"{argument} (sweeps as Slurm jobs)")
