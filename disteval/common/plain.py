"""Config values as plain JSON-able Python values, for records and digests (a leaf: the rank's typed
``disteval.config.JobConfig``, a Hydra DictConfig and plain values alike)."""
from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

from omegaconf import OmegaConf


def plain(value: Any) -> Any:
    """``value`` as plain values: a config dataclass instance or a DictConfig/ListConfig becomes dicts and lists
    (resolved, enums as their values), an enum member its value, anything else itself."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return OmegaConf.to_container(OmegaConf.structured(value), resolve=True, enum_to_str=True)
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, Enum):
        return value.value
    return value
