"""Packaging beside ``pyproject.toml`` (which holds the metadata): which packages the wheel holds.

Everything is found automatically except the config tree: ``conf/`` stays at the top of the
repository (the layout is part of the contract) and is shipped inside the package as
``oobleck/conf``, so an installed ``oobleck-run`` (or ``python -m oobleck.run``) finds its configs
from any directory. ``oobleck.schema.CONF_DIR`` looks there first and falls back to the checkout's
``conf/`` (an editable install).
"""

from setuptools import find_namespace_packages, setup

PACKAGES = find_namespace_packages(
    include=["oobleck", "oobleck.*", "baselines", "baselines.*", "analysis", "analysis.*"], exclude=["*.__pycache__"]
)

setup(packages=[*PACKAGES, "oobleck.conf"], package_dir={"oobleck.conf": "conf"})
