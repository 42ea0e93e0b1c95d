"""Several checkpoints evaluated in one job (``model.checkpoints``): the list or glob pattern expanded to
files, each file named, and the networks held together so that one loop forwards every batch through each.

Sharing the job means one process start, one process group, one dataset read and one decode of every batch
for all checkpoints; each checkpoint's metrics are the bits its own job would give (the same batches in the
same order reach each network and its own metric states).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from disteval.errors import ConfigError

KEY = "model.checkpoints"


@dataclass(frozen=True)
class Member:
    """One checkpoint of the set: ``name`` (unique, no ``.``: it prefixes metric state names and labels the
    results block) and ``path`` (absolute)."""

    name: str
    path: str


def _patterns(spec: Any) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec] if spec.strip() else []
    if OmegaConf.is_list(spec) or isinstance(spec, (list, tuple)):
        items = list(spec)
        bad = [i for i in items if not isinstance(i, str) or not i.strip()]
        if bad:
            raise ConfigError(KEY, f"every entry must be a path or a glob pattern, got {bad[:3]}")
        return [str(i) for i in items]
    raise ConfigError(KEY, f"a list of paths or one glob pattern, got {type(spec).__name__}")


def _names(paths: list[str]) -> list[str]:
    """File stems, made unique by prefixing parent folders where stems repeat; ``.``, ``/`` and other
    characters outside [A-Za-z0-9_-] become ``_``; names that still coincide (``x.y.pt`` and ``x_y.pt``) get
    ``-2``, ``-3``, ... in the order listed."""
    for depth in range(1, 17):
        names = ["_".join(os.path.normpath(os.path.splitext(p)[0]).split(os.sep)[-depth:]) for p in paths]
        names = [re.sub(r"[^A-Za-z0-9_-]", "_", n) for n in names]
        if len(set(names)) == len(names):
            return names
    names = [re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(p))[0]) for p in paths]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}-{seen[n]}")
    return out


def expand_checkpoints(spec: Any) -> list[Member]:
    """``model.checkpoints`` as members, in the order listed (the files a glob pattern matches, sorted).

    ``spec``: None or [] (not set: an empty list), a string (one path or glob pattern such as
    ``ckpts/epoch_*.pt``) or a list of paths/patterns. Raises ConfigError naming ``model.checkpoints`` when a
    pattern matches no file, an entry is not a file, a file is listed twice, or fewer than two files result
    (one checkpoint is ``model.checkpoint``)."""
    paths: list[str] = []
    for pattern in _patterns(spec):
        if glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(p))
            if not found:
                raise ConfigError(KEY, f"the pattern {pattern!r} matches no file (working directory {os.getcwd()})")
            paths.extend(found)
        elif not os.path.isfile(os.path.expanduser(pattern)):
            what = "is not a file" if os.path.exists(pattern) else "does not exist"
            raise ConfigError(KEY, f"checkpoint {pattern!r} {what} (working directory {os.getcwd()})")
        else:
            paths.append(os.path.expanduser(pattern))
    real = [os.path.realpath(p) for p in paths]
    twice = sorted({p for p in paths if real.count(os.path.realpath(p)) > 1})
    if twice:
        raise ConfigError(KEY, f"listed more than once: {twice}")
    if len(paths) == 1:
        raise ConfigError(KEY, f"one checkpoint ({paths[0]!r}): use model.checkpoint for a single file")
    return [Member(n, os.path.abspath(p)) for n, p in zip(_names(paths), paths)]


def with_checkpoint(cfg: Any, path: str) -> Any:
    """A copy of the job config (a ``disteval.config.JobConfig``) that evaluates the one checkpoint ``path``
    (``model.checkpoint=path``, ``model.checkpoints`` unset): what the member's own job would be."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=path, checkpoints=None))


class ModelSet(nn.Module):
    """The networks of a checkpoint set, by member name (``members``: an ``nn.ModuleDict`` in the set's
    order). ``forward(x)`` returns a tuple of each network's output, in order; the engine's step instead calls
    the task's step once per member, so that each network gets the task's own pre- and post-processing."""

    def __init__(self, models: dict[str, nn.Module]):
        super().__init__()
        self.members = nn.ModuleDict(models)

    def forward(self, x):  # noqa: D102 - documented on the class
        return tuple(m(x) for m in self.members.values())
