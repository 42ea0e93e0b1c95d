"""Every shell command in README.md's fenced blocks, extracted from the file, is run here as written (issue 31,
point 9), with only its placeholders filled (RUN_DIR, /path/to/...) and a run or sweep directory under the test's
tmp dir. What a test cannot run is checked against what runs it: the install lines are .ci/run's own (CI runs
them on a fresh machine) and ``python -m pytest`` is .ci/run's test command. A command without a handler here
fails the test, so a new README command comes with its check."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, load_results, slurm_unavailable

README = REPO / "README.md"
CI = (REPO / ".ci" / "run").read_text()


def readme_commands() -> list[str]:
    """The shell commands of README.md's fenced blocks: comments dropped, backslash continuations joined."""
    out, inside, pending = [], False, ""
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        code = re.split(r"\s+#\s", " " + line, maxsplit=1)[0].strip()
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        if pending + code:
            out.append(" ".join((pending + code).split()))
        pending = ""
    return out


COMMANDS = readme_commands()


def _pick(prefix: str, *contains: str) -> list[str]:
    return [c for c in COMMANDS if c.startswith(prefix) and all(s in c for s in contains)]


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200", PYTHONUNBUFFERED="1")
    env.pop("DISTEVAL_FAULTS", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _python(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0] == "python", command
    return [sys.executable, *argv[1:]]


def test_every_readme_command_has_a_check():
    handled = set(_pick("python3.11 -m venv") + _pick("pip install") + _pick("apt-get install") + _pick("python -m pytest")
                  + _pick("python -m disteval") + _pick("python -m diagnostics doctor")
                  + _pick("python scripts/train_reference_cnns.py"))
    assert len(COMMANDS) >= 10 and set(COMMANDS) == handled, sorted(set(COMMANDS) - handled)


def test_install_and_test_commands_are_the_ones_ci_runs():
    """pip/apt lines: .ci/run runs each on a fresh machine (same packages; -q aside); the CPU-wheel line pins the
    torch and torchvision versions that pyproject.toml pins; ``python -m pytest`` is CI's test command."""
    pins = dict(re.findall(r'"(torch|torchvision)==([\d.]+)"', (REPO / "pyproject.toml").read_text()))
    installs = [seg.strip() for c in _pick("python3.11 -m venv") + _pick("pip install") + _pick("apt-get install")
                for seg in c.split("&&") if " install " in seg]
    assert any("-c requirements/lock.txt" in seg for seg in installs)  # the lock file (issue 48 point 1)
    for command in installs:
        if "download.pytorch.org/whl/cpu" in command:
            assert f"torch=={pins['torch']}" in command and f"torchvision=={pins['torchvision']}" in command
            continue
        words = shlex.split(command)
        packages = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
        assert packages and any("install" in line and all(p in line for p in packages) for line in CI.splitlines()), \
            f"README's {command!r} is not run by .ci/run"
    # CI installs into a fresh virtual environment, as README's quick start does
    assert re.search(r"^rm -rf \.venv-ci$", CI, re.M) and "-m venv .venv-ci" in CI
    assert _pick("python -m pytest") == ["python -m pytest"] and CI.rstrip().splitlines()[-1] == "python -m pytest"


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> Path:
    """README's main job (`python3.11 -m venv ... && pip install ... && python -m disteval`: the venv and the install
    are CI's own) as written."""
    [command] = _pick("python3.11 -m venv", "python -m disteval")
    tmp = tmp_path_factory.mktemp("main_job")
    job = command.split("&&")[-1].strip()
    proc = _run([*_python(job), f"hydra.run.dir={tmp / 'run'}"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_results(tmp / "run")["metrics"]["top1"] == pytest.approx(0.9852, abs=1e-4)  # as README states
    return tmp / "run"


def test_doctor_commands_on_the_main_job(main_job):
    commands = _pick("python -m diagnostics doctor")
    assert len(commands) == 2
    for command in commands:
        proc = _run(_python(command.replace("RUN_DIR", str(main_job))), main_job.parent, timeout=300)
        assert proc.returncode == 0 and "healthy" in proc.stdout, (command, proc.stdout[-2000:], proc.stderr[-2000:])


def test_local_sweep_over_world_sizes(tmp_path):
    """`python -m disteval -m dist.world_size=1,2,4` (on 64 samples): every job completes with the same metrics."""
    [command] = [c for c in _pick("python -m disteval -m") if "submitit" not in c]
    proc = _run([*_python(command), "data.limit=64", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [r["world_size"] for r in rows] == ["1", "2", "4"] and {r["status"] for r in rows} == {"completed"}
    assert len({r["value"] for r in rows}) == 1 and not any(r["flag"] for r in rows)
    for r in rows:  # the pipeline column: each job's bound and the images/s its loader delivered (its results.json)
        pipe = json.loads((Path(r["run_dir"]) / "results.json").read_text())["pipeline"]
        assert r["pipeline"] == pipe["bound"] in ("input", "compute")
        assert float(r["delivered_images_per_s"]) == pytest.approx(pipe["delivered_images_per_s"], rel=1e-12)


def test_card_slurm_command_with_its_placeholder_data_root_is_refused_before_submission(tmp_path):
    """`+experiment=imagenet_vit hydra/launcher=submitit_slurm data.root=/path/to/imagenet/val`: exit 2 before
    anything is submitted, naming the missing data root (or, on a machine without SLURM, the missing cluster, or,
    where SLURM's commands are installed but no controller runs, the controller that does not answer)."""
    [command] = _pick("python -m disteval +experiment=imagenet_vit", "submitit_slurm")
    proc = _run([*_python(command), f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "configuration error" in text, text[-3000:]
    assert ("data.root: '/path/to/imagenet/val' does not exist" in text or "needs a SLURM cluster" in text
            or "the SLURM controller does not answer" in text), text[-3000:]
    assert not (tmp_path / "run" / ".submitit").exists()


@pytest.mark.slurm
def test_slurm_sweep_larger_than_the_cluster_is_shaped_first_and_reported_partial(tmp_path):
    """README's SLURM sweep `dist.world_size=1,2,4,8` (64 samples) on the 4-CPU test cluster: the 8-rank job is
    refused before anything is submitted (sinfo's CPUs, not sbatch's traceback), the others run to the end with
    equal metrics, the driver says the sweep is partial (exit 1), the summary marks the refused job and the
    doctor does not call the sweep healthy."""
    if slurm_unavailable():
        pytest.skip(slurm_unavailable())
    [command] = _pick("python -m disteval -m hydra/launcher=submitit_slurm")
    sweep = tmp_path / "sweep"
    proc = _run([*_python(command), "data.limit=64", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}"],
                tmp_path)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1, text[-3000:]
    assert "partial sweep" in text and "3 of 4 job(s) completed, 1 not submitted" in text and "Traceback" not in text
    rows = {r["world_size"]: r for r in csv.DictReader(open(sweep / "summary.csv"))}
    assert [rows[w]["status"] for w in ("1", "2", "4", "8")] == ["completed"] * 3 + ["refused"]
    assert len({rows[w]["value"] for w in ("1", "2", "4")}) == 1
    assert "cannot hold this job" in rows["8"]["error"] and "at most 4 rank(s) fit" in rows["8"]["error"]
    assert not (sweep / "3" / "ranks").exists() and not (sweep / "3" / ".submitit").exists()
    out = _run([sys.executable, "-m", "diagnostics", "doctor", str(sweep), "--json"], tmp_path, timeout=300)
    verdicts = [r["verdict"] for r in json.loads(out.stdout)["runs"]]
    assert out.returncode == 1 and verdicts[:3] == [None] * 3 and "cannot hold" in verdicts[3]["finding"]


def test_training_the_reference_cnn_reproduces_the_shipped_checkpoint_bit_for_bit(tmp_path):
    """`python scripts/train_reference_cnns.py` for digits (the Fashion-MNIST half takes minutes: not run here),
    as README writes it, from a folder of the test's (its default output folder is ./reference-cnns there; the
    checkout's shipped files stay as they are): the held-out top-1 README states; the state dict equals the
    shipped disteval/models/checkpoints/digits_cnn.pt bit for bit where the torch version and CPU kernel set are
    the ones its provenance.json records (measured: AVX512 reproduces it, ATEN_CPU_CAPABILITY=avx2 does not),
    and the script says so either way."""
    [command] = _pick("python scripts/train_reference_cnns.py")
    shipped_dir = REPO / "disteval" / "models" / "checkpoints"
    before = {p.name: p.read_bytes() for p in shipped_dir.iterdir()}
    argv = [sys.executable, str(REPO / shlex.split(command)[1]), *shlex.split(command)[2:], "--only", "digits"]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0 and "held-out top-1 0.9852" in proc.stdout, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in shipped_dir.iterdir()} == before  # README's command left them alone
    trained = torch.load(tmp_path / "reference-cnns" / "digits_cnn.pt", weights_only=True)
    shipped = torch.load(shipped_dir / "digits_cnn.pt", weights_only=True)
    prov = json.loads((shipped_dir / "provenance.json").read_text())
    same = (prov["torch"] == torch.__version__.split("+")[0]
            and prov["cpu_capability"] == torch.backends.cpu.get_cpu_capability())
    equal = trained.keys() == shipped.keys() and all(torch.equal(trained[k], shipped[k]) for k in shipped)
    if same:
        assert equal and "bit-identical to the shipped checkpoints expected" in proc.stdout
    else:
        assert "not bit-identical to the shipped checkpoints" in proc.stdout
