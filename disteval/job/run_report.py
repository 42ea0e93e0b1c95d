"""The driver's end of a run: RUN_DIR/report.html (``disteval.job.htmlreport``) with the task's figures
(``Task.report_figures``, the task found from results.json ``task``). Writing it never loses results nor changes
the exit code: a failure is one warning line."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Callable


def _figures_of(results: dict) -> Callable[[dict], list] | None:
    """The task's ``report_figures`` from results.json ``task``: its registered name, else its ``module:QualName``;
    None when neither resolves (the page then has no task figures)."""
    from disteval.tasks import registered_tasks

    task = results.get("task") or {}
    cls = registered_tasks().get(task.get("name") or "")
    if cls is None and ":" in str(task.get("class") or ""):
        module, _, name = str(task["class"]).partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
    return getattr(cls, "report_figures", None)


def write_report(run_dir: str | Path) -> Path | None:
    """Write RUN_DIR/report.html of a run that finished with results.json and return its path; None when there are
    no results (a failed run: ``python -m diagnostics doctor`` writes RUN_DIR/doctor/report.html) or when writing
    failed (a warning on stderr names why)."""
    run_dir = Path(run_dir)
    if not (run_dir / "results.json").is_file():
        return None
    try:
        from disteval.job.htmlreport import write_run_report

        results = json.loads((run_dir / "results.json").read_text())
        return write_run_report(run_dir, _figures_of(results))
    except Exception as exc:  # noqa: BLE001 - the report is a view of results already written
        print(f"disteval: warning: could not write {run_dir / 'report.html'}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return None


def present_results(run_dir: str | Path, job) -> None:
    """The console of a finished run, printed by its driver on every launch path (local ranks, world size 1 in
    the driver's process, rank 0 of an external torchrun, a scheduler job's submitter): RUN_DIR/results.json through
    ``disteval.job.report.present`` with the section of the job's task (``Task.console_section``). ``job``: the
    job's composed config. Raises OSError / ValueError when results.json cannot be read."""
    from disteval.job.report import present
    from disteval.tasks import resolve_task

    results = json.loads((Path(run_dir) / "results.json").read_text())
    present(results, resolve_task(job)(job).console_section)

