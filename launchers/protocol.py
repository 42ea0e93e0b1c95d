"""The launcher protocol: what every way of starting a run's ranks implements, so that the entry point
(``disteval.driver.cli``), the ranks (bootstrap, resume, engine) and the doctor name no launcher.

A launcher answers, for one run:

- **start ranks** (``start_ranks``): run the job's ranks and wait (local processes, this process as one rank of
  an external launcher, or tasks of a scheduler's job);
- **hand over a run** (``run_job``, when ``hands_over_run_mode``): ``python -m disteval`` without ``-m`` gives
  the one job to the launcher, which runs it elsewhere and reports its outcome;
- **the rank's environment** (``export_rank_env``): inside a task it started, the variables of
  ``disteval.common.launch_env`` (job id, node rank, the preemption signal) besides torch's RANK/WORLD_SIZE;
- **world shape** (``world_shape``): nodes x ranks per node for a world size;
- **the preemption signal** (``preempt_signal``): the signal after which its scheduler requeues the job (None:
  it does not requeue);
- **a probe** (``run_probe``): the doctor's probe ranks, started the way the run's ranks were;
- **a rerun** (``schedules``): ``doctor --apply`` reruns through the launcher (its Hydra overrides are kept), and
  a scheduler places a multi-node rerun itself; ``scheduler_view``: what the scheduler's records say of a job
  that did not complete, for the doctor.

Implementations: ``launchers.local.LocalLauncher`` (local rank processes, one node or a torchrun-style
multi-node rendezvous), ``launchers.external.ExternalLauncher`` (this process is one rank of torchrun, srun or a
scheduler's task) and ``launchers.scheduled.SubmititLauncher``; ``launchers.registry.launcher_for`` picks one
from the Hydra launcher choice. docs/extending.md shows how to add one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar


@dataclass(frozen=True)
class ProbeRequest:
    """The doctor's probe ranks for one run: ``entry(container, out_dir, payload_bytes)`` on each of ``world_size``
    ranks; ``launcher_options``: the run's ``hydra.launcher`` settings (plain values; local ranks meet at the
    container's ``dist.master_addr``)."""
    entry: Callable[[dict, str, int], None]
    container: dict
    out_dir: Path
    payload_bytes: int
    world_size: int
    launcher_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerNote:
    """One thing a scheduler's records say of a job that did not complete (``Launcher.scheduler_view``), for the
    doctor to turn into a finding: ``kind`` is ``time_limit``, ``out_of_memory``, ``node_fail``, ``stopped``
    (cancelled, preempted, boot failure), ``task_start`` (tasks could not be started on a node) or ``ended``;
    ``state`` the scheduler's word for it; ``evidence``: (path relative to the run directory, line or None,
    value) triples; ``overrides``: a change that addresses it (e.g. a longer time limit), ``advice`` the words;
    ``nodes``: the hosts involved; ``node_hint``: where to look on a failed node (its logs)."""
    kind: str
    state: str
    message: str
    evidence: tuple[tuple[str, int | None, str], ...] = ()
    overrides: tuple[str, ...] = ()
    advice: str = ""
    nodes: tuple[str, ...] = ()
    node_hint: str = ""


class Launcher(ABC):
    """One way of starting a run's ranks (see the module docstring). Subclasses set the class attributes and
    implement ``start_ranks``; the other methods have the answers of a launcher without a scheduler."""

    name: ClassVar[str] = ""
    """How results.json, launch.json and the doctor name it (``local``, ``external``, ``submitit_slurm``, ...)."""
    hydra_choices: ClassVar[tuple[str, ...]] = ()
    """The ``hydra/launcher=`` choices it serves (``conf/hydra/launcher/<choice>.yaml``)."""
    scheduler: ClassVar[str | None] = None
    """The scheduler's name in messages ("SLURM"); None for a launcher without a scheduler."""
    hands_over_run_mode: ClassVar[bool] = False
    """Without ``-m``, ``python -m disteval`` hands the one job to ``run_job`` (it runs elsewhere)."""
    runs_sweep_jobs_in_process: ClassVar[bool] = True
    """A multirun's jobs run in the driver's process one after the other (Hydra's basic launcher)."""

    @property
    def schedules(self) -> bool:
        """A scheduler places and reruns the ranks: ``doctor --apply`` resubmits through it, a multi-node rerun
        needs no command per node."""
        return self.scheduler is not None

    @abstractmethod
    def start_ranks(self, cfg: Any, job: Any, container: dict, run_dir: str, choice: Any,
                    on_agent_stuck: Callable[[BaseException], None] | None = None) -> None:
        """Run the job's ranks (``job``: the validated JobConfig, ``container``: its plain form) for the run
        directory ``run_dir`` and wait. ``choice``: the resolved ``dist.allocator`` (None where the ranks already
        exist). Raises RankFailedError naming the culprit rank, RunInterrupted on SIGINT/SIGTERM."""

    def run_job(self, task_function: Callable[..., Any]) -> int:
        """Hand the composed one-job run (Hydra's RUN mode) to the launcher; returns the exit code."""
        raise NotImplementedError(f"the {self.name} launcher runs a job in this process")

    def export_rank_env(self) -> None:
        """Inside a task this launcher started: export torch's rank variables and ``disteval.common.launch_env``'s."""

    def world_shape(self, world_size: int, ranks_per_node: int | None, gpus_per_node: int | None) -> tuple[int, int]:
        """(nodes, ranks per node) for ``world_size`` ranks: one node unless ``ranks_per_node`` says otherwise."""
        per_node = int(ranks_per_node or world_size)
        return -(-int(world_size) // per_node), per_node

    def preempt_signal(self) -> str | None:
        """The signal's name (without SIG) after which the scheduler requeues the job; None: no requeue."""
        return None

    @abstractmethod
    def run_probe(self, request: ProbeRequest) -> None:
        """Start the doctor's probe ranks (``request``) the way this launcher starts a run's ranks, and wait.
        Raises RankFailedError (or the scheduler's error) when a probe rank fails."""

    def scheduler_view(self, run_dir: Path, job: dict, hydra: Any) -> SchedulerNote | None:
        """What the scheduler's records say of a job that did not complete (``job``: RUN_DIR/job.json, ``hydra``:
        the run's .hydra/hydra.yaml or None); None when there is nothing of the scheduler's to say."""
        return None
