"""Plain values of OmegaConf sections: the one place that narrows OmegaConf's container types
(``to_container`` and ``merge`` are typed as returning any container; of a mapping they return a
mapping)."""

from __future__ import annotations

import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf


def resolved_dict(section: DictConfig) -> dict[str, Any]:
    """A mapping section as a plain dict, interpolations resolved (a DictConfig always is one;
    OmegaConf types its result as any container)."""
    data = OmegaConf.to_container(section, resolve=True)
    assert isinstance(data, dict)
    return typing.cast("dict[str, Any]", data)


def merged(*parts: Any) -> DictConfig:
    """``OmegaConf.merge`` of mappings, which is a mapping (typed by OmegaConf as any container)."""
    result = OmegaConf.merge(*parts)
    assert isinstance(result, DictConfig)
    return result
