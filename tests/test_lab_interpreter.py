"""The network lab and an interpreter under /tmp (issue 48 point 9): the lab's nodes have a private /tmp, so a
Python whose virtual environment lives under /tmp exited 127 inside a node ("nsenter: failed to execute
.../python: No such file or directory") and benchmarks/links.py failed silently. The lab now refuses to start,
saying why, before it builds anything (no root or namespaces needed for the refusal)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from conftest import REPO


def test_a_lab_started_from_a_venv_under_tmp_is_refused_naming_it():
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True,
                       timeout=120)
        code = ("from disteval.testing.netlab import NetLab, NetLabError\n"
                "try:\n    NetLab(name='tmpchk', nodes=1).start()\nexcept NetLabError as exc:\n    print(exc)\n")
        site = [p for p in sys.path if p.endswith("site-packages")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *site]))
        proc = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], capture_output=True, text=True,
                              env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"its environment (sys.prefix) {os.path.realpath(venv)}" in proc.stdout, proc.stdout
    assert "private /tmp" in proc.stdout and "outside /tmp" in proc.stdout
    assert not os.path.exists("/var/tmp/disteval-netlab/tmpchk")  # refused before anything was built
    from disteval.testing.netlab import hidden_by_private_tmp

    assert hidden_by_private_tmp() is None or REPO.as_posix().startswith("/tmp/")  # this interpreter is fine
