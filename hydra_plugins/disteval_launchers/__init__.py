"""Hydra plugin registration for disteval's submitit launchers (Hydra instantiates launchers only from the
``hydra_plugins`` package). The logic lives in ``launchers/submitit.py``; the configs are
``conf/hydra/launcher/submitit_slurm.yaml`` and ``submitit_local.yaml`` (found before the stock
hydra-submitit-launcher entries of the same names, because conf/ precedes structured configs in Hydra's
search path). ``PLUGINS`` and ``WARNINGS`` are what ``launchers.registry.register_hydra_plugins`` registers."""
from launchers.submitit import SCHEMA_WARNING, DistevalSubmititLauncher


class SlurmLauncher(DistevalSubmititLauncher):
    _EXECUTOR = "slurm"


class LocalLauncher(DistevalSubmititLauncher):
    _EXECUTOR = "local"


PLUGINS = (SlurmLauncher, LocalLauncher)
WARNINGS = (SCHEMA_WARNING,)
