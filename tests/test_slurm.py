"""Real SLURM jobs through `python -m disteval -m hydra/launcher=submitit_slurm`, on the single-node cluster
that scripts/slurm/start_cluster.sh starts (.ci/run starts it): a sweep over world sizes 1 and 2 (each job at
its own size, metrics equal to the local run, summary written), a failing rank reported as failed with its
own error, a job cancelled with scancel reported as cancelled, and the form without -m submitting the run as
one job (metrics equal to the local run, a failing rank named, a job that cannot be shaped refused with exit 2),
(a sweep with a job larger than the cluster: README's SLURM sweep, tests/test_readme_commands.py).
Skipped with a reason when no cluster answers (CI counts a skip as a failure)."""
import csv
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import load_results, slurm_unavailable
from recorded_runs import diagnostics_cli

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="session")
def slurm():
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)


def _disteval(*args, cwd, timeout=600, wait=True, multirun=True, env=None):
    cmd = [sys.executable, "-m", "disteval", *(["-m"] if multirun else []), "hydra/launcher=submitit_slurm",
           "hydra.launcher.timeout_min=10", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="160", **(env or {}))
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    proc = _disteval("dist.world_size=1,2", f"hydra.sweep.dir={tmp / 'sweep'}", cwd=tmp)
    return proc, tmp / "sweep"


def test_sweep_jobs_run_at_their_own_world_size_and_equal_the_local_run(sweep, cli):
    proc, sweep_dir = sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    local_proc, local_dir = cli("dist.world_size=2")
    assert local_proc.returncode == 0
    local = load_results(local_dir)
    for job, world in (("0", 1), ("1", 2)):
        res = load_results(sweep_dir / job)
        assert res["world_size"] == world and len(res["per_rank"]) == world
        assert res["coverage"]["ok"]
        assert res["metrics"] == local["metrics"] if world == 2 else res["metrics"]["top1"] == local["metrics"]["top1"]
    hosts = {p["host"] for p in load_results(sweep_dir / "1")["per_rank"]}
    assert len(hosts) == 1  # both ranks of the 2-rank job on the one node, as 2 SLURM tasks


def test_doctor_on_the_sweep_probes_through_slurm(sweep):
    """The doctor diagnoses every job of the sweep directory as healthy, and --probe starts its probe ranks the
    way the run was launched: one SLURM job with one task per rank."""
    proc, sweep_dir = sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = diagnostics_cli(["doctor", str(sweep_dir), "--json"], cwd=sweep_dir.parent)
    report = json.loads(out.stdout)
    assert out.returncode == 0 and [r["verdict"] for r in report["runs"]] == [None, None]
    out = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(sweep_dir / "1"), "--probe", "--json"],
                         capture_output=True, text=True, timeout=600)
    probes = json.loads(out.stdout)["runs"][0]["probes"]
    assert out.returncode == 0, probes
    assert probes["launcher"] == "submitit_slurm" and probes["world_size"] == 2
    assert probes["rendezvous"]["missing"] == [] and probes["drift"]["max_abs_logit_diff"] == [0.0, 0.0]
    assert list((sweep_dir / "1" / "doctor").glob("probe-*/submitit/*"))  # really went through submitit


def test_sweep_summary(sweep):
    proc, sweep_dir = sweep
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [(r["world_size"], r["status"]) for r in rows] == [("1", "completed"), ("2", "completed")]
    assert len({r["value"] for r in rows}) == 1 and not any(r["flag"] for r in rows)
    assert (sweep_dir / "summary.png").stat().st_size > 0
    assert "sweep summary" in proc.stdout


