"""``doctor --apply``: rerun the job with the verdict's remedy, retrying with exponential backoff.

Each attempt reruns ``python -m disteval`` with the original overrides plus every remedy applied so far (a
later attempt keeps the earlier fixes) in its own directory ``RUN_DIR/doctor/attempt{n}`` (n counts on across
invocations; the attempt's console output is kept there as console.log), then diagnoses that attempt. Every
attempt is recorded in ``RUN_DIR/doctor/attempts.json``. It stops when an attempt is healthy (and names the
remedy that fixed it), when the verdict has no remedy, when the verdict is ``unknown`` (the records do not
name a cause, so nothing is known to fix), when the remedy cannot change the cause (``Remedy.changes_cause``
false: advice for a person, a diagnostic rerun, or a plain rerun of a failure whose cause would recur), when
the same (failure, remedy) pair comes up again (in this or an earlier --apply), or after ``max_attempts``.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from diagnostics.evidence import load_run
from diagnostics.hardware import canary_effect
from diagnostics.machine import Diagnosis, diagnose
from launchers.registry import launcher_for

from diagnostics.remedies import launcher_choice, merge_overrides, rerun_command, run_overrides, shell_line, with_resume


def apply_remedies(diag: Diagnosis, *, max_attempts: int = 3, backoff_s: float = 2.0, timeout_s: float = 3600.0,
                   log: Callable[[str], None] = print) -> tuple[Diagnosis, list[dict], str | None]:
    """Retry ``diag.run`` with remedies. Returns the last diagnosis, the attempts: [{run_dir, overrides, env,
    unset, exit_code, verdict ("STATE/check" or None), remedy, fixed, warnings}], and why it stopped without a
    healthy attempt (None when one was healthy). ``backoff_s`` doubles after each attempt (seconds);
    ``timeout_s`` bounds one attempt (seconds). Pairs tried by an earlier --apply on the same run
    (``RUN_DIR/doctor/attempts.json``) count as tried."""
    base = diag.run
    doctor_dir = base.path / "doctor"
    history = _load_history(doctor_dir)
    tried = {(tuple(h["failure"]), _remedy_key(h["remedy"])) for h in history if not h.get("fixed")}
    overrides = run_overrides(base)
    env: dict[str, str] = {}
    unset: set[str] = set()
    attempts: list[dict] = []
    current, stopped = diag, None
    for n in range(1, max_attempts + 1):
        remedy = current.remedy
        if current.verdict is None:
            break
        stopped = _refusal(current, tried)
        if stopped:
            log(stopped)
            break
        pair = (current.failure_key(), remedy.key())
        tried.add(pair)
        overrides = merge_overrides(overrides, remedy.overrides)
        env.update(remedy.env)
        unset.update(remedy.unset)
        run_dir = _next_attempt_dir(doctor_dir)
        if n > 1:  # the backoff doubles after each attempt
            log(f"waiting {backoff_s * 2 ** (n - 2):g} s before {run_dir.name}")
            time.sleep(backoff_s * 2 ** (n - 2))
        given = with_resume(current.run, overrides)  # resumes what the run recorded (eval.resume=RUN_DIR)
        log(f"{run_dir.name}: {remedy.describe()} -> {' '.join(given)}"
            + (f" with {env}" if env else "") + (f" without {sorted(unset)}" if unset else ""))
        code, console = _run_attempt(rerun_command(given, run_dir), (base.launch or {}).get("cwd") or os.getcwd(),
                                     {k: v for k, v in {**os.environ, **env}.items() if k not in unset}, timeout_s)
        if run_dir.exists():
            (run_dir / "console.log").write_text(console)
            current = diagnose(load_run(run_dir), reference=base.derived.get("reference"))
        else:
            stopped = f"{run_dir.name} wrote no run directory (exit code {code}): {console.strip()[-300:]}"
            log(stopped)
        fixed = code == 0 and current.verdict is None and run_dir.exists()
        warnings = [f"{f.state}/{f.check}: {f.finding}" for f in current.findings if f.status == "warn"]
        effect = measured_effect(base, current.run) if run_dir.exists() else {}
        attempts.append({"run_dir": str(run_dir), "overrides": given, "env": dict(env), "unset": sorted(unset),
                         "exit_code": code,
                         "verdict": None if current.verdict is None else f"{current.verdict.state}/{current.verdict.check}",
                         "remedy": remedy.as_dict(), "failure": list(pair[0]), "fixed": fixed, "warnings": warnings,
                         "effect": effect})
        _save_history(doctor_dir, history + attempts)
        if fixed:
            _say_fixed(log, run_dir, remedy, effect, warnings)
            break
        if not run_dir.exists():
            break
    else:
        stopped = f"gave up after {max_attempts} attempt(s) (--max-attempts): none was healthy"
        log(stopped)
    return current, attempts, stopped


def _say_fixed(log: Callable[[str], None], run_dir: Path, remedy: Any, effect: dict, warnings: list[str]) -> None:
    log(f"{run_dir.name} has no failing check: fixed by {remedy.describe()} ({remedy.why})")
    if effect.get("said"):
        log(f"  measured: {effect['said']}")
    for w in warnings:
        log(f"  still warns: {w}")


def timeout_that_fired(run) -> float | None:
    """Seconds of the timeout that ended ``run`` (a ``Run``), or None when no rank recorded a timeout (a killed
    rank, an error of its own): a CollectiveTimeout's recorded ``timeout_s``, else, for a backend's timeout
    message, the timeout in force (``communication.sync_timeout_s`` or ``communication.timeout_s``)."""
    errors = [s["error"] for s in run.statuses.values() if s and s.get("error")]
    for err in errors:
        if isinstance(err.get("timeout_s"), (int, float)):
            return float(err["timeout_s"])
    if any("timed out" in str(e.get("message", "")).lower() or "timeout" in str(e.get("type", "")).lower()
           for e in errors):
        value = run.cfg("communication.sync_timeout_s", None) or run.cfg("communication.timeout_s", None)
        return None if value is None else float(value)
    return None


def measured_effect(before, after) -> dict:
    """What a rerun measured against the failed run (both ``Run``): the final synchronisation's seconds (the
    failed run's: the timeout that ended it, when its records say so), and per compressed payload the bytes
    before and after and the measured error. ``said``: one line for a person."""
    res = after.results or {}
    sync = (res.get("timings") or {}).get("sync")
    failed_after = timeout_that_fired(before)
    out: dict = {"sync_s": sync, "failed_run_timeout_s": failed_after, "compression": {}}
    parts = []
    pinned = canary_effect(before, after)
    launch = before.launch or {}
    lasted = (float(launch["t_end"]) - float(launch["t_start"])
              if isinstance(launch.get("t_end"), (int, float)) and isinstance(launch.get("t_start"), (int, float)) else None)
    if sync is not None and not pinned:
        parts.append(f"the final synchronisation took {sync:.2f} s" +
                     (f" (the failed run gave up after {failed_after:g} s)" if failed_after is not None else
                      f" (the failed run ended {lasted:.1f} s after its launch)" if lasted is not None else ""))
    for name, c in sorted(((res.get("comm") or {}).get("compression") or {}).items()):
        if c.get("bytes_after") is not None and c.get("bytes_before") and c["bytes_after"] < c["bytes_before"]:
            out["compression"][name] = {k: c.get(k) for k in ("mode", "bytes_before", "bytes_after", "max_abs_error")}
            parts.append(f"{name} went as {c.get('mode')} in {c['bytes_after']:,} instead of {c['bytes_before']:,} "
                         f"bytes (max abs error {float(c.get('max_abs_error') or 0):.3g})")
    if pinned:
        out["canary"] = pinned
        parts.append(f"the canary found {len(pinned['classes_before'])} numeric classes before and "
                     f"{len(pinned['classes_after'])} after" + (f" (every rank pinned to {pinned['pinned']} kernels)"
                                                                  if pinned.get("pinned") else ""))
    out["said"] = "; ".join(parts)
    return out


def _run_attempt(argv: list[str], cwd: str, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """(exit code, console output) of one rerun; 124 when it ran past ``timeout_s`` seconds."""
    try:
        proc = subprocess.run(argv, cwd=cwd if Path(cwd).is_dir() else None, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, f"timed out after {timeout_s:g} s (--attempt-timeout-s)\n{partial}"


def _refusal(diag: Diagnosis, tried: set) -> str | None:
    """Why the verdict's remedy must not be applied (one line), or None when it may be."""
    v, remedy = diag.verdict, diag.remedy
    where = f"{v.state}/{v.check}"
    if v.status == "unknown":
        return f"the verdict {where} is unknown: the records do not name a cause, so there is nothing to apply: stopping"
    if remedy is None:
        return f"no remedy for {where}: stopping"
    if not remedy.changes_cause:
        return (f"not applying the remedy of {where}: it cannot change the cause ({remedy.why}); a rerun would fail "
                "the same way: stopping")
    by_hand = _nodes_started_by_hand(diag.run)
    if by_hand:
        line = shell_line(rerun_command(with_resume(diag.run, merge_overrides(run_overrides(diag.run),
                                                                              remedy.overrides))),
                          remedy.env, remedy.unset)
        return (f"not applying the remedy of {where} here: the run spanned nodes {', '.join(by_hand)}, each started "
                f"by hand, and --apply reruns on this machine only; run on every node (with its own dist.node_rank "
                f"where the run set one): {line}")
    if (diag.failure_key(), remedy.key()) in tried:
        return (f"{remedy.describe()} was already tried for {where} (this or an earlier --apply): stopping")
    return None


