"""SLURM (and local) job launching through submitit, for Hydra multiruns and single runs: one submitit task per
rank. Without ``-m`` (``python -m disteval hydra/launcher=submitit_slurm ...``) ``submit_run`` submits the one
job through the same launcher, as a one-job sweep whose job directory is the run directory.

Extends hydra-submitit-launcher 1.2.0 (same option names: partition, account, qos, nodes, gpus_per_node,
cpus_per_task, mem_gb, timeout_min, signal_delay_s, max_num_timeout, setup, additional_parameters,
array_parallelism, ...) where it falls short for evaluation jobs:

- **Per-job world size.** The stock launcher resolves ``hydra.launcher.*`` once per sweep, so
  ``-m dist.world_size=1,2,4`` ran every job at the same size. Here each job's own ``dist.world_size`` sets
  its ``nodes`` and ``tasks_per_node`` (ranks per node = the job's ``dist.ranks_per_node``, else the
  launcher's ``gpus_per_node``, else all ranks on one node), and jobs are submitted in groups of equal shape.
- **Ranks.** Every task exports its rank environment with submitit's ``TorchDistributedEnvironment``
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), then runs ``python -m disteval``'s task as that
  rank (the external-launcher path).
- **Truthful failures.** A job is failed when any task failed; its error is the culprit rank's own error
  from the per-rank status records (``launchers.culprit``), not a peer's "connection closed". Cancelled
  and timed-out jobs are reported as such (from sacct's state). Hydra's sweeper then raises it, the driver
  exits non-zero, and the sweep summary marks the job.
- ``max_num_timeout`` defaults to 2 for evaluation jobs (requeued on timeout or preemption).
- **Allocator.** Each job's ``dist.allocator`` is resolved on the submitting host
  (``disteval.common.allocator``; a missing library refuses the job before submission) and exported by the job
  script's ``setup`` lines, ahead of the launcher's own ``setup``, so every srun'd rank is exec'd with it; the
  driver's environment is untouched. Each rank records what is really in force in results.json ``allocator``.

The classes Hydra instantiates live in ``hydra_plugins/disteval_launchers`` (Hydra accepts plugins only
from that package); the configs are conf/hydra/launcher/submitit_{slurm,local}.yaml.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

from disteval.common import launch_env
from disteval.common.allocator import resolve as resolve_allocator
from disteval.job import driverlog
from disteval.errors import PreflightProblems, SweepExit
from launchers.culprit import find_culprit

log = logging.getLogger(__name__)

# the config files share their names with hydra-submitit-launcher's schemas, which validate them (same keys)
SCHEMA_WARNING = "(?s).*is validated against ConfigStore schema with the same name"


class JobFailed(Exception):
    """A submitted job failed, was cancelled or timed out (or was refused before submission); the message names
    the job and the culprit, ``state`` is the scheduler's final state (FAILED, CANCELLED, TIMEOUT, ..., REFUSED)."""

    def __init__(self, message: str, state: str = "FAILED"):
        super().__init__(message)
        self.state = state


def job_shape(world_size: int, ranks_per_node: int | None, gpus_per_node: int | None) -> tuple[int, int]:
    """``(nodes, tasks_per_node)`` for ``world_size`` ranks. Raises ValueError when the ranks do not fill
    whole nodes."""
    if world_size < 1:
        raise ValueError(f"dist.world_size must be >= 1, got {world_size}")
    per_node = ranks_per_node or gpus_per_node or world_size
    per_node = min(per_node, world_size)
    if world_size % per_node:
        raise ValueError(f"dist.world_size={world_size} is not a multiple of {per_node} ranks per node "
                         "(dist.ranks_per_node / hydra.launcher.gpus_per_node)")
    return world_size // per_node, per_node


