"""What a user sees before the first result: the driver's first console line (printed before torch and Hydra
load), one progress line per start-up step, and the job's start time, which the driver passes to its ranks
(environment variable ``DISTEVAL_T0``) so that results.json can report the whole run's wall time beside the
evaluation's.

Standard library only: ``disteval/__main__.py`` imports it before anything heavy.
"""
from __future__ import annotations

import os
import sys
import time

ENV = "DISTEVAL_T0"  # the job's start, epoch seconds: set by the driver, inherited by its ranks
_process_start: float | None = None  # set by mark_process_start (python -m disteval), taken by the first job


def mark_process_start(t: float | None = None) -> float:
    """Record ``t`` (epoch seconds; now when None) as the start of this ``python -m disteval`` process and
    export it as ``DISTEVAL_T0`` (replacing a value inherited from another process). Returns it."""
    global _process_start
    _process_start = time.time() if t is None else float(t)
    os.environ[ENV] = repr(_process_start)
    return _process_start


def job_start() -> float:
    """The start of the job this driver is about to run (epoch seconds), exported as ``DISTEVAL_T0`` for its
    ranks: the process start recorded by ``mark_process_start`` for the first job, else now (a later job of a
    multirun in the same process, or a job started without ``python -m disteval``, e.g. by a scheduler's task)."""
    global _process_start
    start, _process_start = (_process_start if _process_start is not None else time.time()), None
    os.environ[ENV] = repr(start)
    return start


def run_start() -> float | None:
    """The start of this job as the driver exported it (``DISTEVAL_T0``, epoch seconds), or None when unset."""
    try:
        return float(os.environ[ENV])
    except (KeyError, ValueError):
        return None


def seconds_since_start() -> float | None:
    """Seconds since ``run_start()`` (wall clock), or None when no start is known."""
    start = run_start()
    return None if start is None else max(time.time() - start, 0.0)


_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
               "--version"}


def info_request(argv: list[str]) -> bool:
    """True when ``argv`` asks Hydra for help or the config (``--cfg job``, ``--help``, ...): no run, no
    progress lines."""
    return any(arg.split("=", 1)[0] in _INFO_FLAGS for arg in argv)


def reporting() -> bool:
    """False in a rank other than 0 started by a launcher (``RANK`` set and not 0): one process speaks."""
    return os.environ.get("RANK", "0") in ("", "0")


def line(message: str) -> str:
    """``disteval: [T s] message`` with T = ``seconds_since_start()`` (``disteval: message`` when unknown)."""
    t = seconds_since_start()
    return f"disteval: {message}" if t is None else f"disteval: [{t:.1f} s] {message}"


def progress(message: str) -> None:
    """Print ``line(message)`` to stderr at once, on the reporting process only (see ``reporting``)."""
    if reporting():
        print(line(message), file=sys.stderr, flush=True)


def _flush_and_exit(code: int) -> None:
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _other_threads() -> bool:
    import threading

    return any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate())


def exit_without_teardown(code: int) -> None:
    """End the process with ``code`` after the atexit handlers (logging flushed) but without the interpreter's
    module teardown, which takes about 1 s once torch is loaded. Falls back to ``sys.exit(code)`` while
    another non-daemon thread runs (it would be killed)."""
    import atexit

    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # CPython's; without it, exit the usual way
    if run_exitfuncs is None or _other_threads():
        sys.exit(code)
    run_exitfuncs()
    _flush_and_exit(code)


def skip_teardown_at_exit() -> None:
    """For a rank whose work is done and delivered (a local rank after its entry function returned): when
    the interpreter exits, flush the logs and streams and end the process with exit code 0 at once, skipping
    the remaining atexit handlers and the module teardown (about 1 s with torch loaded; the launcher waits for
    every rank's process to end)."""
    import atexit

    atexit.register(_flush_and_exit, 0)
