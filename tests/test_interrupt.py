"""Ctrl-C at any moment of `python -m disteval` (issue 48 point 6): one line saying so, exit code 130, no traceback
(before this, a SIGINT during the imports or the checks printed Python's 30-line KeyboardInterrupt traceback, and
one while the fork server forked a rank added the child's FileNotFoundError traceback and torch's agent warning).

Real processes, real SIGINTs, sent when the run's own progress line says it has reached each moment."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# a progress line's text (disteval: [T s] ...) at which the SIGINT goes out, and a delay after it (seconds)
MOMENTS = [("starting: importing torch", 0.2), ("composing the config", 0.0), ("checking data, model", 0.0),
           ("starting 2 local ranks", 0.0), ("starting 2 local ranks", 0.5)]


def _interrupt_at(marker: str, delay: float, run_dir) -> tuple[int, list[str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a shell starts it
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                time.sleep(delay)
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, lines + rest.splitlines()


@pytest.mark.parametrize("marker,delay", MOMENTS, ids=[f"{m.split()[0]}-{m.split()[1]}+{d}" for m, d in MOMENTS])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(marker, delay, tmp_path):
    code, lines = _interrupt_at(marker, delay, tmp_path / "run")
    said = [line for line in lines if line.strip() and not line.startswith("disteval: [")]  # not the progress lines
    text = "\n".join(lines)
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and len(said) == 1, text[-3000:]
    assert "interrupted" in said[0] and "SIGINT" in said[0], said
