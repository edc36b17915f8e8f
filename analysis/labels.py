"""Names a reader sees in figures and tables: ``gpt3_2_7b`` -> "GPT-3 2.7B",
``spot/ec2_p3_scaled`` -> "EC2 p3 spot", ``synthetic/10m`` -> "node lost every 10m", ``varuna`` ->
"Varuna". Unknown names pass through unchanged, so a new model or trace still gets a title."""

from __future__ import annotations

import re
from pathlib import Path

STRATEGY_NAMES = {
    "oobleck": "Oobleck",
    "varuna": "Varuna",
    "bamboo": "Bamboo",
    "torchft": "torchft",
    "recycle": "ReCycle",
}
MODEL_NAMES = {"bert_large": "BERT-large"}
_GPT = re.compile(r"^gpt(?P<version>\d)_(?P<size>.+)$")
_SIZE = re.compile(r"^(?P<whole>\d+)(?:_(?P<fraction>\d+))?(?P<unit>[mb])$")


def model_label(name: str) -> str:
    """``gpt3_2_7b`` -> "GPT-3 2.7B", ``gpt3_medium`` -> "GPT-3 medium", ``gpt2_small`` -> "GPT-2 small",
    ``bert_large`` -> "BERT-large"."""
    if str(name) in MODEL_NAMES:
        return MODEL_NAMES[str(name)]
    match = _GPT.match(str(name))
    if not match:
        return str(name)
    size = match["size"]
    number = _SIZE.match(size)
    if number:
        value = number["whole"] + (f".{number['fraction']}" if number["fraction"] else "")
        size = value + number["unit"].upper()
    return f"GPT-{match['version']} {size.replace('_', ' ')}"


def trace_label(trace: str, *, short: bool = False) -> str:
    """``synthetic/10m`` -> "node lost every 10m" (short: "10m"), ``spot/gcp_a2_scaled`` -> "GCP a2 spot",
    a trace file path -> its file name without the extension."""
    text = str(trace)
    family, _, name = text.rpartition("/")
    if family == "synthetic":
        return name if short else f"node lost every {name}"
    if family == "spot":
        # <provider>_<instance>_<scaled|raw>: the shipped traces (oobleck/faults/traces/README.md)
        *parts, variant = name.split("_")
        if variant not in ("scaled", "raw"):
            parts, variant = [*parts, variant], "scaled"
        provider, *rest = parts
        return " ".join([provider.upper(), *rest, "spot"]) + (" (raw)" if variant == "raw" else "")
    if "/" in text or text.endswith(".csv"):
        return Path(text).stem
    return text


def strategy_label(name: str) -> str:
    return STRATEGY_NAMES.get(str(name), str(name))