def test_failing_rank_is_reported_with_its_own_error(slurm, tmp_path):
    from test_cli import _fake_fashion

    _fake_fashion(tmp_path / "fm", [0, 1, 2, 3, 4, 5, 6, 7, 12, 9])
    proc = _disteval("+experiment=fashion_mnist", f"data.root={tmp_path / 'fm'}", "dist.world_size=2", "data.batch_size=4",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert "failed" in text and "rank 1" in text and "label 12 outside [0, 10)" in text, text[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert rows[0]["status"] != "completed" and "label 12" in rows[0]["error"]


def test_cancelled_job_is_reported_as_cancelled(slurm, tmp_path):
    driver = _disteval("+experiment=fashion_mnist", "data.batch_size=1", "dist.world_size=1",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, wait=False)
    status = tmp_path / "sweep" / "0" / "ranks" / "rank0" / "status.json"
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if json.loads(status.read_text())["phase"] == "forward":
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    else:
        driver.kill()
        pytest.fail("the job never started evaluating")
    job_id = _job_id(tmp_path / "sweep")
    subprocess.run(["scancel", str(job_id)], check=True)
    out, err = driver.communicate(timeout=240)
    text = " ".join((out + err).split())
    assert driver.returncode != 0
    assert "CANCELLED" in text, text[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert rows[0]["status"] == "cancelled"


def _job_id(sweep_dir) -> str:
    folders = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and p.name.split("_")[0].isdigit()]
    return folders[0].split("_")[0]


def test_without_multirun_the_run_is_one_slurm_job_equal_to_the_local_run(slurm, tmp_path, cli):
    """The documented form without -m submits the run as one SLURM job (one task per rank) through the same
    launcher, waits, prints its metrics and where results.json went; the run directory (hydra.run.dir) holds
    the job's records, its metrics equal the local run's and the doctor finds it healthy."""
    run_dir = tmp_path / "run"
    proc = _disteval("dist.world_size=2", f"hydra.run.dir={run_dir}", cwd=tmp_path, multirun=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    printed = re.findall(r"^results: (.+)$", proc.stdout, re.M)
    assert printed == [str(run_dir / "results.json")], proc.stdout[-3000:]
    res = load_results(run_dir)
    assert res["world_size"] == 2 and len({p["host"] for p in res["per_rank"]}) == 1 and res["coverage"]["ok"]
    assert _job_id(run_dir).isdigit() and not (run_dir / "launch.json").exists()  # a SLURM job, no local ranks
    local_proc, local_dir = cli("dist.world_size=2")
    assert local_proc.returncode == 0
    assert res["metrics"] == load_results(local_dir)["metrics"]
    out = diagnostics_cli(["doctor", str(run_dir), "--json"], cwd=run_dir.parent)
    assert out.returncode == 0 and [r["verdict"] for r in json.loads(out.stdout)["runs"]] == [None], out.stdout[-3000:]


def test_without_multirun_a_failing_rank_is_named_and_exits_1(slurm, tmp_path):
    from test_cli import _fake_fashion

    _fake_fashion(tmp_path / "fm", [0, 1, 2, 3, 4, 5, 6, 7, 12, 9])
    run_dir = tmp_path / "run"
    proc = _disteval("+experiment=fashion_mnist", f"data.root={tmp_path / 'fm'}", "dist.world_size=2",
                     "data.batch_size=4", f"hydra.run.dir={run_dir}", cwd=tmp_path, multirun=False)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, text[-3000:]
    assert "run failed" in text and "rank 1" in text and "label 12 outside [0, 10)" in text, text[-3000:]
    assert f"doctor {run_dir}" in text
    job = json.loads((run_dir / "job.json").read_text())
    assert job["state"] == "FAILED" and "label 12" in job["error"] and job["job_id"] == _job_id(run_dir)


def test_without_multirun_a_job_that_cannot_be_shaped_is_refused_before_submission(tmp_path):
    run_dir = tmp_path / "run"
    proc = _disteval("dist.world_size=3", "dist.ranks_per_node=2", "model.checkpoint=/nonexistent/ckpt.pt",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path, multirun=False, timeout=300)
    assert proc.returncode == 2 and "configuration error" in proc.stderr and "not a multiple" in proc.stderr
    assert not (run_dir / ".submitit").exists() and not (run_dir / "ranks").exists()
    # every problem in one try (the shape and the missing checkpoint), each printed once
    text = " ".join(proc.stderr.split())
    assert "2 problems" in text and text.count("not a multiple") == 1 and text.count("/nonexistent/ckpt.pt") == 1, text


@pytest.mark.parametrize("path", ["/tmp/plain-1.2_x", "/tmp/a b,c=d", "/tmp/it's", "/tmp/back\\slash\\", "/tmp/~u:v"])
def test_run_dir_survives_hydra_override_quoting(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launchers.submitit import _quote

    assert OverridesParser.create().parse_override(f"hydra.sweep.dir={_quote(path)}").value() == path


def test_requeue_resumes_from_checkpoints_with_identical_metrics(slurm, tmp_path, cli):
    """SLURM's checkpoint signal (USR2, as before a timeout or on preemption) mid-shard: every rank saves its
    states, submitit requeues the job, the ranks resume after their last counted batch, and the metrics equal
    an uninterrupted local run exactly."""
    # 5,000 of the 10,000 images (2,500 a rank): signalled after 100 samples, it lands mid-shard even on a busy
    # machine (a signal after 400 of 1,500 once arrived at 1,404)
    args = ("+experiment=fashion_mnist", "data.batch_size=4", "dist.world_size=2", "data.limit=5000")
    driver = _disteval(*args, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, wait=False)
    status = tmp_path / "sweep" / "0" / "ranks" / "rank1" / "status.json"
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if json.loads(status.read_text()).get("samples_done", 0) > 100:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    else:
        driver.kill()
        pytest.fail("the job never started evaluating")
    subprocess.run(["scancel", "--signal=USR2", _job_id(tmp_path / "sweep")], check=True)
    out, err = driver.communicate(timeout=480)
    assert driver.returncode == 0, (out + err)[-3000:]
    logs = [(tmp_path / "sweep" / "0" / "ranks" / f"rank{r}" / "log.txt").read_text() for r in range(2)]
    assert all("resuming from" in log for log in logs), logs  # not restarted from scratch
    local_proc, local_dir = cli(*args)
    assert local_proc.returncode == 0
    assert load_results(tmp_path / "sweep" / "0")["metrics"] == load_results(local_dir)["metrics"]
    assert not list((tmp_path / "sweep" / "0" / "ranks").glob("rank*/checkpoint.pt"))  # removed when done


def test_a_requeue_without_the_signal_resumes_from_the_journal(slurm, tmp_path, cli):
    """``scontrol requeue`` mid-shard (as SLURM does after a node failure, or a time limit without the checkpoint
    signal): the job is killed and started again with the same job id, no checkpoint was written, and the ranks
    resume from their own journal (eval.resume=auto): only what they did not record is evaluated, and the
    metrics equal an uninterrupted local run's exactly."""
    args = ("+experiment=fashion_mnist", "data.batch_size=4", "dist.world_size=2", "data.limit=2000",
            "eval.journal.every_batches=10")
    # every rank sleeps 12 s after its 25th batch (2 windows recorded): the requeue lands there (submitit's job
    # lets SLURM's SIGTERM pass, SIGKILL follows after KillWait=5 s); the requeued attempt sleeps once more
    driver = _disteval(*args, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, wait=False,
                       env={"DISTEVAL_FAULTS": "delay@*:batch=25,seconds=12"})
    run = tmp_path / "sweep" / "0"
    deadline = time.time() + 240
    while time.time() < deadline and len(list(run.glob("ranks/rank1/journal/*.pt"))) < 2:
        time.sleep(0.2)
    if time.time() >= deadline:
        driver.kill()
        pytest.fail("the job never recorded its progress")
    subprocess.run(["scontrol", "requeue", _job_id(tmp_path / "sweep")], check=True)
    out, err = driver.communicate(timeout=480)
    assert driver.returncode == 0, (out + err)[-3000:]
    res = load_results(run)
    journal = res["journal"]
    assert journal["resumed_from"] == str(run.resolve()) and journal["samples_resumed"] >= 2 * 2 * 10 * 4, journal
    assert journal["samples_resumed"] + journal["samples_evaluated"] == 2000 and res["coverage"]["ok"]
    local_proc, local_dir = cli(*args)
    assert local_proc.returncode == 0
    assert res["metrics"] == load_results(local_dir)["metrics"]


def test_the_driver_says_why_its_job_pends(slurm, tmp_path):
    """A job that cannot start yet (sbatch --begin=now+20: SLURM's reason BeginTime, as a requeued job waiting for
    a dead node shows ReqNodeNotAvail) is said on the console once it has pended 10 s, with the reason and how to
    stop it, instead of a silent wait; the run then completes (exit 0)."""
    run_dir = tmp_path / "run"
    proc = _disteval("dist.world_size=1", f"hydra.run.dir={run_dir}", "++hydra.launcher.additional_parameters.begin=now+20",
                     cwd=tmp_path, multirun=False)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    said = re.findall(r"SLURM job (\d+) is pending for (\d+) s: BeginTime \(the driver keeps waiting; `scancel \1`", text)
    assert len(said) == 1 and int(said[0][1]) >= 10, text[-3000:]