def _nodes_started_by_hand(run) -> list[str]:
    """The hosts of a run that spanned several nodes without a scheduler that --apply can resubmit to (a
    scheduling launcher starts every node itself, ``Launcher.schedules``): [] when one node, or when scheduled."""
    hosts = sorted({str(s.get("host")) for s in run.statuses.values() if s and s.get("host")} | set(run.node_launches))
    nnodes = int(run.cfg("dist.nnodes", 1) or 1)
    if len(hosts) < 2 and nnodes < 2:
        return []
    if launcher_for(launcher_choice(run)).schedules or run.job is not None:
        return []
    return hosts if len(hosts) > 1 else hosts + [f"{nnodes - len(hosts)} more"]


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
    from disteval.job.records import atomic_write_json

    atomic_write_json(doctor_dir / "attempts.json", attempts)


def _next_attempt_dir(doctor_dir: Path) -> Path:
    """``doctor_dir/attempt{n}`` with the first n not used by an earlier --apply."""
    n = 1
    while (doctor_dir / f"attempt{n}").exists():
        n += 1
    return doctor_dir / f"attempt{n}"


def measure_pipeline_remedy(diag: Diagnosis, finding, timeout_s: float = 3600.0,
                            log: Callable[[str], None] = print) -> list[dict]:
    """``doctor --apply`` on a healthy but input-bound run (the SHARDS/input_pipeline warning): rerun with its
    remedy and measure the effect on the images/s the loader delivered. ``data.cache=pixels`` needs two reruns
    (the first builds the cache as it evaluates, the second reads it); the last one is measured. Each rerun is an
    attempt in ``RUN_DIR/doctor/attempts.json`` with ``effect``: ``delivered_before``/``delivered_after``
    (images/s), ``speedup`` and whether the metrics are equal (``metrics_equal``). Returns the attempts."""
    base = diag.run
    doctor_dir = base.path / "doctor"
    history = _load_history(doctor_dir)
    remedy = finding.remedy
    overrides = merge_overrides(run_overrides(base), remedy.overrides)
    before = ((base.results or {}).get("pipeline") or {}).get("delivered_images_per_s")
    attempts = []
    for n in range(2 if "data.cache=pixels" in remedy.overrides else 1):
        run_dir = _next_attempt_dir(doctor_dir)
        role = ("builds the pixel cache" if n == 0 else "reads it") if "data.cache=pixels" in remedy.overrides else "measures"
        log(f"{run_dir.name} ({role}): {remedy.describe()} -> {' '.join(overrides)}")
        code, console = _run_attempt(rerun_command(overrides, run_dir), (base.launch or {}).get("cwd") or os.getcwd(),
                                     dict(os.environ), timeout_s)
        res = {}
        if run_dir.exists():
            (run_dir / "console.log").write_text(console)
            res = load_run(run_dir).results or {}
        after = (res.get("pipeline") or {}).get("delivered_images_per_s")
        effect = {"delivered_before": before, "delivered_after": after,
                  "speedup": after / before if after and before else None,
                  "metrics_equal": res.get("metrics") == (base.results or {}).get("metrics") if res else None}
        effect["said"] = (f"the loader delivered {after:,.0f} images/s against {before:,.0f} before "
                          f"({effect['speedup']:.2f}x); metrics {'equal' if effect['metrics_equal'] else 'DIFFER'}"
                          if after and before else f"exit code {code}, no pipeline record")
        log(f"  measured: {effect['said']}")
        attempts.append({"run_dir": str(run_dir), "overrides": overrides, "env": {}, "unset": [], "exit_code": code,
                         "verdict": None, "remedy": remedy.as_dict(), "failure": ["SHARDS", "input_pipeline", None],
                         "fixed": code == 0, "warnings": [], "effect": effect})
        _save_history(doctor_dir, history + attempts)
        if code != 0:
            break
    return attempts
