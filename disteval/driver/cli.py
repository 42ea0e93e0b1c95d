"""``python -m disteval [overrides]``: compose the config with Hydra, validate, preflight, launch the ranks.

Exit codes: 0 success; 1 the evaluation failed (a rank's error, named); 2 bad configuration or input found
before any rank started, or a run directory in use by a live run / holding finished results without
eval.overwrite=true; 130 interrupted by SIGINT, 143 by SIGTERM (128 + the signal's number, as shells report), all
ranks stopped. Under an external ``torchrun`` (env:// variables present) this process runs as
that rank instead of spawning ranks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from omegaconf.errors import ConfigKeyError, ValidationError

from disteval.job import driverlog
from disteval.comm.profiles import apply_profile
from disteval.common import allocator, startup
from disteval.config import (DistevalConfig, composition_problem, conf_dir, job_config, moved_key, register_schemas,
                             unknown_key)
from disteval.errors import (ConfigError, DiskFullError, DistevalError, RankFailedError, RendezvousError,
                             RunInterrupted, SweepExit)
from disteval.job import rundir
from disteval.job.journal import AUTO, resolve_auto
from disteval.job.records import LaunchRecord
from disteval.job.run_report import present_results, write_report
from launchers.registry import launcher_for, rank_launcher, register_hydra_plugins
from disteval.job.rundir import (JOB_RECORDS, SHARED_RECORDS, RunDirBusy, RunDirOccupied, claim_run_dir, external_rank,
                             leads_nodes, node_dir, release_run_dir)

register_schemas()
_err = Console(stderr=True)
log = logging.getLogger("disteval")


def job_container(cfg: DictConfig) -> dict:
    """The resolved job config as a plain dict (enums as strings) plus ``experiment_name``.

    Re-validated against the schema: Hydra lets ``+data.limt=5`` append a key that the schema lacks, which
    would otherwise be ignored silently. Raises ConfigError naming the key."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    try:
        OmegaConf.merge(OmegaConf.structured(DistevalConfig), container)
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(getattr(exc, "full_key", None) or "config",
                          f"{str(exc).splitlines()[0]} (not in disteval's schema; see --cfg job)") from None
    try:
        choice = HydraConfig.get().runtime.choices.get("experiment")
    except ValueError:
        choice = None
    container["experiment_name"] = choice or "default"
    try:
        explicit = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    except ValueError:
        explicit = set()
    container["communication_profile"] = apply_profile(container, explicit)
    return container


def run(cfg: DictConfig) -> int:
    """Run one job from a composed config. Returns the process exit code."""
    from disteval.comm import external_launch_detected

    hc = HydraConfig.get()
    launcher = str(hc.runtime.choices.get("hydra/launcher") or "")
    chosen = launcher_for(launcher)
    if chosen.hands_over_run_mode and hc.mode == RunMode.RUN:
        # without -m: the one job goes to the launcher (a scheduler's: a one-job sweep in the run directory)
        return chosen.run_job(_hydra_main.__wrapped__)
    run_dir = hc.runtime.output_dir
    external = external_launch_detected()
    if external_rank() in (None, 0) and leads_nodes(cfg):  # one run per run directory (disteval.job.rundir)
        code = _claim(run_dir, bool(cfg.eval.overwrite),
                      SHARED_RECORDS if external else JOB_RECORDS)
        if code:
            return code
    try:
        return _run_claimed(cfg, hc, run_dir, external, launcher)
    finally:
        release_run_dir(run_dir)


