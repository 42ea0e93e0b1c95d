"""The submitit launchers refuse a job before anything is submitted, as the local launcher does (issue 31, points
4, 5 and 7): the card's SLURM command on a machine without SLURM's commands or without a controller that answers
(exit 2, naming what is missing and how to start the local cluster, no traceback), and a missing data root or
weights that cannot be fetched (the local launcher's preflight, exit 2 in seconds instead of a failed job). The
doctor reads the launcher's job.json and names the same cause. No SLURM cluster is needed: these machines lack
one on purpose (a PATH without SLURM's commands; a slurm.conf whose controller port has no daemon)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recorded_runs import diagnostics_cli

from launchers.cluster import CLIENTS
from test_doctor_evidence import WEIGHTS, imagenet_like, offline  # noqa: F401 - imagenet_like is a fixture

SLURM_COMMANDS = {*CLIENTS, "squeue", "scancel", "salloc", "sbcast", "sstat", "sacctmgr"}


@pytest.fixture(scope="module")
def no_slurm_path(tmp_path_factory) -> str:
    """A PATH holding every program of this machine's PATH except SLURM's client commands."""
    bin_dir = tmp_path_factory.mktemp("no_slurm_bin")
    for folder in os.environ["PATH"].split(os.pathsep):
        if not Path(folder).is_dir():
            continue
        for prog in Path(folder).iterdir():
            if prog.name not in SLURM_COMMANDS and not (bin_dir / prog.name).exists():
                (bin_dir / prog.name).symlink_to(prog)
    return str(bin_dir)


@pytest.fixture(scope="module")
def dead_controller(tmp_path_factory) -> str:
    """A slurm.conf naming a controller on a port where no daemon listens (a controller that is down)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (slurm-wlm; .ci/run installs it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = tmp_path_factory.mktemp("dead_slurm") / "slurm.conf"
    conf.write_text(f"ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={port}\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=localhost Default=YES\n")
    return str(conf)


def _submit(tmp_path: Path, *args: str, env: dict | None = None, multirun: bool = False, launcher="submitit_slurm"):
    cmd = [sys.executable, "-m", "disteval", *(["-m"] if multirun else []), f"hydra/launcher={launcher}", *args]
    return subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "COLUMNS": "200", **(env or {})},
                          capture_output=True, text=True, timeout=300)


def _doctor(run_dir: Path) -> tuple[int, dict]:
    out = diagnostics_cli(["doctor", str(run_dir), "--json"], cwd=run_dir.parent)
    return out.returncode, json.loads(out.stdout)


def _refused(run_dir: Path) -> dict:
    """The job.json of a job refused before submission (nothing submitted: no submitit folder, no rank)."""
    assert not (run_dir / ".submitit").exists() and not (run_dir / "ranks").exists()
    job = json.loads((run_dir / "job.json").read_text())
    assert job["state"] == "REFUSED" and job["job_id"] == ""
    return job


def test_card_command_without_slurm_commands_is_a_clear_error_and_the_doctor_says_so(tmp_path, no_slurm_path):
    run = tmp_path / "run"
    proc = _submit(tmp_path, f"hydra.run.dir={run}", env={"PATH": no_slurm_path})
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2, text[-3000:]
    assert "configuration error" in text and "needs a SLURM cluster" in text and "sbatch" in text
    assert "bash scripts/slurm/start_cluster.sh" in text and "Traceback" not in proc.stderr
    assert "needs a SLURM cluster" in _refused(run)["error"]
    code, report = _doctor(run)
    verdict = report["runs"][0]["verdict"]
    assert code == 1 and (verdict["state"], verdict["check"], verdict["status"]) == ("INIT", "scheduler", "fail")
    assert "needs a SLURM cluster" in verdict["finding"] and "-m" not in verdict["finding"].split()


def test_sweep_with_a_controller_that_does_not_answer_submits_nothing(tmp_path, dead_controller):
    sweep = tmp_path / "sweep"
    proc = _submit(tmp_path, "dist.world_size=1,2", f"hydra.sweep.dir={sweep}", env={"SLURM_CONF": dead_controller},
                   multirun=True)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2, text[-3000:]
    assert "the SLURM controller does not answer" in text and "scontrol ping" in text and "job(s) #0, #1" in text
    assert "no job of the sweep was submitted" in text and "Traceback" not in proc.stderr
    assert [_refused(sweep / j)["world_size"] for j in ("0", "1")] == [1, 2]
    code, report = _doctor(sweep)
    assert code == 1 and all("does not answer" in r["verdict"]["finding"] for r in report["runs"])


def test_submitit_launchers_run_the_local_preflight_before_submitting(tmp_path, imagenet_like):  # noqa: F811 - the fixture
    """A missing data root and ImageNet weights that cannot be fetched (offline) are refused on the submitting
    host, naming the key, exactly as the local launcher refuses them; nothing is submitted."""
    run = tmp_path / "no_root"
    proc = _submit(tmp_path, "+experiment=fashion_mnist", f"data.root={tmp_path / 'absent'}", f"hydra.run.dir={run}",
                   launcher="submitit_local")
    assert proc.returncode == 2 and "data.root" in proc.stderr and "does not exist" in proc.stderr, proc.stderr
    assert "data.root" in _refused(run)["error"]
    run = tmp_path / "offline"
    proc = _submit(tmp_path, *WEIGHTS, f"data.root={imagenet_like}", f"hydra.run.dir={run}",
                   env=offline(tmp_path), launcher="submitit_local")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "model.weights" in text and "Name or service not known" in text, text[-3000:]
    job = _refused(run)
    code, report = _doctor(run)
    assert code == 1 and "model.weights" in job["error"] and "model.weights" in report["runs"][0]["verdict"]["finding"]
