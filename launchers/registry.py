"""Which launcher serves a run: ``launcher_for`` maps the Hydra launcher choice (``hydra/launcher=...``, as
``.hydra/hydra.yaml`` and launch.json record it) to a ``launchers.protocol.Launcher``. A new launcher adds one
line to ``LAUNCHERS`` (and its conf/hydra/launcher/<choice>.yaml, and a Hydra plugin class in
hydra_plugins/disteval_launchers when Hydra must instantiate it); see docs/extending.md."""
from __future__ import annotations

from typing import Callable

from launchers.external import ExternalLauncher
from launchers.local import LocalLauncher
from launchers.protocol import Launcher


def _submitit(cluster: str) -> Callable[[], Launcher]:
    def make() -> Launcher:
        from launchers.scheduled import SubmititLauncher  # imports hydra-submitit-launcher: only when chosen

        return SubmititLauncher(cluster)
    return make


LAUNCHERS: dict[str, Callable[[], Launcher]] = {
    "basic": LocalLauncher,
    "submitit_slurm": _submitit("slurm"),
    "submitit_local": _submitit("local"),
}
"""Hydra launcher choice -> the launcher's factory."""


def launcher_for(choice: str | None) -> Launcher:
    """The launcher of a Hydra launcher choice: ``basic`` (or none, or one this registry does not know: Hydra
    then runs the jobs in process) is the local launcher. The submitit launchers are imported only here."""
    return LAUNCHERS.get(str(choice or "basic"), LocalLauncher)()


def launcher_of_job(record: dict, choice: str | None) -> Launcher:
    """The launcher that wrote a job record (RUN_DIR/job.json): its ``launcher`` field, else the run's Hydra
    choice when that is a scheduling launcher, else the SLURM launcher (the only one that wrote job.json before
    the field existed)."""
    named = record.get("launcher")
    named = named if isinstance(named, str) else None
    if named in LAUNCHERS:
        return launcher_for(named)
    by_choice = launcher_for(choice)
    return by_choice if by_choice.schedules else launcher_for("submitit_slurm")


def rank_launcher(choice: str | None, external: bool) -> Launcher:
    """Who starts this job's ranks: the external launcher when this process already is a rank (torchrun, srun,
    a task of a scheduler's job), else ``launcher_for(choice)``."""
    return ExternalLauncher() if external else launcher_for(choice)


def register_hydra_plugins() -> list[str]:
    """Register the Hydra launcher plugins of ``hydra_plugins.disteval_launchers`` (Hydra's plugin scan misses
    them under an editable install) and return the warning patterns to silence (the submitit configs share their
    names with hydra-submitit-launcher's schemas)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.disteval_launchers import PLUGINS, WARNINGS

    for plugin in PLUGINS:
        Plugins.instance().register(plugin)
    return list(WARNINGS)
