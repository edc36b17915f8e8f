"""The analysis notebooks: jupytext percent scripts (``NN_name.py``, the source of truth in git)
run as notebooks with papermill-style parameters.

Each notebook has one cell tagged ``parameters``; ``build(name, parameters)`` reads the script as a
notebook (jupytext) and inserts an ``injected-parameters`` cell after it, as papermill does, and
``execute`` runs it headless (nbclient) and writes the executed ``.ipynb``. Outputs live only in
executed copies, never in git. From a shell::

    python -m analysis.notebooks list
    python -m analysis.notebooks run 01_paper_figures -p sim_dirs='["outputs/sim/..."]' --out paper.ipynb

or open a script in Jupyter (``jupytext --to ipynb analysis/notebooks/01_paper_figures.py``), or
with papermill on that ``.ipynb``.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oobleck.errors import ConfigError, RunError
from oobleck.extras import require

HERE = Path(__file__).resolve().parent
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
# What building and executing a notebook imports (the [analysis] extra).
NOTEBOOK_MODULES = ("jupytext", "nbformat", "nbclient", "ipykernel")


def names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("[0-9][0-9]_*.py"))


def notebook_path(name: str) -> Path:
    path = HERE / f"{Path(name).stem}.py"
    if not path.is_file():
        raise ConfigError(f"no notebook {name!r} in {HERE}; use one of: {', '.join(names())}")
    return path


def parse_value(text: str) -> Any:
    """A ``-p key=value`` value: a Python literal when it parses as one, else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def build(name: str, parameters: Mapping[str, Any] | None = None) -> Any:
    """The notebook ``name`` with ``parameters`` injected after its parameters cell."""
    require(NOTEBOOK_MODULES, "analysis", "the analysis notebooks")
    import jupytext
    import nbformat

    notebook = jupytext.read(notebook_path(name))
    cells = notebook.cells
    tagged = [i for i, cell in enumerate(cells) if PARAMETERS_TAG in cell.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise RunError(f"{notebook_path(name)}: expected one cell tagged {PARAMETERS_TAG!r}, found {len(tagged)}")
    declared = _assigned(cells[tagged[0]].source)
    unknown = sorted(set(parameters or {}) - declared)
    if unknown:
        raise ConfigError(
            f"notebook {name} has no parameter {', '.join(unknown)}; its parameters: {', '.join(sorted(declared))}"
        )
    if parameters:
        source = "# Parameters\n" + "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED_TAG]})
        cells.insert(tagged[0] + 1, cell)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def _assigned(source: str) -> set[str]:
    return {
        target.id
        for node in ast.parse(source).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }


def _kernel_environment() -> dict[str, str]:
    """The kernel's environment: ours, with this checkout first on ``PYTHONPATH`` so a notebook
    imports the same ``analysis`` and ``oobleck`` as the caller, installed or not."""
    root = str(HERE.parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join([root, path])}


def execute(
    name: str,
    parameters: Mapping[str, Any] | None = None,
    *,
    out: str | Path | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 600.0,
) -> Any:
    """Run the notebook headless in ``cwd``; write the executed notebook to ``out`` if given.
    A failing cell raises ``RunError`` with the cell's error (the partial notebook is still written)."""
    require(NOTEBOOK_MODULES, "analysis", "the analysis notebooks")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = build(name, parameters)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=timeout_s,
        resources={"metadata": {"path": str(Path(cwd or ".").resolve())}},
    )
    try:
        client.execute(env=_kernel_environment())
    except CellExecutionError as error:
        raise RunError(f"notebook {name} failed: {str(error).strip().splitlines()[-1]}") from None
    finally:
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, str(out))
    return notebook
