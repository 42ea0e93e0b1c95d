"""``doctor --apply``: rerun the job with the verdict's remedy, retrying with exponential backoff.

Each attempt reruns ``python -m disteval`` with the original overrides plus every remedy applied so far (a
later attempt keeps the earlier fixes) in its own directory ``RUN_DIR/doctor/attempt{n}`` (n counts on across
invocations; the attempt's console output is kept there as console.log), then diagnoses that attempt. It stops when an attempt is healthy (and names the remedy that fixed it), when the verdict has
no remedy, when the same (failure, remedy) pair comes up again, or after ``max_attempts``.
"""
from __future__ import annotations

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
    exit_code, verdict ("STATE/check" or None), remedy, fixed, warnings}]. ``backoff_s`` doubles after each attempt (seconds);
    ``timeout_s`` bounds one attempt (seconds)."""
    base = diag.run
    overrides = run_overrides(base)
    env: dict[str, str] = {}
    tried: set = set()
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
            log(f"the remedy {remedy.overrides or remedy.env} was already tried for this failure: stopping")
            break
        tried.add(pair)
        overrides = merge_overrides(overrides, remedy.overrides)
        env.update(remedy.env)
        run_dir = _next_attempt_dir(base.path / "doctor")
        if n > 1:
            wait = backoff_s * 2 ** (n - 2)
            log(f"waiting {wait:g} s before attempt {n}")
            time.sleep(wait)
        argv = rerun_command(overrides, run_dir)
        log(f"attempt {n}: {' '.join(overrides)}" + (f" with {env}" if env else ""))
        cwd = (base.launch or {}).get("cwd") or os.getcwd()
        try:
            proc = subprocess.run(argv, cwd=cwd if Path(cwd).is_dir() else None, env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=timeout_s)
            code, console = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            code, console = 124, f"timed out after {timeout_s:g} s (--attempt-timeout-s)\n{partial}"
        if run_dir.exists():
            (run_dir / "console.log").write_text(console)
        current = diagnose(load_run(run_dir)) if run_dir.exists() else current
        fixed = code == 0 and current.verdict is None
        warnings = [f"{f.state}/{f.check}: {f.finding}" for f in current.findings if f.status == "warn"]
        attempts.append({"run_dir": str(run_dir), "overrides": overrides, "env": dict(env), "exit_code": code,
                         "verdict": None if current.verdict is None else f"{current.verdict.state}/{current.verdict.check}",
                         "remedy": remedy.as_dict(), "fixed": fixed, "warnings": warnings})
        if fixed:
            log(f"attempt {n} has no failing check: fixed by {' '.join(remedy.overrides) or remedy.env} ({remedy.why})")
            for w in warnings:
                log(f"  still warns: {w}")
            break
    else:
        log(f"gave up after {max_attempts} attempt(s) (--max-attempts): none was healthy")
    return current, attempts


def _next_attempt_dir(doctor_dir: Path) -> Path:
    """``doctor_dir/attempt{n}`` with the first n not used by an earlier --apply."""
    n = 1
    while (doctor_dir / f"attempt{n}").exists():
        n += 1
    return doctor_dir / f"attempt{n}"
