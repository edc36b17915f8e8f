"""The model families, and the ``model:`` config section typed by its family (torch-free).

``model.family`` in ``conf/model/<name>.yaml`` names the family; that family's config dataclass
types the rest of the section (as a strategy's ``_target_`` types its section). Adding a family:
a package ``oobleck/models/<family>/`` whose ``__init__`` defines its config, its ``check`` and
its ``describe`` (``oobleck.models.architecture``) and whose ``model`` module builds its layers
(``spec(config, seed)``, see ``oobleck.models.spec``), one line in ``FAMILIES`` below, and its
``conf/model/*.yaml``. Nothing else in the harness names a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from oobleck.errors import ConfigError, unknown_key_message
from oobleck.models import gpt, llama
from oobleck.models.architecture import Architecture, ModelFamily
from oobleck.plain import resolved_dict

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (gpt.FAMILY, llama.FAMILY)}
# A model section without ``family`` is read as a GPT, so run dirs and profiles written without the
# key keep loading.
UNNAMED_FAMILY = "gpt"


def _as_dict(section: Any) -> dict[str, Any]:
    if isinstance(section, DictConfig):
        return resolved_dict(section)
    if isinstance(section, Mapping):
        return dict(section)
    raise ConfigError(f"model section {section!r} is not a mapping; choose model=<name> (conf/model/)")


def family_of(section: Any) -> ModelFamily:
    """The family a ``model:`` section (or a typed config of a family) belongs to."""
    if is_dataclass(section) and not isinstance(section, type):
        name = section.family  # type: ignore[attr-defined]
    else:
        name = _as_dict(section).get("family", UNNAMED_FAMILY)
    if name not in FAMILIES:
        raise ConfigError(
            f"model.family={name!r} is not a model family; set model.family to one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def model_config(section: Any) -> Any:
    """The typed, checked config (the family's frozen dataclass) of a ``model:`` section.

    Unknown keys, wrong types and missing values are ``ConfigError`` naming the key, the value and
    the family's keys; so are values the family does not allow (``ModelFamily.check``).
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

    family = family_of(section)
    if isinstance(section, family.config):
        family.check(section)
        return section
    data = {"family": family.name, **_as_dict(section)}
    name = data.get("name", "?")
    known = [f.name for f in fields(family.config)]
    where = f"(keys of a {family.name} model, conf/model/{name}.yaml)"
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(family.config), data))
    except MissingMandatoryValue as error:
        raise ConfigError(f"model.{error.full_key} is not set; conf/model/{name}.yaml must give it {where}") from None
    except (ConfigKeyError, ConfigAttributeError) as error:
        raise ConfigError(unknown_key_message(f"model.{error.full_key}", known, where)) from None
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", "") or ""
        message = str(error).splitlines()[0]
        raise ConfigError(f"model.{key}: {message}; see conf/model/{name}.yaml") from None
    family.check(config)
    return config


def architecture(section: Any) -> Architecture:
    """The torch-free description (layers, tied pair, per-layer costs) of a model section."""
    return family_of(section).describe(model_config(section))
