"""What every figure of ``analysis/`` shares: matplotlib without a display (files only, its INFO
lines kept out of run logs), the strategies' order and colours, the caption written under the
axes, the strategy legend, and ``save``, which writes a figure as PNG and PDF side by side."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
# Categorical axes log an INFO line per bar group; keep run logs to what matters.
logging.getLogger("matplotlib").setLevel(logging.WARNING)

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from analysis.labels import strategy_label  # noqa: E402

STRATEGY_ORDER = ("oobleck", "varuna", "bamboo", "torchft", "recycle")
PALETTE = {"oobleck": "#1b9e77", "varuna": "#d95f02", "bamboo": "#7570b3", "torchft": "#e7298a", "recycle": "#66a61e"}
CAPTION_SIZE = 7.5
DPI = 150  # PNG resolution; the PDF beside it is vector
FORMATS = (".png", ".pdf")


def strategies_in(frame: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(frame["strategy"]))
    return [s for s in STRATEGY_ORDER if s in present] + [s for s in present if s not in STRATEGY_ORDER]


def save(fig: plt.Figure, path: Path) -> list[Path]:
    """Write ``path`` as PNG and PDF (whatever suffix it has) and close the figure."""
    written = []
    for suffix in FORMATS:
        target = Path(path).with_suffix(suffix)
        fig.savefig(target, dpi=DPI, bbox_inches="tight")
        written.append(target)
    plt.close(fig)
    return written


def caption(fig: plt.Figure, text: str) -> None:
    """What the figure's marks mean, written on the figure under its axes."""
    fig.text(0.0, -0.01, text, ha="left", va="top", fontsize=CAPTION_SIZE, color="0.25", wrap=True)


def strategy_legend(
    fig: plt.Figure, strategies: list[str], extra: list[Patch] | None = None, *, y: float = 1.0
) -> None:
    handles = [Patch(color=PALETTE.get(s, "k"), label=strategy_label(s)) for s in strategies] + list(extra or [])
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, y), ncol=len(handles), frameon=False)
