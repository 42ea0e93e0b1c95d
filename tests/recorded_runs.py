"""What saves the doctor's and compare's tests a process or a run each (issue 29 point 6: CI time).

``diagnostics_cli``: ``python -m diagnostics ARGV`` in this process: ``diagnostics.cli.main``, the function the
module runs, with the same arguments, working directory and environment, its exit code, stdout and stderr
returned as a CompletedProcess. For calls that only read records: ``--probe`` and ``--apply`` start ranks and
keep their own process (``needs_process``). A second interpreter costs about 3 s of imports per call.

``RecordedRuns``: real runs (real processes, real faults, real signals) made once per test session, on first use,
and read by more than one test (the session fixture ``recorded_run`` in conftest.py). A test copies the run
(``copy_run``) before it diagnoses or edits it, so the tests stay independent of each other and of their order.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conftest import rank_status, run_disteval, wait_for
from inline_run import as_process

QUICK = ("eval.progress=false", "data.batch_size=16")
PROCESS_FLAGS = ("--probe", "--apply")  # the doctor starts ranks for these: a process of its own


def needs_process(argv: list[str]) -> bool:
    return any(a.split("=")[0] in PROCESS_FLAGS for a in argv)


def diagnostics_cli(argv: list[str], cwd: Path, env: dict | None = None,
                    timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m diagnostics *argv`` run from ``cwd`` with ``env`` added to the environment: in this process
    when it only reads records, else in a process of its own (``timeout`` applies to that one only)."""
    if needs_process(argv):
        return subprocess.run([sys.executable, "-m", "diagnostics", *argv], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
    from diagnostics.cli import main

    out, err = io.StringIO(), io.StringIO()
    with as_process(cwd, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:  # what `python -m diagnostics` would exit with
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["python", "-m", "diagnostics", *argv], code, out.getvalue(), err.getvalue())


def copy_run(run: Path, dest: Path) -> Path:
    """A copy of the recorded run directory ``run`` at ``dest`` (for one test to diagnose and edit); returns it."""
    shutil.copytree(run, dest, symlinks=True)
    return dest


@dataclass
class Recorded:
    """A run made once per session: its directory, the driver's exit code and stderr, and what the scenario
    knew that the records do not say (a held port, a pid)."""
    run_dir: Path
    returncode: int
    stderr: str
    info: dict = field(default_factory=dict)


def signalled_driver(base: Path, sig: signal.Signals) -> Recorded:
    """Two ranks, rank 1 delayed 60 s in its first batch: once rank 0 has finished its shard and waits for rank 1
    in the synchronisation (rank 1 still in its forward), ``sig`` goes to the driver, as Ctrl-C (SIGINT) or a
    scheduler's SIGTERM would. Read by test_doctor.py (SIGINT) and test_hardening.py (both signals)."""
    run = base / f"driver-{sig.name}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", DISTEVAL_FAULTS="delay@1:batch=1,seconds=60")
    proc = subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run}", "dist.world_size=2", *QUICK],
                            cwd=base, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (rank_status(run, 0).get("phase"), rank_status(run, 1).get("phase")) == ("sync", "forward"),
                 120, "rank 0 waiting in the synchronisation for rank 1, still in its forward")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Recorded(run, proc.returncode, err, {"pid": proc.pid})


def port_in_use(base: Path) -> Recorded:
    """Two local ranks asked to meet at ``dist.master_port`` while another socket holds that port: refused
    before any rank starts. Read by test_doctor.py and test_cli.py."""
    run = base / "port-in-use"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run_disteval(*QUICK, "dist.world_size=2", f"dist.master_port={port}", run_dir=run, timeout=120)
    return Recorded(run, proc.returncode, proc.stderr, {"port": port})


SCENARIOS = {
    "driver-SIGINT": lambda base: signalled_driver(base, signal.SIGINT),
    "driver-SIGTERM": lambda base: signalled_driver(base, signal.SIGTERM),
    "port-in-use": port_in_use,
}


class RecordedRuns:
    """``runs(name)`` -> the ``Recorded`` of ``SCENARIOS[name]``, made in ``base`` on first use."""

    def __init__(self, base: Path):
        self.base, self.done = base, {}

    def __call__(self, name: str) -> Recorded:
        if name not in self.done:
            self.done[name] = SCENARIOS[name](self.base)
        return self.done[name]
