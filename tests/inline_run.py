"""``python -m disteval`` at world size 1 in the test's own process (issue 29 point 6: CI time).

A world-size-1 job needs no peer: the driver runs its one rank in its own process (``launchers.local.start_ranks``),
so calling ``disteval.cli.main`` here, with the same arguments, working directory and environment, runs the same
code as the command does, without a second interpreter (about 3 s of imports per call, more under load). What the
run changes in this process is put back afterwards: the environment and working directory, torch's thread count
and determinism switches, signal handlers, logging handlers and the driver's module state.

``inline_ok`` says when a call may run here: world size 1 given explicitly, no multirun or other launcher, no
allocator asked for by name (that starts a process with another environment), no added environment (fault drills
kill or stop the process they run in), no other command.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

NOT_INLINE = ("-m", "--multirun", "hydra/launcher=", "+hydra/launcher=", "dist.allocator=", "dist.nnodes=",
              "hydra.launcher.", "--cfg", "--info", "--help", "-c")


def inline_ok(overrides: tuple[str, ...], env: dict | None, cmd: list[str] | None) -> bool:
    """Whether ``python -m disteval *overrides`` may run in this process (see the module docstring)."""
    if cmd is not None or env or os.environ.get("DISTEVAL_TESTS_INLINE", "1") == "0":
        return False
    sizes = [o.split("=", 1)[1] for o in overrides if o.startswith("dist.world_size=")]
    if not sizes or sizes[-1] != "1":
        return False
    return not any(o == flag or (flag.endswith(("=", ".")) and o.startswith(flag)) for o in overrides
                   for flag in NOT_INLINE)


@contextlib.contextmanager
def as_process(cwd: Path, env: dict | None):
    """This process's working directory and environment as a child's would be, restored afterwards."""
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.update(env or {})
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

    from disteval import cli, rundir

    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
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


def run_inline(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m disteval *args`` from ``cwd`` in this process: its exit code, stdout and stderr as a
    CompletedProcess (an exception the command would print as a traceback gives exit code 1 and the traceback).
    Past ``timeout`` seconds this process prints every thread's stack and ends (a hang must not stall the suite)."""
    import faulthandler

    from disteval import cli

    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), as_process(cwd, {"COLUMNS": "120"}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        sys.argv = ["disteval", *args]
        cli._composed, cli._failed_sweep = False, None
        faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)
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
    return subprocess.CompletedProcess([sys.executable, "-m", "disteval", *args], code, out.getvalue(),
                                       err.getvalue())