def _claim(run_dir: str, overwrite: bool, names: tuple[str, ...]) -> int:
    """Claim the run directory (``disteval.job.rundir.claim_run_dir``); print its notes. Returns 0, or the exit
    code of a refusal (2: busy or finished results without eval.overwrite, written nowhere near the other
    run's records; 1: the disk is full)."""
    try:
        notes = claim_run_dir(run_dir, overwrite, names)
    except (RunDirBusy, RunDirOccupied) as exc:
        _err.print(f"[bold red]disteval: configuration error[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except OSError as exc:
        _err.print(f"[bold red]disteval: run failed[/] cannot claim the run directory: {escape(str(exc))}",
                   soft_wrap=True, highlight=False)
        return 1
    for note in notes:
        _err.print(f"[yellow]disteval: warning[/] {escape(note)}", soft_wrap=True, highlight=False)
    return 0


def _run_claimed(cfg: DictConfig, hc, run_dir: str, external: bool, launcher: str) -> int:
    record = None
    if not external:  # the node that leads a multi-node launch writes launch.json, the others nodes/<host>/launch.json
        where = run_dir if leads_nodes(cfg) else str(node_dir(run_dir))
        nodes = int(cfg.dist.nnodes)
        os.makedirs(where, exist_ok=True)
        record = LaunchRecord(where, argv=[sys.executable, "-m", "disteval", *sys.argv[1:]], cwd=os.getcwd(),
                              overrides=list(hc.overrides.task), hydra_launcher=launcher or "basic",
                              world_size=int(cfg.dist.world_size), master_addr=str(cfg.dist.master_addr),
                              master_port=int(cfg.dist.master_port), faults=os.environ.get("DISTEVAL_FAULTS"),
                              **({"nnodes": nodes, "rdzv_endpoint": cfg.dist.rdzv_endpoint,
                                  "node_rank": cfg.dist.node_rank} if nodes > 1 else {}))
    try:
        code, error = _run(cfg, run_dir, external, record)
    except BaseException as exc:  # an unexpected error still leaves a finished record
        if record is not None:
            record.finish("failed", 1, exc)
        raise
    if record is not None:
        outcome = {0: "ok", 2: "config_error", 130: "interrupted", 143: "interrupted"}.get(code, "failed")
        record.finish(outcome, code, error)
    return code


def _run(cfg: DictConfig, run_dir: str, external: bool, record) -> tuple[int, BaseException | None]:
    startup.job_start()  # this job's start, passed to its ranks (results.json timings.process_wall_s)
    driverlog.step(driverlog.composed(cfg, external))
    from disteval.comm import RankEnv
    from disteval.config import heterogeneous_policy
    from disteval.faults import apply_at_start
    from disteval.job.preflight import preflight, preflight_without_kernels
    from disteval.data.pixel_source import driver_build_lock

    try:
        if external:  # a drill's kernel set (DISTEVAL_FAULTS cpu@R): before this rank's first kernel, the preflight's
            apply_at_start(RankEnv.from_env().rank)
        container = job_container(cfg)
        job = job_config(container)  # what the ranks receive: the validated, typed JobConfig
        notes: list[str] = []
        _resolve_resume(container, job, run_dir, external)
        if external and heterogeneous_policy(job) == "pin":
            preflight_without_kernels(job, notes)  # the rank's CPU kernel set stays free until it is pinned
        else:
            preflight(job, notes)
        # the ranks' malloc (dist.allocator): resolved here, so that a missing library fails before any rank starts;
        # under an external launcher the ranks already exist and run with what they were started with
        choice = None if external else allocator.resolve(str(cfg.dist.allocator))
        if choice is not None and choice.note and choice.requested != "auto":
            notes.append(f"dist.allocator={choice.requested}: {choice.note}")
        container["preflight_notes"] = job.preflight_notes = list(notes)  # also into results.json warnings
        if not external or RankEnv.from_env().rank == 0:
            for note in notes:
                _err.print(f"[yellow]disteval: warning[/] {escape(note)}", soft_wrap=True, highlight=False)
        if record is not None:
            record.start()
    except (DiskFullError, RendezvousError) as exc:
        _err.print(f"[bold red]disteval: run failed[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 1, exc
    except DistevalError as exc:
        _err.print(f"[bold red]disteval: configuration error[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2, exc
    driverlog.step(driverlog.launching(external, int(cfg.dist.world_size), choice,
                                       1 if external else int(cfg.dist.nnodes)))
    try:
        # a pixel cache this run builds is its own until the ranks end (another job waits, then reads it)
        with (driver_build_lock(job.data, lambda m: _err.print(f"disteval: {escape(m)}", soft_wrap=True, highlight=False))
              if not external else contextlib.nullcontext()):
            ranks = rank_launcher(str(HydraConfig.get().runtime.choices.get("hydra/launcher") or ""), external)
            ranks.start_ranks(cfg, job, container, run_dir, choice, lambda exc: _agent_stuck(exc, run_dir, record))
    except RunInterrupted as exc:  # as shells report a death by the signal: 128 + its number
        _err.print(f"[bold red]disteval:[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return (143 if exc.signal_name == "SIGTERM" else 130), exc
    except RankFailedError as exc:
        _err.print(f"[bold red]disteval: run failed[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        where = f"rank{exc.rank}" if exc.rank is not None else "rank*"
        _err.print(f"traceback and progress: {run_dir}/ranks/{where}/status.json; log: "
                   f"{run_dir}/ranks/{where}/log.txt", soft_wrap=True, highlight=False)
        _err.print(f"diagnose: python -m diagnostics doctor {shlex.quote(str(run_dir))}", soft_wrap=True, highlight=False)
        return 1, exc
    except DistevalError as exc:
        _err.print(f"[bold red]disteval: run failed[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 1, exc
    if (not external or RankEnv.from_env().rank == 0) and os.path.isfile(os.path.join(run_dir, "results.json")):
        present_results(run_dir, job)  # the ranks wrote their records; the driver presents them
    return 0, None


def _resolve_resume(container: dict, job: Any, run_dir: str, external: bool) -> None:
    """``eval.resume=auto``: the run directory's newest unfinished earlier run when its settings match
    (``disteval.job.journal.resolve_auto``; said on the console), else nothing; under an external launcher
    (each rank composed its own config) left to the ranks (``disteval.job.journal.requeue_chain``)."""
    if job.eval.resume != AUTO or external:  # each rank of an external launch: its requeued job's own records
        return
    path, note = resolve_auto(job, Path(run_dir) / rundir.PREVIOUS)
    container["eval"]["resume"] = job.eval.resume = path
    if note:
        _err.print(f"disteval: {escape(note)}", soft_wrap=True, highlight=False)


def _agent_stuck(exc: BaseException, run_dir: str, record) -> None:
    """A multi-node launch whose agent cannot leave the rendezvous after this node's ranks ended (the store
    is cut off): say who failed, record it, and end this process with exit code 1 (from the deadline thread,
    ``launchers.local.AgentDeadline``)."""
    _err.print(f"[bold red]disteval: run failed[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
    if record is not None:
        record.finish("failed", 1, exc)
    driverlog.finished(run_dir, 1)
    logging.shutdown()
    os._exit(1)


_composed = False
_failed_sweep: str | None = None  # the sweep directory of a basic-launcher multirun whose job failed


_FULL_ERROR = "HYDRA_FULL_ERROR"  # set by main() until the config is composed: Hydra then raises its composition
_set_full_error = False            # error to _main (composition_problem) instead of printing it
_exit_code = 0  # a failed single run's exit code, set by _hydra_main after it returned to Hydra (trackers log it)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    if _set_full_error:  # the job's own errors get Hydra's usual report again
        os.environ.pop(_FULL_ERROR, None)
    code = run(cfg)
    if startup.reporting():
        write_report(HydraConfig.get().runtime.output_dir)
    driverlog.finished(HydraConfig.get().runtime.output_dir, code)
    if code:
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and launcher_for(hc.runtime.choices.get("hydra/launcher")).runs_sweep_jobs_in_process:
            # the basic launcher runs the jobs in this process: an exception (not SystemExit) marks this job
            # failed and lets the next ones run; Hydra's sweeper raises it after the last job (exit code 1)
            global _failed_sweep
            _failed_sweep = str(hc.sweep.dir)
            raise DistevalError(f"job {hc.job.num} ({' '.join(hc.overrides.task)}) failed with exit code {code}; "
                                f"see above and {hc.runtime.output_dir}")
        if hc.mode == RunMode.RUN:  # returning lets Hydra call on_job_end: the trackers log a failed run too;
            global _exit_code      # _main exits with the code
            _exit_code = code
            return
        sys.exit(code)


def main() -> None:
    import warnings

    for pattern in register_hydra_plugins():  # Hydra's scan misses them under an editable install
        warnings.filterwarnings("ignore", message=pattern)
    if not startup.info_request(sys.argv[1:]):
        startup.progress("composing the config")
    problem = (unparsable_override(sys.argv[1:]) or next(filter(None, map(moved_key, sys.argv[1:])), None)
               or next(filter(None, map(unknown_key, sys.argv[1:])), None))
    if problem:
        _err.print(f"[bold red]disteval: configuration error[/] {escape(problem)}", soft_wrap=True, highlight=False)
        sys.exit(2)
    _main()


def unparsable_override(argv: list[str]) -> str | None:
    """The first override of ``argv`` that Hydra's override grammar rejects, as a message naming its key and
    showing the quoting that works (Hydra's own error names neither: "mismatched input '{' expecting <EOF>"),
    or None. Braces, brackets, commas and ``${`` are grammar in an unquoted value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as exc:
            key, value = arg.split("=", 1)
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return (f"{key.lstrip('+~')}: Hydra cannot parse the override {arg!r} ({said}); a value with braces, "
                    f"brackets or commas must be quoted for Hydra inside the shell's quotes, e.g. "
                    f"'{key}=\"{value}\"' (https://hydra.cc/docs/advanced/override_grammar/basic/)")
    return None


def _main() -> None:
    """Console-script entry point (``disteval``), same as ``python -m disteval``. A config that Hydra cannot
    compose (unknown key, wrong type, unknown group option; Hydra exits 1 after printing the error naming the
    key) exits 2 like every other configuration error."""
    global _set_full_error, _exit_code
    _set_full_error, _exit_code = _FULL_ERROR not in os.environ, 0
    if _set_full_error:
        os.environ[_FULL_ERROR] = "1"
    try:
        _hydra_main()
        if _exit_code:
            sys.exit(_exit_code)
    except Exception as exc:  # noqa: BLE001 - raised before the config was composed (HYDRA_FULL_ERROR, set above)
        if not _set_full_error or _composed:
            raise
        problem = composition_problem(exc)
        if problem:
            _err.print(f"[bold red]disteval: configuration error[/] {escape(problem)}", soft_wrap=True, highlight=False)
        else:  # Hydra's own words, as it prints them without HYDRA_FULL_ERROR
            sys.stderr.write(f"{exc}\n" + (f"{exc.__cause__}\n" if exc.__cause__ is not None else ""))
        sys.exit(2)
    except SystemExit as exc:
        if exc.code == 1 and not _composed and rundir.refused_with is None and not isinstance(exc, SweepExit):
            sys.exit(2)  # (a full disk at the claim stays 1, and so does a launcher's partial sweep)
        if exc.code and _failed_sweep is not None:
            _end_of_failed_sweep(_failed_sweep)
        raise
    finally:
        if _set_full_error:
            os.environ.pop(_FULL_ERROR, None)


def _end_of_failed_sweep(sweep_dir: str) -> None:
    """Hydra's sweeper stops a sweep whose job failed before its end-of-sweep callbacks: print what they would
    have, the summary table (SWEEP_DIR/summary.csv and report.html were kept current after each job) and the last
    line naming the report and the trackers."""
    from disteval.driver.loggers.end_line import end_line
    from disteval.job.sweep import summarize_sweep

    try:
        summarize_sweep(sweep_dir, console=_err)
        line = end_line(os.path.abspath(sweep_dir))
    except Exception as exc:  # noqa: BLE001 - the jobs' records stand; this is their summary
        line = f"warning: could not summarise the sweep {sweep_dir}: {type(exc).__name__}: {exc}"
    if line:
        print(f"disteval: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
