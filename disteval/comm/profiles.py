"""Hardware profiles: communication defaults chosen by device name from a table in the config (not code)."""
from __future__ import annotations

import torch

from disteval.errors import ConfigError

PROFILE_KEYS = ("backend", "timeout_s", "sync_timeout_s", "compression")


def device_name() -> str:
    """``torch.cuda.get_device_name(0)`` on a CUDA machine, else ``"cpu"``."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def select_profile(profiles: list[dict], profile: str, device: str) -> dict | None:
    """The profile to apply: None for ``none``; for ``auto`` the first whose ``match`` substrings occur in
    ``device`` (case-insensitive); else the profile with that name. Raises ConfigError naming
    communication.profile when none fits."""
    if profile == "none":
        return None
    if profile == "auto":
        for p in profiles:
            if any(str(m).lower() in device.lower() for m in p.get("match", [])):
                return p
        raise ConfigError("communication.profile", f"no profile in communication.profiles matches device "
                          f"{device!r}; add one or set communication.profile=none")
    for p in profiles:
        if p.get("name") == profile:
            return p
    raise ConfigError("communication.profile", f"unknown profile {profile!r}; available: "
                      f"{['none', 'auto'] + [p.get('name') for p in profiles]}")


def apply_profile(container: dict, explicit: set[str], device: str | None = None) -> dict | None:
    """Set the selected profile's values on ``container["communication"]`` for the keys not in ``explicit``
    (dotted keys the user overrode, e.g. ``communication.timeout_s``). Returns the record for results.json:
    ``{"name", "device", "applied": {key: value}}``, or None when no profile is in force."""
    comm = container["communication"]
    device = device or device_name()
    chosen = select_profile(comm["profiles"] or [], str(comm["profile"]), device)
    if chosen is None:
        return None
    applied = {}
    for key in PROFILE_KEYS:
        if key in chosen and f"communication.{key}" not in explicit:
            comm[key] = chosen[key]
            applied[key] = chosen[key]
    return {"name": chosen.get("name"), "device": device, "applied": applied}
