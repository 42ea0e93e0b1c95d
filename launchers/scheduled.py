"""The submitit launchers (``hydra/launcher=submitit_slurm`` and ``submitit_local``) as the launcher protocol
sees them: one submitit task per rank (``launchers.submitit`` does the submitting); in a task, the rank runs as
an external rank; the doctor's probes go through the same executor; the scheduler's account of a job that did
not complete (RUN_DIR/job.json, submitit's logs) becomes a ``SchedulerNote``."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from launchers import submitit as jobs
from launchers.external import ExternalLauncher
from launchers.protocol import ProbeRequest, SchedulerNote

_SRUN_LAUNCH = re.compile(r"srun: error: Task launch for StepId=(\S+) failed on node (\S+?): (.+)")
_STEPD = re.compile(r"slurmstepd-(\S+?):")


class SubmititLauncher(ExternalLauncher):
    """Ranks as the tasks of a submitit job: on SLURM (``cluster="slurm"``) or as local processes
    (``cluster="local"``). Inside a task the rank runs as an external rank (``ExternalLauncher.start_ranks``)."""

    hands_over_run_mode = True
    runs_sweep_jobs_in_process = False

    def __init__(self, cluster: str):
        self.cluster = cluster
        self.name = f"submitit_{cluster}"
        self.hydra_choices = (self.name,)
        self.scheduler = "SLURM" if cluster == "slurm" else "submitit's local executor"

    def run_job(self, task_function: Callable[..., Any]) -> int:
        """The one job as a one-job sweep in the run directory (``launchers.submitit.submit_run``)."""
        return jobs.submit_run(task_function)

    def export_rank_env(self) -> None:
        jobs.export_rank_env()

    def world_shape(self, world_size: int, ranks_per_node: int | None, gpus_per_node: int | None) -> tuple[int, int]:
        """``launchers.submitit.job_shape``: ranks per node from ``dist.ranks_per_node``, else the launcher's
        ``gpus_per_node``. Raises ValueError when the ranks do not fill whole nodes."""
        return jobs.job_shape(world_size, ranks_per_node, gpus_per_node)

    def preempt_signal(self) -> str | None:
        """submitit's checkpoint signal (``launchers.submitit.preempt_signal_name``)."""
        return jobs.preempt_signal_name()

    def run_probe(self, request: ProbeRequest) -> None:
        """The probe ranks as one job with the run's launcher options (partition, time limit, ...; at most 15
        minutes, no requeue), one task per rank; waits for it. Raises submitit's error when a task fails."""
        params = dict(request.launcher_options)
        params.update(submitit_folder=str(request.out_dir / "submitit" / "%j"), name="disteval-probe",
                      timeout_min=min(int(params.get("timeout_min") or 15), 15), max_num_timeout=0)
        nodes, per_node = self.world_shape(request.world_size, request.container["dist"].get("ranks_per_node"),
                                           params.get("gpus_per_node"))
        executor = jobs.make_executor(self.cluster, params, nodes, per_node)
        job = executor.submit(_probe_task, request.entry, request.container, str(request.out_dir),
                              request.payload_bytes)
        job.results()

    def scheduler_view(self, run_dir: Path, job: dict, hydra: Any) -> SchedulerNote | None:
        """The job's final state from job.json (TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, CANCELLED, PREEMPTED,
        BOOT_FAIL), else a task launch that srun reported failed in submitit's logs; None otherwise."""
        state, job_id = str(job.get("state", "")).upper(), str(job.get("job_id") or "")
        what = f"{'SLURM' if job_id else 'submitit'} job {job_id}".rstrip()
        ev = (("job.json", None, state), ("job.json", None, str(job.get("error"))[:300]))
        if state.startswith("TIMEOUT"):
            limit = OmegaConf.select(hydra, "hydra.launcher.timeout_min", default=None) if hydra is not None else None
            return SchedulerNote("time_limit", state, f"{what} hit its time limit", ev,
                                 (f"hydra.launcher.timeout_min={2 * int(limit)}",) if limit else (),
                                 "a longer time limit (checkpoints resume the work already done)")
        if state.startswith("OUT_OF_MEMORY"):
            return SchedulerNote("out_of_memory", state, f"{what} ran out of memory ({state})", ev,
                                 advice="ask the scheduler for more memory")
        if state.startswith("NODE_FAIL"):
            return SchedulerNote("node_fail", state, f"{what} ended NODE_FAIL", ev,
                                 advice="rerun: SLURM sets a failed node DOWN and places the rerun on others",
                                 node_hint="(dmesg, slurmd's log)")
        if state.startswith(("CANCELLED", "PREEMPTED", "BOOT_FAIL")):
            return SchedulerNote("stopped", state, f"{what} ended {state}: {str(job.get('error'))[:200]}", ev,
                                 advice="rerun: the scheduler stopped the job from outside")
        return _task_launch_failure(run_dir, job_id, state)


def _probe_task(entry: Callable[[dict, str, int], None], container: dict, out_dir: str, payload_bytes: int) -> None:
    """One probe rank inside a submitit task: export the rank environment, then run the probe."""
    jobs.export_rank_env()
    entry(container, out_dir, payload_bytes)


def _task_launch_failure(run_dir: Path, job_id: str, state: str) -> SchedulerNote | None:
    """srun could not start the job's tasks on a node (submitit's log of the batch step,
    ``.submitit/<job>/<job>_0_log.err``: "Task launch for StepId=... failed on node NODE: REASON"): the node that
    srun, on the job's first node, could not reach. None when the logs say nothing of the kind."""
    if not job_id:
        return None
    for path in sorted((run_dir / ".submitit" / job_id).glob(f"{job_id}_*_log.err")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for n, line in enumerate(lines, 1):
            m = _SRUN_LAUNCH.search(line)
            if not m:
                continue
            step, node, reason = m.groups()
            first = next((h.group(1) for h in map(_STEPD.search, lines) if h), None)
            between = f"between {first} and {node}" if first and first != node else f"to {node}"
            return SchedulerNote(
                "task_start", state, f"SLURM could not start the tasks of step {step} on node {node}: {reason.strip()} "
                f"(srun on the job's first node{f' {first}' if first else ''} could not reach slurmd on {node}); no "
                f"rank started there, so no rank recorded anything: check the network connection {between}",
                ((str(path.relative_to(run_dir)), n, line.strip()[:300]),),
                advice=f"check the network connection {between} (link, routes, firewall; `scontrol ping`, "
                       "`sinfo -N`), then rerun", nodes=tuple(h for h in (first, node) if h))
    return None