class DistevalSubmititLauncher(BaseSubmititLauncher):
    """See the module docstring. ``_EXECUTOR`` is ``slurm`` or ``local`` in the subclasses; ``single_run``: the
    one job of ``submit_run`` (its outcome is returned, not turned into the sweep's exit)."""

    single_run = False

    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state) -> JobReturn:
        """One task (rank) of a submitted job: the base launcher's task with the rank environment exported. Its
        rank 0 locks the job directory without archiving anything (``disteval.job.rundir``): the driver archived an
        earlier run's records before submitting (``RunDirGuard``)."""
        import warnings

        import submitit

        warnings.filterwarnings("ignore", message=SCHEMA_WARNING)
        export_rank_env()
        os.environ["TORCHELASTIC_RUN_ID"] = f"slurm-{submitit.JobEnvironment().job_id}"
        return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)

    def _executor(self, nodes: int, tasks_per_node: int, setup: list[str] | None = None):
        return make_executor(self._EXECUTOR, dict(self.params), nodes, tasks_per_node, setup)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        configs, groups, refused = self._plan(job_overrides, initial_job_idx)
        jobs = self._submit(groups, job_overrides, initial_job_idx, refused)
        returns = [self._refused(configs[i], initial_job_idx + i, refused[i]) if i in refused else
                   self._outcome(jobs[i], configs[i], initial_job_idx + i) for i in range(len(job_overrides))]
        if any(r.status == JobStatus.FAILED for r in returns) and not self.single_run:
            # Hydra's sweeper would raise the first failure with its traceback and skip on_multirun_end: summarize
            # here, say what the sweep is, and exit (2: nothing was submitted, 1: a partial sweep)
            from disteval.job.sweep import summarize_sweep

            if len(refused) < len(returns):
                summarize_sweep(sweep_dir)
            raise SweepExit(_sweep_outcome(returns, refused, sweep_dir))
        return returns

    def _plan(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        """Every job's config, shape and checks before anything is submitted: ``(configs, groups, refused)``,
        ``groups`` mapping (nodes, tasks per node, allocator exports) to job indices, ``refused`` a job index to
        why it will not be submitted (no cluster, a shape the partition cannot hold, a failed preflight)."""
        from launchers.cluster import Capacity, cluster_problem

        no_cluster = cluster_problem() if self._EXECUTOR == "slurm" else None
        capacity = Capacity.query(self.params.get("partition")) if self._EXECUTOR == "slurm" and \
            no_cluster is None else None
        groups: dict[tuple, list[int]] = {}
        configs, refused = [], {}
        for i, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = initial_job_idx + i  # for hydra.sweep.subdir (the job's run directory)
            configs.append(cfg)
            # what is knowable up front fails here, before anything is submitted, every problem at once: the
            # job's shape, its own checks, its allocator, and a cluster to go to
            problems: list[str] = []
            try:
                shape = job_shape(int(cfg.dist.world_size), cfg.dist.ranks_per_node,
                                  self.params.get("gpus_per_node"))
                unfit = capacity.shape_problem(*shape, self.params.get("cpus_per_task")) if capacity else None
                if unfit:
                    problems.append(f"the cluster cannot hold this job: it {unfit}")
            except Exception as exc:  # noqa: BLE001 - reported as this job's failure, the others still run
                problems.append(f"{type(exc).__name__}: {exc}")
            for check in (lambda: _preflight(cfg), lambda: resolve_allocator(str(cfg.dist.allocator))):
                try:
                    check()
                except PreflightProblems as exc:
                    problems += [f"{type(p).__name__}: {p}" for p in exc.problems]
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{type(exc).__name__}: {exc}")
            if no_cluster:  # nowhere to go, whatever else is wrong
                problems.append(no_cluster)
            if problems:
                refused[i] = problems[0] if len(problems) == 1 else \
                    f"{len(problems)} problems: " + " ".join(f"({k}) {p}" for k, p in enumerate(problems, 1))
                continue
            exports = tuple(resolve_allocator(str(cfg.dist.allocator)).shell_exports())
            # a reused sweep directory was archived by the driver's RunDirGuard (disteval.job.rundir) before launching
            (Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir) / "job.json").unlink(missing_ok=True)
            groups.setdefault((*shape, exports), []).append(i)
        return configs, groups, refused

    def _submit(self, groups: dict, job_overrides, initial_job_idx: int, refused: dict) -> dict[int, Any]:
        """Submit each group of equal shape as one job array; a group that sbatch rejects is marked refused with
        its message (the groups already submitted still run and are waited for)."""
        jobs: dict[int, Any] = {}
        for (nodes, per_node, exports), members in groups.items():
            args = []
            for i in members:
                idx = initial_job_idx + i
                log.info("\t#%d : %s (%d node(s) x %d rank(s))", idx, " ".join(filter_overrides(job_overrides[i])),
                         nodes, per_node)
                args.append((list(job_overrides[i]), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                             Singleton.get_state()))
            try:
                executor = self._executor(nodes, per_node, list(exports))
                submitted = executor.map_array(self, *zip(*args))
            except Exception as exc:  # noqa: BLE001 - sbatch's own refusal, e.g. a node configuration it lacks
                said = " ".join(str(exc).split())[:400]
                refused.update({i: f"the scheduler refused the submission ({nodes} node(s) x {per_node} rank(s)): "
                                   f"{type(exc).__name__}: {said}" for i in members})
                continue
            jobs.update(zip(members, submitted))
        return jobs

    def _failed(self, cfg, idx: int, job_id: str, state: str, msg: str) -> JobReturn:
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        if state == "REFUSED":  # printed once at the end (_report_run, _sweep_outcome), with each reason once
            driverlog.to_file(log, logging.ERROR, msg)
        else:
            log.error(msg)
        ret = JobReturn()
        ret.overrides = list(cfg.hydra.overrides.task)
        ret.working_dir = str(run_dir)
        ret.status = JobStatus.FAILED
        ret._return_value = JobFailed(msg, state)
        _write_job_record(run_dir, {"job_id": job_id, "state": state, "error": msg, "world_size": int(cfg.dist.world_size),
                                    "launcher": f"submitit_{self._EXECUTOR}"})
        return ret

    def _refused(self, cfg, idx: int, error: str) -> JobReturn:
        return self._failed(cfg, idx, "", "REFUSED", f"job #{idx} (dist.world_size={cfg.dist.world_size}) was not "
                            f"submitted: {error}")

    def _outcome(self, job, cfg, idx: int) -> JobReturn:
        """Wait for ``job``, saying why it pends (``launchers.cluster.PendingWatch``); a JobReturn that is
        COMPLETED only when every task completed."""
        try:
            if self._EXECUTOR == "slurm":
                _wait_saying_why(job)
            return job.results()[0]
        except Exception as exc:  # noqa: BLE001 - submitit raises several kinds; the state says which
            state = _final_state(job)
            run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            world = int(cfg.dist.world_size)
            what = f"{'SLURM' if self._EXECUTOR == 'slurm' else 'submitit local'} job {job.job_id} (#{idx}, " \
                   f"dist.world_size={world})"
            if state in ("CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE"):
                msg = f"{what} ended {state}"
            else:
                culprit = find_culprit(str(run_dir), world, {}) if (run_dir / "ranks").is_dir() else None
                cause = culprit.message if culprit is not None else (
                    _disteval_error(job) or f"{type(exc).__name__}: {exc}".splitlines()[0])
                msg = f"{what} failed: {cause}"
                state = "FAILED"
            return self._failed(cfg, idx, str(job.job_id), state, msg)


