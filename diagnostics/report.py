"""The doctor's output: a rich table per run and ``--json`` (schema below).

JSON schema (``schema_version`` 2), one object per doctor invocation::

    {"schema_version": 2, "exit_code": 0 | 1 | 2,
     "runs": [{"run_dir": str,
               "verdict": null | {"state": "INIT"|"SHARDS"|"CONVERGENCE"|"COMM"|"RESULT", "check": str,
                                  "status": "fail" | "unknown", "finding": str, "phase": str | null,
                                  "evidence": [{"source", "field", "line", "value"}], "culprit_rank": int | null},
               "culprit_rank": int | null,
               "remedy": null | {"overrides": [str], "env": {str: str}, "unset": [str], "why": str,
                                 "changes_cause": bool, "command": str | null},
               "checks": [{"state", "check", "status": "pass"|"warn"|"fail"|"unknown"|"skipped"|"crashed",
                           "finding", "phase", "evidence": [{"source", "field", "line", "value"}], "remedy",
                           "culprit_rank"}],
               "probes": null | {...probe.json...},
               "attempts": [{"run_dir", "overrides": [str], "env": {str: str}, "exit_code": int,
                             "verdict": str | null, "remedy": {...}, "fixed": bool, "warnings": [str]}],
               "apply_stopped": str | null,                                  (only with --apply: why it stopped
                                                                              without a healthy attempt)
               "final": {"run_dir", "verdict", "culprit_rank", "remedy"},    (only with --apply: the last attempt)
               "fixed": bool}]}                                            (only with --apply)

``verdict``/``remedy`` describe RUN_DIR as it was; after --apply, ``final`` describes the last attempt.
``verdict.status`` is "fail" when a check found the cause in the records, "unknown" when the records do not
decide (the finding lists what they hold; the exit code is still 1). ``phase`` says where in the run the
failure happened (``diagnostics.phases.PHASES``: preflight, launch, init, rendezvous, data, forward, sync,
results, scheduler, running, never_started), null when the records do not say. ``evidence`` is what the
verdict rests on: a record's file and field, a traceback's file and line, or this machine's /proc.

``remedy.command`` is the ready-to-paste shell line that applies the remedy to the run; null for advice that
changes no setting. ``remedy.changes_cause`` false: applying it cannot change the cause (advice for a person,
a diagnostic rerun, a rerun of a failure that would recur), so ``--apply`` refuses it.

Changes from schema 1: ``verdict.status``, ``verdict.phase``, ``verdict.evidence``, ``checks[].phase``, the
check status "unknown", ``remedy.changes_cause``, ``remedy.command`` null for advice, ``apply_stopped``.
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diagnostics.machine import Diagnosis
from diagnostics.phases import describe
from diagnostics.remedies import merge_overrides, rerun_command, run_overrides, shell_line, with_resume

SCHEMA_VERSION = 2
MARKS = {"pass": "[green]✔[/]", "warn": "[yellow]![/]", "fail": "[bold red]✘[/]", "unknown": "[bold yellow]?[/]",
         "skipped": "[dim]-[/]", "crashed": "[bold magenta]✱[/]"}


def remedy_command(diag: Diagnosis) -> str | None:
    """The shell line that reruns the run with the verdict's remedy applied, or None without a remedy."""
    remedy = diag.remedy
    if remedy is None or not (remedy.changes_anything or remedy.changes_cause):
        return None
    argv = rerun_command(with_resume(diag.run, merge_overrides(run_overrides(diag.run), remedy.overrides)))
    return shell_line(argv, remedy.env, remedy.unset)


def as_dict(diag: Diagnosis, probes: dict | None = None, attempts: list[dict] | None = None) -> dict:
    v = diag.verdict
    remedy = diag.remedy
    return {
        "run_dir": str(diag.run.path),
        "verdict": None if v is None else {"state": v.state, "check": v.check, "status": v.status,
                                          "finding": v.finding, "phase": v.phase,
                                          "evidence": [e.as_dict() for e in v.evidence], "culprit_rank": v.culprit,
                                          "culprit_nodes": v.nodes},
        "culprit_rank": diag.culprit,
        "remedy": None if remedy is None else {**remedy.as_dict(), "command": remedy_command(diag)},
        "checks": [f.as_dict() for f in diag.findings],
        "probes": probes,
        "attempts": attempts or [],
        "unseen": list(diag.run.unseen),
    }


def print_diagnosis(diag: Diagnosis, console: Console, verbose: bool = False) -> None:
    """The table (status mark, state, check, finding, evidence, remedy) and a closing verdict line."""
    table = Table(title=f"doctor: {escape(str(diag.run.path))}", show_lines=False, expand=True)
    for col, kw in (("", {"width": 1}), ("state", {}), ("check", {}), ("finding", {"ratio": 3}),
                    ("evidence", {"ratio": 2}), ("remedy", {"ratio": 2})):
        table.add_column(col, overflow="fold", **kw)
    for f in diag.findings:
        if f.status == "skipped" and not verbose:
            continue
        ev = "\n".join(escape(e.text()) for e in f.evidence[:3])
        remedy = ""
        if f.remedy:
            remedy = f.remedy.describe()
            remedy = escape(remedy) + f"\n[dim]{escape(f.remedy.why)}[/]"
        table.add_row(MARKS[f.status], f.state, f.check, escape(f.finding), ev, remedy)
    console.print(table)
    for line in diag.run.unseen:
        console.print(f"[yellow]not seen from here:[/] {escape(line)}", soft_wrap=True, highlight=False)
    skipped = sum(f.status == "skipped" for f in diag.findings)
    if skipped and not verbose:
        console.print(f"[dim]{skipped} check(s) skipped for lack of records (--verbose lists them)[/]", highlight=False)
    v = diag.verdict
    if v is None:
        extra = f" ({len(diag.crashed)} check(s) crashed)" if diag.crashed else ""
        console.print(f"[bold green]verdict: healthy[/]{extra}: no check failed", soft_wrap=True)
        return
    culprit = f", culprit rank {diag.culprit}" if diag.culprit is not None else ""
    if diag.verdict is not None and diag.verdict.nodes:
        culprit = f", culprit: the link between {' and '.join(diag.verdict.nodes)}"
    phase = f", {v.phase}: {describe(v.phase)}" if v.phase else ""
    head = f"[bold red]verdict: {v.state} failed[/] ({v.check}" if v.status == "fail" else \
        f"[bold yellow]verdict: unknown[/] ({v.state}/{v.check}"
    console.print(f"{head}{culprit}{escape(phase)}): {escape(v.finding)}", soft_wrap=True)
    for e in v.evidence[:4]:
        console.print(f"  [dim]evidence:[/] {escape(e.text())}", soft_wrap=True, highlight=False)
    cmd = remedy_command(diag)
    remedy = diag.remedy
    if remedy is not None and not remedy.changes_cause:
        console.print(f"remedy (by hand; --apply will not run it): {escape(remedy.why)}"
                      + (f"\n  {escape(cmd)}" if cmd else ""), soft_wrap=True, highlight=False)
    elif cmd:
        console.print(f"remedy: {escape(remedy.why)}\n  {escape(cmd)}", soft_wrap=True, highlight=False)
    else:
        console.print("no automatic remedy: the evidence above names what to fix" if v.status == "fail" else
                      "no remedy: the records do not name a cause", soft_wrap=True)
