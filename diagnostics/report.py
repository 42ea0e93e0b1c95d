"""The doctor's output: a rich table per run and ``--json`` (schema below).

JSON schema (``schema_version`` 1), one object per doctor invocation::

    {"schema_version": 1, "exit_code": 0 | 1 | 2,
     "runs": [{"run_dir": str,
               "verdict": null | {"state": "INIT"|"SHARDS"|"CONVERGENCE"|"COMM"|"RESULT", "check": str,
                                  "finding": str, "culprit_rank": int | null},
               "culprit_rank": int | null,
               "remedy": null | {"overrides": [str], "env": {str: str}, "why": str, "command": str},
               "checks": [{"state", "check", "status": "pass"|"warn"|"fail"|"skipped"|"crashed", "finding",
                           "evidence": [{"source", "field", "line", "value"}], "remedy", "culprit_rank"}],
               "probes": null | {...probe.json...},
               "attempts": [{"run_dir", "overrides": [str], "env": {str: str}, "exit_code": int,
                             "verdict": str | null, "remedy": {...}, "fixed": bool, "warnings": [str]}],
               "final": {"run_dir", "verdict", "culprit_rank", "remedy"},    (only with --apply: the last attempt)
               "fixed": bool}]}                                            (only with --apply)

``verdict``/``remedy`` describe RUN_DIR as it was; after --apply, ``final`` describes the last attempt.

``remedy.command`` is the ready-to-paste shell line that applies the remedy to the run.
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diagnostics.machine import Diagnosis
from diagnostics.remedies import merge_overrides, rerun_command, run_overrides, shell_line

SCHEMA_VERSION = 1
MARKS = {"pass": "[green]✔[/]", "warn": "[yellow]![/]", "fail": "[bold red]✘[/]", "skipped": "[dim]-[/]",
         "crashed": "[bold magenta]✱[/]"}


def remedy_command(diag: Diagnosis) -> str | None:
    """The shell line that reruns the run with the verdict's remedy applied, or None without a remedy."""
    remedy = diag.remedy
    if remedy is None:
        return None
    argv = rerun_command(merge_overrides(run_overrides(diag.run), remedy.overrides))
    return shell_line(argv, remedy.env, remedy.unset)


def as_dict(diag: Diagnosis, probes: dict | None = None, attempts: list[dict] | None = None) -> dict:
    v = diag.verdict
    remedy = diag.remedy
    return {
        "run_dir": str(diag.run.path),
        "verdict": None if v is None else {"state": v.state, "check": v.check, "finding": v.finding,
                                          "culprit_rank": v.culprit},
        "culprit_rank": diag.culprit,
        "remedy": None if remedy is None else {**remedy.as_dict(), "command": remedy_command(diag)},
        "checks": [f.as_dict() for f in diag.findings],
        "probes": probes,
        "attempts": attempts or [],
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
    skipped = sum(f.status == "skipped" for f in diag.findings)
    if skipped and not verbose:
        console.print(f"[dim]{skipped} check(s) skipped for lack of records (--verbose lists them)[/]", highlight=False)
    v = diag.verdict
    if v is None:
        extra = f" ({len(diag.crashed)} check(s) crashed)" if diag.crashed else ""
        console.print(f"[bold green]verdict: healthy[/]{extra}: no check failed", soft_wrap=True)
        return
    culprit = f", culprit rank {diag.culprit}" if diag.culprit is not None else ""
    console.print(f"[bold red]verdict: {v.state} failed[/] ({v.check}{culprit}): {escape(v.finding)}", soft_wrap=True)
    cmd = remedy_command(diag)
    if cmd:
        console.print(f"remedy: {escape(diag.remedy.why)}\n  {escape(cmd)}", soft_wrap=True, highlight=False)
    else:
        console.print("no automatic remedy: the evidence above names what to fix", soft_wrap=True)