def submit_run(task_function) -> int:
    """``python -m disteval hydra/launcher=submitit_* ...`` without ``-m`` (Hydra's RUN mode, inside the task
    function ``task_function``): submit the one job through the same launcher as a one-job sweep whose job
    directory is the run directory (hydra.run.dir, where Hydra already wrote .hydra/), wait for it, print its
    metrics or its failure, and return the exit code: 0 completed, 1 failed (culprit rank named), cancelled or
    timed out, 2 refused before submission (a configuration error). The job is composed in MULTIRUN mode, so its
    ranks run as ranks (the external-launcher path) and never submit again. The driver's claim on the run
    directory (``disteval.job.rundir``) is handed over: released before submission, taken by the job's rank 0."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    from disteval.job.rundir import release_run_dir

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = [o for o in hc.overrides.hydra if not o.startswith("hydra.mode=")]
    overrides += ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={_quote(str(run_dir))}", "hydra.sweep.subdir=."]
    loader = GlobalHydra.instance().config_loader()
    config = loader.load_configuration(str(hc.job.config_name), [*overrides, *hc.overrides.task], RunMode.MULTIRUN)
    launcher = Plugins.instance().instantiate_launcher(
        hydra_context=HydraContext(config_loader=loader, callbacks=Callbacks(config)), task_function=task_function,
        config=config)
    log.info("submitting this run as one %s job; its records go to %s",
             "SLURM" if launcher._EXECUTOR == "slurm" else "submitit local", run_dir)
    release_run_dir(run_dir)  # claimed by this driver (hydra.callbacks.run_dir_guard); the job's rank 0 claims it
    launcher.single_run = True
    ret = launcher.launch([list(hc.overrides.task)], initial_job_idx=0)[0]
    return _report_run(ret, run_dir, config)


def _sweep_outcome(returns: Sequence[JobReturn], refused: dict[int, str], sweep_dir: Path) -> int:
    """Print what a sweep with failed or refused jobs amounts to and return its exit code: 2 when no job was
    submitted (every one refused: the reasons, once each), else 1 (a partial sweep: which jobs completed)."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    done = sum(r.status == JobStatus.COMPLETED for r in returns)
    if len(refused) == len(returns):
        for reason in dict.fromkeys(refused.values()):
            jobs = [str(i) for i, why in refused.items() if why == reason]
            err.print(f"[bold red]disteval: configuration error[/] job(s) #{', #'.join(jobs)}: {escape(reason)}",
                      soft_wrap=True, highlight=False)
        err.print(f"disteval: no job of the sweep was submitted; records: {sweep_dir}/*/job.json", soft_wrap=True,
                  highlight=False)
        return 2
    err.print(f"[bold red]disteval: partial sweep[/] {done} of {len(returns)} job(s) completed, "
              f"{len(refused)} not submitted, {len(returns) - done - len(refused)} failed (the table above; "
              f"{sweep_dir}/summary.csv); diagnose: python -m diagnostics doctor {shlex.quote(str(sweep_dir))}",
              soft_wrap=True, highlight=False)
    return 1


