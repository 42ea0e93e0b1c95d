"""Remedies as Hydra overrides (plus, for launch problems, environment variables), and the command that
applies one to a run."""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from disteval.job.journal import MANIFEST, NOT_IDENTITY


@dataclass
class Remedy:
    """What to change: ``overrides`` (Hydra ``key=value``), ``env`` (variables every rank must see, for
    problems outside the config such as a per-rank MASTER_PORT) and ``why`` (one line).

    ``changes_cause``: whether applying it (``doctor --apply``) can change what the evidence names as the
    cause. True for a change of the setting the evidence points at, and for a plain rerun when the evidence
    shows the cause came from outside the run and has passed (an interrupt, a preemption). False for advice
    that only a person can carry out (free disk space, fetch a file, add ``-m``), for a diagnostic rerun
    that only reports more, and wherever the evidence does not say why: ``--apply`` refuses those."""

    overrides: list[str]
    why: str
    env: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)  # environment variables to remove
    changes_cause: bool = True

    def key(self) -> tuple:
        """Identity for "never the same (failure, remedy) pair twice"."""
        return tuple(sorted(self.overrides)), tuple(sorted(self.env.items())), tuple(sorted(self.unset))

    @property
    def changes_anything(self) -> bool:
        """Whether a rerun with it differs from the run (an override, a variable set or removed)."""
        return bool(self.overrides or self.env or self.unset)

    def describe(self) -> str:
        parts = self.overrides + [f"{k}={v}" for k, v in self.env.items()] + [f"unset {k}" for k in self.unset]
        return " ".join(parts) or ("a plain rerun" if self.changes_cause else "nothing to rerun with (by hand)")

    def as_dict(self) -> dict:
        return {"overrides": list(self.overrides), "env": dict(self.env), "unset": list(self.unset), "why": self.why,
                "changes_cause": self.changes_cause}


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


def launcher_choice(run) -> str:
    """The run's Hydra launcher choice (``basic`` unless the run chose another) from .hydra/hydra.yaml."""
    if run.hydra is None:
        return (run.launch or {}).get("hydra_launcher") or "basic"
    return str(OmegaConf.select(run.hydra, "hydra.runtime.choices", default={}).get("hydra/launcher") or "basic")


def launcher_overrides(run) -> list[str]:
    """The run's Hydra launcher choice and settings (``hydra/launcher=<choice>``, ``hydra.launcher.*``) from
    .hydra/hydra.yaml: Hydra keeps them apart from the task's overrides, and a rerun without them would run
    on this machine instead of resubmitting to the scheduler."""
    if run.hydra is None:
        return []
    given = OmegaConf.select(run.hydra, "hydra.overrides.hydra", default=None) or []
    return [str(o) for o in given
            if override_key(str(o)) == "hydra/launcher" or override_key(str(o)).startswith("hydra.launcher.")]


def run_overrides(run) -> list[str]:
    """The overrides that recreate ``run`` with ``python -m disteval``: the launcher's (``launcher_overrides``),
    Hydra's task overrides, plus the world size when an external launcher (torchrun, srun) chose it rather than
    ``dist.world_size``."""
    base = launcher_overrides(run) + [o for o in run.overrides if override_key(o) != "hydra/launcher"]
    if run.launch is None and run.world_size and run.cfg("dist.world_size") not in (None, run.world_size):
        base = merge_overrides(base, [f"dist.world_size={run.world_size}"])
    return base


def with_resume(run, overrides: list[str]) -> list[str]:
    """``overrides`` plus ``eval.resume=RUN_DIR`` when ``run`` (a ``Run``) recorded progress and did not finish
    (``disteval.job.journal``) and none of ``overrides`` changes a setting its numbers depend on: the rerun then
    evaluates only what the run did not record. ``overrides`` as they are otherwise (an explicit
    ``eval.resume`` among them is kept)."""
    path = Path(run.path)
    if (path / "results.json").exists() or not (path / MANIFEST).is_file() or \
            not any(path.glob("ranks/rank*/journal/*.pt")):
        return overrides
    keys = [override_key(o) for o in overrides]
    if "eval.resume" in keys:
        return overrides
    before = run_overrides(run)
    changed = {override_key(o) for o in overrides if o not in before}
    if any(not any(k == x or k.startswith(x + ".") for x in NOT_IDENTITY) and not k.startswith("hydra")
           for k in changed):
        return overrides
    return [*overrides, f"eval.resume={path}"]


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
