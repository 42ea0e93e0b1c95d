"""What the SLURM launcher asks of the cluster before it submits anything: the client commands, a controller
that answers, and room for each job's shape. Every check reads the scheduler's own tools (``scontrol ping``,
``sinfo``); nothing is submitted.

- ``cluster_problem()``: None when ``sbatch``/``srun``/``sacct`` are on PATH and ``scontrol ping`` says the
  controller is UP, else one sentence naming what is missing and how to get it (submit from the cluster's
  login node, or start the local single-node cluster that the tests use).
- ``Capacity.query(partition)`` then ``capacity.shape_problem(nodes, tasks_per_node, cpus_per_task)``: None when
  a job of that shape fits the partition's nodes (node count and CPUs per node, as ``sinfo`` reports them),
  else why not, with the largest shape that fits. sbatch refuses such a job at submission (``Requested node
  configuration is not available``); checking every job first keeps a sweep from being half submitted.
- ``PendingWatch``: while the driver waits, why a submitted job pends (``squeue``), said once it has pended a
  while and again when the reason changes (a job requeued after its node died waits for it: ReqNodeNotAvail).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

CLIENTS = ("sbatch", "srun", "sacct", "scontrol", "sinfo")
START_LOCAL = ("start the local single-node cluster (as root: `bash scripts/slurm/start_cluster.sh`), or run "
               "without hydra/launcher=submitit_slurm (local ranks)")
TIMEOUT_S = 20.0


def _run(argv: list[str]) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a scheduler command, 124 when it did not answer within TIMEOUT_S."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {TIMEOUT_S:.0f} s"
    except OSError as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def cluster_problem() -> str | None:
    """None when this machine can submit SLURM jobs: the client commands are on PATH and the controller
    answers ``scontrol ping``; else what is missing and what to do."""
    missing = [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return (f"hydra/launcher=submitit_slurm needs a SLURM cluster, and this machine has no "
                f"{', '.join(missing)} on PATH (it is not a SLURM submit host): submit from a login node of your "
                f"cluster, or {START_LOCAL}")
    code, out = _run(["scontrol", "ping"])
    if code != 0 or " is UP" not in out:
        said = " ".join(out.split())[:300] or f"exit code {code}"
        return (f"hydra/launcher=submitit_slurm: the SLURM controller does not answer (`scontrol ping`: {said}); "
                f"check that slurmctld runs and that SLURM_CONF / /etc/slurm/slurm.conf names it, or {START_LOCAL}")
    return None


@dataclass(frozen=True)
class Capacity:
    """The nodes of a partition as ``sinfo`` reports them: ``cpus`` per node (one entry per node, any state but
    down/drained), ``partition`` the name asked for (None: the default partition)."""

    partition: str | None
    cpus: tuple[int, ...]

    @classmethod
    def query(cls, partition: str | None) -> "Capacity | None":
        """The partition's usable nodes, or None when ``sinfo`` cannot tell (then nothing is refused here and
        sbatch has the last word)."""
        argv = ["sinfo", "-h", "-N", "-o", "%N %c %t"] + (["-p", partition] if partition else [])
        code, out = _run(argv)
        if code != 0:
            return None
        cpus: dict[str, int] = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit() and not parts[2].rstrip("*~#!%$@^-").startswith(
                    ("down", "drain", "fail", "inval")):
                cpus[parts[0]] = int(parts[1])
        return cls(partition, tuple(cpus.values())) if cpus else None

    def shape_problem(self, nodes: int, tasks_per_node: int, cpus_per_task: int | None) -> str | None:
        """None when ``nodes`` x ``tasks_per_node`` tasks of ``cpus_per_task`` CPUs (None: 1) fit; else why not."""
        need = tasks_per_node * (cpus_per_task or 1)
        fitting = sorted((c for c in self.cpus if c >= need), reverse=True)
        if len(fitting) >= nodes:
            return None
        where = f"partition {self.partition}" if self.partition else "the default partition"
        ranks = sum(c // (cpus_per_task or 1) for c in self.cpus)
        return (f"needs {nodes} node(s) with {need} CPUs each ({tasks_per_node} rank(s) x {cpus_per_task or 1} "
                f"CPU(s)), and {where} has {len(self.cpus)} usable node(s) with at most {max(self.cpus)} CPUs: at "
                f"most {ranks} rank(s) fit (set dist.world_size, dist.ranks_per_node or "
                "hydra.launcher.cpus_per_task to fit)")


def queue_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job still in the queue (``squeue -h -j ID -o %T|%r``: e.g. ("PENDING",
    "ReqNodeNotAvail, UnavailableNodes:n2")), None when squeue does not list it (ended, or no answer)."""
    code, out = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"])
    line = out.splitlines()[0] if code == 0 and out else ""
    state, sep, reason = line.partition("|")
    return (state.strip(), reason.strip()) if sep else None


class PendingWatch:
    """Says, while the driver waits for a job, why the job does not run: once it has pended ``after_s`` seconds
    (a queue wait, a hold, a requeue after a node died that waits for the node: ReqNodeNotAvail), and again
    whenever the reason changes. ``say``: where the line goes (the console)."""

    def __init__(self, job_id: str, say, after_s: float = 10.0):
        self.job_id, self.say, self.after_s = str(job_id), say, after_s
        self.since: float | None = None
        self.ran = False
        self.said: tuple[str, str] | None = None

    def poll(self, now: float) -> None:
        """One look at the queue (``now``: time.monotonic())."""
        found = queue_state(self.job_id)
        if found is None or found[0] != "PENDING":
            self.ran = self.ran or (found is not None and found[0] in ("RUNNING", "COMPLETING"))
            self.since = None
            return
        self.since = now if self.since is None else self.since
        if now - self.since >= self.after_s and found != self.said:
            self.said = found
            what = "was requeued and is pending" if self.ran else "is pending"
            self.say(f"SLURM job {self.job_id} {what} for {now - self.since:.0f} s: {found[1] or 'no reason given'} "
                     f"(the driver keeps waiting; `scancel {self.job_id}` stops the job)")


__all__ = ["CLIENTS", "Capacity", "PendingWatch", "cluster_problem", "queue_state"]