def _quote(value: str) -> str:
    """``value`` as a Hydra override value: single-quoted unless it is made of plain path characters."""
    import re

    if re.fullmatch(r"[\w./+@%-]+", value):
        return value
    # Hydra's quoted strings: backslashes are escaped only where they precede a quote (or the closing one)
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", r"\1\1", escaped) + "'"


def _report_run(ret: JobReturn, run_dir: Path, config) -> int:
    """Print the outcome of ``submit_run``'s job as a local run prints its own (``disteval.job.run_report.present_results`` from
    results.json with the task's section, built from the job's ``config``; or the failure with where its records
    are) and return the exit code."""
    from rich.console import Console
    from rich.markup import escape

    from disteval.job.run_report import present_results

    if ret.status == JobStatus.COMPLETED:
        present_results(run_dir, _job_config(config))
        return 0
    err = Console(stderr=True)
    exc = ret._return_value
    if getattr(exc, "state", None) == "REFUSED":
        err.print(f"[bold red]disteval: configuration error[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    err.print(f"[bold red]disteval: run failed[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
    err.print(f"records: {run_dir}/job.json, {run_dir}/ranks/rank*/status.json and log.txt, submitit's logs in "
              f"{run_dir}/.submitit/", soft_wrap=True, highlight=False)
    err.print(f"diagnose: python -m diagnostics doctor {shlex.quote(str(run_dir))}", soft_wrap=True, highlight=False)
    return 1


PENDING_POLL_S = 5.0  # how often the driver looks at the queue while it waits for a job


def _wait_saying_why(job) -> None:
    """Return once ``job`` is done; meanwhile print why it pends when it does (a queue wait, a hold, a requeue
    waiting for a node that died), instead of waiting silently."""
    import time

    from rich.console import Console
    from rich.markup import escape

    from launchers.cluster import PendingWatch

    err = Console(stderr=True)
    watch = PendingWatch(str(job.job_id), lambda m: err.print(f"[yellow]disteval:[/] {escape(m)}", soft_wrap=True,
                                                              highlight=False))
    while not job.done():
        watch.poll(time.monotonic())
        time.sleep(PENDING_POLL_S)


def _final_state(job) -> str:
    """The job's final state from sacct (waits briefly for accounting to catch up)."""
    import time

    state = "UNKNOWN"
    for _ in range(20):
        try:  # a forced sacct query: submitit's cached job.state lags by seconds
            info = job.get_info(mode="force") if hasattr(job, "get_info") else {}
            state = str(info.get("State") or job.state).split()[0]
        except Exception:  # noqa: BLE001
            state = "UNKNOWN"
        if state not in ("UNKNOWN", "RUNNING", "PENDING", "COMPLETING", "REQUEUED"):
            break
        time.sleep(0.5)
    return state


def _preflight(cfg) -> None:
    """The driver-side checks of ``python -m disteval`` on one job's config (without the hydra node), as the local
    launcher runs them (``disteval.job.preflight.check_job``: config values, dataset root, model weights or
    checkpoint, metric families, sync policy) except the rendezvous address, which the job's own nodes provide."""
    from disteval.job.preflight import check_job

    check_job(_job_config(cfg), [])


def _job_config(cfg):
    """One job's config as its ranks see it: the composed config without the hydra node, resolved."""
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]
    return OmegaConf.create(OmegaConf.to_container(job, resolve=True))


def _disteval_error(job) -> str | None:
    """The last ``disteval:`` line of the job's stderr (an error raised before any rank wrote a record)."""
    try:
        text = job.stderr() or ""
    except Exception:  # noqa: BLE001
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("disteval:")]
    return lines[-1] if lines else None


