"""Remedies as Hydra overrides (plus, for launch problems, environment variables), and the command that
applies one to a run."""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Remedy:
    """What to change: ``overrides`` (Hydra ``key=value``), ``env`` (variables every rank must see, for
    problems outside the config such as a per-rank MASTER_PORT) and ``why`` (one line)."""

    overrides: list[str]
    why: str
    env: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)  # environment variables to remove

    def key(self) -> tuple:
        """Identity for "never the same (failure, remedy) pair twice"."""
        return tuple(sorted(self.overrides)), tuple(sorted(self.env.items())), tuple(sorted(self.unset))

    def describe(self) -> str:
        parts = self.overrides + [f"{k}={v}" for k, v in self.env.items()] + [f"unset {k}" for k in self.unset]
        return " ".join(parts) or "a plain rerun"

    def as_dict(self) -> dict:
        return {"overrides": list(self.overrides), "env": dict(self.env), "unset": list(self.unset), "why": self.why}


def override_key(override: str) -> str:
    """``+data.limit=5`` -> ``data.limit``; ``hydra.run.dir=x`` -> ``hydra.run.dir``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: list[str], changes: list[str]) -> list[str]:
    """``base`` with every key that ``changes`` sets replaced (in place, keeping order) or appended.
    ``hydra.run.dir`` / ``hydra.sweep.dir`` of ``base`` are dropped (a rerun gets its own directory)."""
    out = [o for o in base if override_key(o) not in ("hydra.run.dir", "hydra.sweep.dir", "hydra.job.chdir")]
    for change in changes:
        key = override_key(change)
        plain = change.lstrip("+~")
        hits = [i for i, o in enumerate(out) if override_key(o) == key]
        if hits:
            keep_plus = out[hits[0]].startswith("+") and not out[hits[0]].startswith("++")
            out[hits[0]] = ("+" if keep_plus else "") + plain
        else:
            out.append(change)
    return out


def run_overrides(run) -> list[str]:
    """The overrides that recreate ``run`` with ``python -m disteval``: Hydra's task overrides, plus the world
    size when an external launcher (torchrun, srun) chose it rather than ``dist.world_size``."""
    base = list(run.overrides)
    if run.launch is None and run.world_size and run.cfg("dist.world_size") not in (None, run.world_size):
        base = merge_overrides(base, [f"dist.world_size={run.world_size}"])
    return base


def rerun_command(overrides: list[str], run_dir: Path | None = None, env: dict[str, str] | None = None) -> list[str]:
    """argv of ``python -m disteval OVERRIDES [hydra.run.dir=RUN_DIR]``."""
    argv = [sys.executable, "-m", "disteval", *overrides]
    if run_dir is not None:
        argv.append(f"hydra.run.dir={run_dir}")
    return argv


def shell_line(argv: list[str], env: dict[str, str] | None = None, unset: list[str] | None = None) -> str:
    """A ready-to-paste shell line (``[env -u VAR] VAR=value python -m disteval ...``), words quoted as needed."""
    prefix = (["env"] + [f"-u {shlex.quote(k)}" for k in sorted(unset)] if unset else [])
    prefix += [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    words = ["python" if a == sys.executable else a for a in argv]
    return " ".join(prefix + [shlex.quote(w) for w in words])
