"""``python -m diagnostics doctor RUN_DIR [--probe] [--apply] [--reference RUN] [--json] [--verbose]`` and
``python -m diagnostics compare RUN_A RUN_B [--json]``.

doctor: RUN_DIR is a run directory or a Hydra sweep directory (every job in it is diagnosed). Exit codes: 0
every run is healthy; 1 problems found (some check failed); 2 the doctor could not finish (no such directory,
no records, an unreadable --reference run, unreadable config for --probe, or a check crashed while nothing
failed). --reference RUN adds the CONVERGENCE check "reference": the metrics must equal RUN's.

compare: where two runs disagree (``diagnostics.compare``). Exit codes: 0 identical metrics, 1 they differ,
2 they cannot be compared.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from diagnostics.apply import apply_remedies, measure_pipeline_remedy
from diagnostics.checks import STATES
from diagnostics.compare import load_records, run_compare
from diagnostics.evidence import find_runs, load_run
from diagnostics.machine import diagnose
from diagnostics.report import SCHEMA_VERSION, as_dict, print_diagnosis, remedy_command


def _at_least(low, kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diagnostics", description="disteval's run doctor")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="diagnose a run or sweep directory",
                         description="Walk INIT -> SHARDS -> CONVERGENCE -> COMM -> RESULT on a run's records; name "
                                     "the first failing state, its evidence, the culprit rank and a remedy.")
    doc.add_argument("run_dir", type=Path, help="a run directory (hydra.run.dir) or a sweep directory")
    doc.add_argument("--probe", action="store_true", help="also launch live probes with the run's configuration "
                     "(rendezvous, collective latency, shard balance, cross-rank drift)")
    doc.add_argument("--apply", action="store_true", help="rerun with the remedy, retrying with backoff until healthy")
    doc.add_argument("--max-attempts", type=_at_least(1, int), default=3, help="--apply: most reruns (default 3)")
    doc.add_argument("--backoff-s", type=_at_least(0.0, float), default=2.0,
                     help="--apply: seconds before the 2nd rerun, doubling")
    doc.add_argument("--attempt-timeout-s", type=_at_least(1.0, float), default=3600.0,
                     help="--apply: seconds one rerun may take")
    doc.add_argument("--reference", type=Path, metavar="RUN", help="a run whose metrics this run must reproduce "
                     "exactly (CONVERGENCE/reference names the first differing metric and where the forward differs)")
    doc.add_argument("--json", action="store_true", help="print the diagnosis as JSON (schema in diagnostics/report.py)")
    doc.add_argument("--verbose", "-v", action="store_true", help="also list skipped checks")
    cmp = sub.add_parser("compare", help="name where two runs disagree",
                         description="Compare two runs' metrics, per-sample outputs (batches.json digests), per-batch "
                                     "float partials and settings; name the first differing metric, batch and samples.")
    cmp.add_argument("run_a", type=Path, help="a run directory (hydra.run.dir)")
    cmp.add_argument("run_b", type=Path, help="the run directory to compare it with")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON (schema in diagnostics/compare.py)")
    cmp.add_argument("--significance", action="store_true", help="paired tests on the same samples from both runs' "
                     "prediction stores (eval.save_predictions=true): McNemar for top-1, a permutation test for NLL, "
                     "bootstrap intervals of the differences (diagnostics/significance.py)")
    cmp.add_argument("--resamples", type=int, default=1000, help="--significance: bootstrap and permutation resamples")
    cmp.add_argument("--level", type=float, default=0.95, help="--significance: the intervals' confidence level")
    cmp.add_argument("--seed", type=int, default=0, help="--significance: the resampling seed")
    return parser


def doctor(args: argparse.Namespace, console: Console) -> tuple[int, list[dict]]:
    """Diagnose every run under ``args.run_dir``; returns (exit code, JSON objects of the runs)."""
    out, code = [], 0
    reference = getattr(args, "reference", None)
    if reference is not None:
        load_records(reference)  # unreadable: the doctor cannot finish (exit 2), before any run is diagnosed
    for path in find_runs(args.run_dir):
        run = load_run(path)
        probes = None
        if args.probe:
            from diagnostics.probes import run_probes

            probes = run_probes(run, path / "doctor" / f"probe-{time.strftime('%Y%m%d-%H%M%S')}")
        diag = diagnose(run, probes, reference=reference)
        attempts: list[dict] = []
        if not args.json:
            print_diagnosis(diag, console, args.verbose)
        if args.apply and diag.verdict is not None:
            log = (lambda m: None) if args.json else (lambda m: console.print(f"[cyan]doctor --apply:[/] {escape(m)}",
                                                                              soft_wrap=True, highlight=False))
            final, attempts, stopped = apply_remedies(diag, max_attempts=args.max_attempts, backoff_s=args.backoff_s,
                                                      timeout_s=args.attempt_timeout_s, log=log)
            if not args.json and attempts:
                print_diagnosis(final, console, args.verbose)
            run_code = 0 if attempts and attempts[-1]["fixed"] else max(1, final.exit_code)
            final_dict = as_dict(final)
        elif args.apply and _input_bound(diag) is not None:  # healthy but input-bound: measure the remedy
            log = (lambda m: None) if args.json else (lambda m: console.print(f"[cyan]doctor --apply:[/] {escape(m)}",
                                                                              soft_wrap=True, highlight=False))
            attempts = measure_pipeline_remedy(diag, _input_bound(diag), timeout_s=args.attempt_timeout_s, log=log)
            run_code = 0 if attempts and attempts[-1]["fixed"] else 1
            final_dict = as_dict(diag)
        elif not args.json and diag.remedy is not None and diag.remedy.changes_cause and diag.verdict.status == "fail":
            console.print(f"[dim]apply it with: python -m diagnostics doctor {path} --apply[/]", soft_wrap=True,
                          highlight=False)
            run_code = diag.exit_code
        else:
            run_code = diag.exit_code
        entry = as_dict(diag, probes, attempts)
        if not args.json:  # a person's invocation: the page beside the table (--json leaves the run directory as it was)
            write_html(path, entry, console)
        if args.apply and diag.verdict is not None:
            entry["apply_stopped"] = stopped
        if attempts:
            entry["final"] = {k: final_dict[k] for k in ("run_dir", "verdict", "culprit_rank", "remedy")}
            entry["fixed"] = bool(attempts[-1]["fixed"])
        out.append(entry)
        code = max(code, run_code)
    return code, out


def _input_bound(diag):
    """The SHARDS/input_pipeline warning with a remedy of a healthy run, else None."""
    if diag.verdict is not None:
        return None
    return next((f for f in diag.findings if f.check == "input_pipeline" and f.status == "warn" and f.remedy), None)


def write_html(path: Path, entry: dict, console: Console) -> Path | None:
    """RUN_DIR/doctor/report.html of one diagnosis (``disteval.job.htmlreport.write_doctor_report``), its path printed;
    a failure to write it is a warning, never the doctor's exit code."""
    from disteval.job.htmlreport import write_doctor_report

    try:
        out = write_doctor_report(path, entry, STATES)
    except Exception as exc:  # noqa: BLE001 - the page is a view of the diagnosis printed above
        console.print(f"[yellow]doctor: could not write the HTML report:[/] {escape(f'{type(exc).__name__}: {exc}')}",
                      soft_wrap=True, highlight=False)
        return None
    console.print(f"report: {out}", soft_wrap=True, highlight=False)
    return out


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "compare":
        paired = ({"resamples": args.resamples, "level": args.level, "seed": args.seed} if args.significance
                  else None)
        sys.exit(run_compare(args.run_a, args.run_b, args.json, console, paired))
    try:
        code, runs = doctor(args, console)
    except (FileNotFoundError, ValueError) as exc:
        if args.json:
            print(json.dumps({"schema_version": SCHEMA_VERSION, "exit_code": 2, "error": str(exc), "runs": []}))
        else:
            Console(stderr=True).print(f"[bold red]doctor: cannot diagnose:[/] {exc}", soft_wrap=True, highlight=False)
        sys.exit(2)
    if args.json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, "exit_code": code, "runs": runs}, indent=2, default=str))
    sys.exit(code)


__all__ = ["main", "doctor", "remedy_command"]