def export_rank_env() -> None:
    """Inside a submitit task: export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (submitit's TorchDistributedEnvironment), so that the task runs as one env:// rank, and the launcher
    protocol's DISTEVAL_JOB_ID, DISTEVAL_NODE_RANK and DISTEVAL_PREEMPT_SIGNAL."""
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment()  # MASTER_PORT from the job script (free_port_line)
    env.export(set_cuda_visible_devices=False, overwrite=True)  # the job's values over what the driver had
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    # the rank side of the launcher protocol (disteval.common.launch_env): SLURM's job id and node index, and
    # the signal after which submitit requeues the job (its checkpoint signal)
    os.environ[launch_env.JOB_ID] = os.environ.get("SLURM_JOB_ID", "")
    os.environ[launch_env.NODE_RANK] = os.environ.get("SLURM_NODEID", "0")
    os.environ[launch_env.PREEMPT_SIGNAL] = preempt_signal_name()


def preempt_signal_name() -> str:
    """submitit's checkpoint signal, without SIG: ``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default; submitit requeues
    the job after it (up to ``max_num_timeout`` times)."""
    return os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or launch_env.DEFAULT_PREEMPT_SIGNAL


def free_port_line() -> str:
    """The job script's first line: ``export MASTER_PORT`` to a port the kernel reports free on the job's first
    node (where the batch script runs and rank 0 listens), unless the user's environment sets one.
    submitit's own choice (a port drawn from the job id, 20000-60000) may be held by another program, and
    then rank 0 fails to listen while the other ranks wait for it until ``communication.timeout_s``."""
    probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    return f'export MASTER_PORT="${{MASTER_PORT:-$({shlex.quote(sys.executable)} -c {shlex.quote(probe)})}}"'


def make_executor(cluster: str, params: dict, nodes: int, tasks_per_node: int, setup: list[str] | None = None):
    """A submitit AutoExecutor for ``cluster`` (slurm | local) from the launcher's options (``params``, as in
    conf/hydra/launcher/submitit_*.yaml; ``submitit_folder`` required), with ``nodes`` x ``tasks_per_node``
    tasks. Options that hydra-submitit-launcher's BaseQueueConf lacks get the ``{cluster}_`` prefix. ``setup``:
    shell lines run by the job before its tasks start (the allocator's exports), ahead of the options' own, and
    after ``free_port_line``."""
    import submitit

    params = {k: v for k, v in params.items() if k != "_target_"}
    params["setup"] = [free_port_line(), *(setup or []), *list(params.get("setup") or [])]
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{cluster}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=cluster, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    params.update(nodes=nodes, tasks_per_node=tasks_per_node)
    executor.update_parameters(**{k if k in base else f"{cluster}_{k}": v for k, v in params.items()})
    return executor


def _write_job_record(run_dir: Path, record: dict) -> None:
    """RUN_DIR/job.json with the scheduler's view of a failed job (job_id, state, error, world_size and the
    launcher's name; read by the sweep summary and the doctor)."""
    from disteval.job.records import atomic_write_json

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / "job.json", record)
    except OSError:
        pass


__all__ = ["DistevalSubmititLauncher", "JobFailed", "export_rank_env", "free_port_line", "job_shape", "make_executor",
           "preempt_signal_name", "submit_run"]
