"""``doctor --apply``: rerun the job with the verdict's remedy, retrying with exponential backoff.

Each attempt reruns ``python -m disteval`` with the original overrides plus every remedy applied so far (a
later attempt keeps the earlier fixes) in its own directory ``RUN_DIR/doctor/attempt{n}`` (n counts on across
invocations; the attempt's console output is kept there as console.log), then diagnoses that attempt. Every
attempt is recorded in ``RUN_DIR/doctor/attempts.json``. It stops when an attempt is healthy (and names the
remedy that fixed it), when the verdict has no remedy, when the same (failure, remedy) pair comes up again
(in this or an earlier --apply), or after ``max_attempts``.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from diagnostics.evidence import load_run
from diagnostics.machine import Diagnosis, diagnose
from diagnostics.remedies import merge_overrides, rerun_command, run_overrides


def apply_remedies(diag: Diagnosis, *, max_attempts: int = 3, backoff_s: float = 2.0, timeout_s: float = 3600.0,
                   log: Callable[[str], None] = print) -> tuple[Diagnosis, list[dict]]:
    """Retry ``diag.run`` with remedies. Returns the last diagnosis and the attempts: [{run_dir, overrides, env,
    unset, exit_code, verdict ("STATE/check" or None), remedy, fixed, warnings}]. ``backoff_s`` doubles after each
    attempt (seconds); ``timeout_s`` bounds one attempt (seconds). Pairs tried by an earlier --apply on the same
    run (``RUN_DIR/doctor/attempts.json``) count as tried."""
    base = diag.run
    doctor_dir = base.path / "doctor"
    history = _load_history(doctor_dir)
    tried = {(tuple(h["failure"]), _remedy_key(h["remedy"])) for h in history if not h.get("fixed")}
    overrides = run_overrides(base)
    env: dict[str, str] = {}
    unset: set[str] = set()
    attempts: list[dict] = []
    current = diag
    for n in range(1, max_attempts + 1):
        remedy = current.remedy
        if current.verdict is None:
            break
        if remedy is None:
            log(f"no remedy for {current.verdict.state}/{current.verdict.check}: stopping")
            break
        pair = (current.failure_key(), remedy.key())
        if pair in tried:
            log(f"{remedy.describe()} was already tried for {current.verdict.state}/{current.verdict.check} "
                "(this or an earlier --apply): stopping")
            break
        tried.add(pair)
        overrides = merge_overrides(overrides, remedy.overrides)
        env.update(remedy.env)
        unset.update(remedy.unset)
        run_dir = _next_attempt_dir(doctor_dir)
        if n > 1:
            wait = backoff_s * 2 ** (n - 2)
            log(f"waiting {wait:g} s before {run_dir.name}")
            time.sleep(wait)
        argv = rerun_command(overrides, run_dir)
        log(f"{run_dir.name}: {remedy.describe()} -> {' '.join(overrides)}"
            + (f" with {env}" if env else "") + (f" without {sorted(unset)}" if unset else ""))
        cwd = (base.launch or {}).get("cwd") or os.getcwd()
        child_env = {k: v for k, v in {**os.environ, **env}.items() if k not in unset}
        try:
            proc = subprocess.run(argv, cwd=cwd if Path(cwd).is_dir() else None, env=child_env,
                                  capture_output=True, text=True, timeout=timeout_s)
            code, console = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            code, console = 124, f"timed out after {timeout_s:g} s (--attempt-timeout-s)\n{partial}"
        if run_dir.exists():
            (run_dir / "console.log").write_text(console)
            current = diagnose(load_run(run_dir), reference=base.derived.get("reference"))
        else:
            log(f"{run_dir.name} wrote no run directory (exit code {code}): {console.strip()[-300:]}")
        fixed = code == 0 and current.verdict is None and run_dir.exists()
        warnings = [f"{f.state}/{f.check}: {f.finding}" for f in current.findings if f.status == "warn"]
        attempts.append({"run_dir": str(run_dir), "overrides": overrides, "env": dict(env), "unset": sorted(unset),
                         "exit_code": code,
                         "verdict": None if current.verdict is None else f"{current.verdict.state}/{current.verdict.check}",
                         "remedy": remedy.as_dict(), "failure": list(pair[0]), "fixed": fixed, "warnings": warnings})
        _save_history(doctor_dir, history + attempts)
        if fixed:
            log(f"{run_dir.name} has no failing check: fixed by {remedy.describe()} ({remedy.why})")
            for w in warnings:
                log(f"  still warns: {w}")
            break
        if not run_dir.exists():
            break
    else:
        log(f"gave up after {max_attempts} attempt(s) (--max-attempts): none was healthy")
    return current, attempts


def _remedy_key(remedy: dict) -> tuple:
    return (tuple(sorted(remedy.get("overrides") or [])), tuple(sorted((remedy.get("env") or {}).items())),
            tuple(sorted(remedy.get("unset") or [])))


def _load_history(doctor_dir: Path) -> list[dict]:
    try:
        value = json.loads((doctor_dir / "attempts.json").read_text())
        return value if isinstance(value, list) else []
    except (OSError, ValueError):
        return []


def _save_history(doctor_dir: Path, attempts: list[dict]) -> None:
    from disteval.records import atomic_write_json

    atomic_write_json(doctor_dir / "attempts.json", attempts)


def _next_attempt_dir(doctor_dir: Path) -> Path:
    """``doctor_dir/attempt{n}`` with the first n not used by an earlier --apply."""
    n = 1
    while (doctor_dir / f"attempt{n}").exists():
        n += 1
    return doctor_dir / f"attempt{n}"
