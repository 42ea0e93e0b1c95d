"""``python -m disteval`` in the test's own process (issue 29 point 6: CI time).

The driver is ordinary code: calling ``disteval.driver.cli.main`` here, with the same arguments, working directory and
environment, runs what the command runs, without a second interpreter (about 3 s of imports per call, more under
load). At world size 1 the driver runs its one rank in this process (``launchers.local.start_ranks``); at larger
world sizes it forks the ranks from a fork server (``launchers.local.fork_server``), which this process keeps for
the next run with the same environment (one import of torch per test worker instead of one per run). What the
run changes in this process is put back afterwards: the environment and working directory, torch's thread count
and determinism switches, signal handlers (elastic's agent sets four), logging handlers and the driver's module
state. What the ranks write to their stdout and stderr (this process's file descriptors 1 and 2, which the fork
server and its forks share) is caught in two files kept for the process and added to the run's output.

``inline_ok`` says when a call may run here: no multirun or other launcher, no allocator asked for by name (that
starts a process with another environment), not a node of a multi-node run, no other command, and no added
environment except fault drills (``DISTEVAL_FAULTS``) at an explicit world size of 2 or more: the drills kill,
stop or delay the ranks they name, which are then forks of the fork server, never this process, and the launch
hands the variable to its ranks (``launchers.local.HANDED_TO_RANKS``), so the kept server serves them too.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

NOT_INLINE = ("-m", "--multirun", "hydra/launcher=", "+hydra/launcher=", "dist.allocator=", "dist.nnodes=",
              "hydra.launcher.", "--cfg", "--info", "--help", "-c")


INLINE_ENV = ("DISTEVAL_FAULTS",)  # added variables a run in this process may have (at world size 2 or more)


def _world_size(overrides: tuple[str, ...]) -> int | None:
    """The ``dist.world_size=N`` the overrides give, else None."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("dist.world_size=")]
    return int(given[-1]) if given and given[-1].isdigit() else None


def inline_ok(overrides: tuple[str, ...], env: dict | None, cmd: list[str] | None) -> bool:
    """Whether ``python -m disteval *overrides`` may run in this process (see the module docstring)."""
    if cmd is not None or os.environ.get("DISTEVAL_TESTS_INLINE", "1") == "0":
        return False
    if env and not (set(env) <= set(INLINE_ENV) and (_world_size(overrides) or 0) >= 2):
        return False
    return not any(o == flag or (flag.endswith(("=", ".")) and o.startswith(flag)) for o in overrides
                   for flag in NOT_INLINE)


@contextlib.contextmanager
def as_process(cwd: Path, env: dict | None, drop: tuple[str, ...] = ()):
    """This process's working directory and environment as a child's would be (``env`` added, the variables
    ``drop`` removed: pytest's PYTEST_CURRENT_TEST changes with every test and would keep a fork server from
    serving the next run), restored afterwards."""
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.update(env or {})
    for name in drop:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


@contextlib.contextmanager
def _process_state_kept():
    """torch's global switches, signal handlers, logging handlers and levels, sys.argv and the driver modules'
    state as they were before, afterwards."""
    import torch

    from disteval.driver import cli

    from disteval.job import report, rundir

    consoles = (cli._err, report._console)
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    log_state = {id(lg): (lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers
                 if isinstance(lg, logging.Logger)}
    argv, env = list(sys.argv), dict(os.environ)
    try:
        yield
    finally:
        threads, det, warn_only, matmul, bench, cudnn_det = saved
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = bench, cudnn_det
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for lg in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
            if not isinstance(lg, logging.Logger):
                continue
            before = log_state.get(id(lg))
            for h in [h for h in lg.handlers if before is None or h not in before[1]]:
                lg.removeHandler(h)
                h.close()
            if before is not None:
                _, hs, lg.level, lg.propagate, lg.disabled = before
                lg.handlers[:] = hs
        sys.argv = argv
        os.environ.clear()  # last: torch's switches above import modules that set variables (TORCHINDUCTOR_CACHE_DIR)
        os.environ.update(env)
        cli._composed, cli._failed_sweep, rundir.refused_with = False, None, None
        cli._err, report._console = consoles


_CAPTURE_FDS: tuple[int, int] | None = None  # files standing for fds 1 and 2 during runs, kept for the process


def _capture_fds() -> tuple[int, int]:
    """Two unlinked files opened for appending, made on first use: what fds 1 and 2 point to during a run (a fork
    server started during a run keeps them, so a later run's ranks write to the same files)."""
    global _CAPTURE_FDS
    if _CAPTURE_FDS is None:
        fds = []
        for name in ("stdout", "stderr"):
            handle, path = tempfile.mkstemp(prefix=f"disteval-inline-{name}-")
            fds.append(os.open(path, os.O_RDWR | os.O_APPEND))
            os.close(handle)
            os.unlink(path)
        _CAPTURE_FDS = (fds[0], fds[1])
    return _CAPTURE_FDS


@contextlib.contextmanager
def _fds_captured():
    """Point fds 1 and 2 at ``_capture_fds()`` for the block; yields (a dict filled afterwards with what was
    written to each, as text, keys 1 and 2; a file object on the original stderr, for a hang's stacks)."""
    files = _capture_fds()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    starts = {fd: os.fstat(f).st_size for fd, f in zip((1, 2), files)}
    written: dict[int, str] = {}
    original_stderr = os.fdopen(saved[2], "w", closefd=False)
    for fd, f in zip((1, 2), files):
        os.dup2(f, fd)
    try:
        yield written, original_stderr
    finally:
        with contextlib.suppress(Exception):
            sys.__stdout__.flush(), sys.__stderr__.flush()
        for fd, f in zip((1, 2), files):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            end = os.fstat(f).st_size
            written[fd] = os.pread(f, end - starts[fd], starts[fd]).decode(errors="replace")


def run_inline(args: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m disteval *args`` from ``cwd`` (``env`` added) in this process: its exit code, stdout and stderr as a
    CompletedProcess (an exception the command would print as a traceback gives exit code 1 and the traceback).
    Past ``timeout`` seconds this process prints every thread's stack and ends (a hang must not stall the suite)."""
    import faulthandler

    from rich.console import Console

    from disteval.driver import cli

    from disteval.job import report

    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), as_process(cwd, {"COLUMNS": "120", **(env or {})}, drop=("PYTEST_CURRENT_TEST",)), \
            _fds_captured() as (ranks_wrote, original_stderr), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        sys.argv = ["disteval", *args]
        cli._composed, cli._failed_sweep = False, None
        # the driver's module-level consoles as a new process makes them: sized from this run's COLUMNS
        cli._err, report._console = Console(stderr=True), Console()
        faulthandler.dump_traceback_later(timeout, exit=True, file=original_stderr)
        try:
            cli.main()
            code = 0
        except SystemExit as exc:  # what `python -m disteval` would exit with
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the interpreter would print it and exit 1
            traceback.print_exc()
            code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
    return subprocess.CompletedProcess([sys.executable, "-m", "disteval", *args], code,
                                       out.getvalue() + ranks_wrote[1], err.getvalue() + ranks_wrote[2])
