"""Fault drills on real runs (real processes, real signals, a real full filesystem where the test may mount
one): stalls during the final synchronisation name the rank that stopped, not the one that waited; a killed
driver leaves no rank behind and is diagnosed as such; one live run per run directory, finished results never
overwritten without eval.overwrite=true; a full disk is named; SIGTERM and SIGINT exit as shells expect."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_results, run_disteval
from recorded_runs import diagnostics_cli
from disteval.job.records import pid_alive

pytestmark = pytest.mark.slow
QUICK = ("eval.progress=false", "data.batch_size=16")
TIMEOUT_S = 5


def doctor_json(run_dir: Path) -> tuple[int, dict]:
    """``python -m diagnostics doctor RUN_DIR --json`` from the run's parent directory, in this process (it only
    reads records: ``recorded_runs.diagnostics_cli``); (exit code, the run's JSON)."""
    proc = diagnostics_cli(["doctor", str(run_dir), "--json"], cwd=run_dir.parent)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)["runs"][0]


def status(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / "ranks" / f"rank{rank}" / "status.json").read_text())


def start(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m disteval`` in the background, as a user's shell would start it."""
    return subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", *QUICK, *overrides],
                            cwd=run_dir.parent, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_phase(run_dir: Path, ranks: range, phase: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(status(run_dir, r)["phase"] == phase for r in ranks):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"ranks {list(ranks)} never reached phase {phase!r} in {run_dir}")


@pytest.mark.parametrize("faults,stopped,waiting_phase", [
    ("stop@0:sync=1;delay@1:batch=1,seconds=3", 0, "sync"),     # rank 0 stopped in sync, rank 1 still in forward
    ("stop@1:sync=1;delay@0:batch=1,seconds=3", 1, "sync"),     # the reverse
    ("stop@1:batch=1", 1, "forward"),                            # stopped in forward while rank 0 waits in sync
], ids=["rank0-stopped-in-sync", "rank1-stopped-in-sync", "rank1-stopped-in-forward"])
def test_a_stopped_rank_is_named_not_the_rank_that_waited(tmp_path, faults, stopped, waiting_phase):
    run = tmp_path / "run"
    proc = run_disteval(*QUICK, "dist.world_size=2", f"communication.timeout_s={TIMEOUT_S}", run_dir=run,
                        env={"DISTEVAL_FAULTS": faults}, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    waiter = 1 - stopped
    launch = json.loads((run / "launch.json").read_text())
    assert launch["outcome"] == "failed" and launch["error"]["rank"] == stopped, launch["error"]
    assert f"rank {stopped} stopped making progress" in proc.stderr
    s_stopped, s_waiter = status(run, stopped), status(run, waiter)
    assert s_waiter["error"]["type"] == "PeerFailedError" and s_waiter["error"]["blames"] == stopped
    assert s_waiter["error"]["evidence"]["rank"] == stopped
    assert s_stopped["error"] is None and s_stopped["phase"] == ("sync" if "sync=1" in faults else "forward")
    # no rank outlives the driver (the stopped one was killed), and the run ended about one timeout after the
    # stopped rank's last heartbeat (the launcher's grace of 3 s included), not after the agent's 30 s
    assert not pid_alive(s_stopped["pid"]) and not pid_alive(s_waiter["pid"])
    assert launch["t_end"] - s_stopped["t_heartbeat"] < 3 * TIMEOUT_S + 5, launch["t_end"] - s_stopped["t_heartbeat"]
    code, diag = doctor_json(run)
    assert code == 1 and diag["culprit_rank"] == stopped, diag["verdict"]
    assert diag["verdict"] is not None


def test_killed_driver_leaves_no_rank_behind(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "dist.world_size=2", f"communication.timeout_s={TIMEOUT_S}",
                 env={"DISTEVAL_FAULTS": "delay@*:batch=2,seconds=60"})
    try:
        wait_for_phase(run, range(2), "forward")
        time.sleep(1.0)
        proc.kill()  # SIGKILL: the driver cannot record anything
        proc.communicate(timeout=30)
        pids = [status(run, r)["pid"] for r in range(2)]
        deadline = time.monotonic() + TIMEOUT_S + 5
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in pids), "ranks outlived their killed driver"
    finally:
        proc.kill()
    for r in range(2):
        err = status(run, r)["error"]
        assert err is not None and err["type"] == "DriverDiedError", err
    launch = json.loads((run / "launch.json").read_text())
    assert launch["outcome"] == "running" and launch["pid"] == proc.pid and launch.get("boot_id")
    code, diag = doctor_json(run)
    assert code == 1, diag
    assert "driver" in diag["verdict"]["finding"] and "died" in diag["verdict"]["finding"], diag["verdict"]


def test_one_live_run_per_run_directory_and_finished_results_are_kept(tmp_path):
    run = tmp_path / "run"
    a = start(run, "dist.world_size=1", env={"DISTEVAL_FAULTS": "delay@0:batch=2,seconds=8"})
    wait_for_phase(run, range(1), "forward")
    b = run_disteval(*QUICK, "dist.world_size=1", run_dir=run)  # same hydra.run.dir while A runs
    assert b.returncode == 2, b.stderr[-2000:]
    assert f"run directory {run} is in use by another run: pid {a.pid}" in " ".join(b.stderr.split())
    out, err = a.communicate(timeout=240)
    assert a.returncode == 0, err[-2000:]
    first = load_results(run)
    assert first["run_dir"] == str(run) and json.loads((run / "launch.json").read_text())["pid"] == a.pid
    hydra_a = (run / ".hydra" / "overrides.yaml").read_text()

    again = run_disteval(*QUICK, "dist.world_size=1", "data.limit=100", run_dir=run)  # a finished run's dir
    assert again.returncode == 2 and "eval.overwrite=true" in again.stderr, again.stderr[-2000:]
    assert load_results(run) == first and (run / ".hydra" / "overrides.yaml").read_text() == hydra_a

    over = run_disteval(*QUICK, "dist.world_size=1", "data.limit=100", "eval.overwrite=true", run_dir=run)
    assert over.returncode == 0, over.stderr[-2000:]
    assert load_results(run)["dataset"]["num_samples"] == 100
    kept = list((run / "previous").iterdir())
    assert len(kept) == 1
    assert json.loads((kept[0] / "results.json").read_text()) == first  # the old results, untouched
    assert (kept[0] / ".hydra" / "overrides.yaml").read_text() == hydra_a  # with their own config
    assert "data.limit=100" in (run / ".hydra" / "overrides.yaml").read_text()


def test_a_stale_lock_of_a_killed_driver_is_taken_over(tmp_path):
    run = tmp_path / "run"
    a = start(run, "dist.world_size=1", env={"DISTEVAL_FAULTS": "delay@0:batch=2,seconds=60"})
    wait_for_phase(run, range(1), "forward")
    a.kill()
    a.communicate(timeout=30)
    b = run_disteval(*QUICK, "dist.world_size=1", run_dir=run)
    assert b.returncode == 0, b.stderr[-2000:]
    text = " ".join(b.stderr.split())
    assert f"took over the lock of {run} from pid {a.pid}" in text and "no longer running" in text
    kept = list((run / "previous").iterdir())
    assert json.loads((kept[0] / "launch.json").read_text())["outcome"] == "running"  # A's records, kept aside
    assert load_results(run)["world_size"] == 1


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signals_exit_as_shells_expect(recorded_run, sig, code):
    """The signal reaches the driver mid-run, rank 1 delayed in its first batch and rank 0 waiting for it
    (recorded_runs.signalled_driver; the SIGINT run is shared with test_doctor.py's interrupted run)."""
    signalled = recorded_run(f"driver-{sig.name}")
    run = signalled.run_dir  # only read
    assert signalled.returncode == code, signalled.stderr[-2000:]
    launch = json.loads((run / "launch.json").read_text())
    assert launch["outcome"] == "interrupted" and launch["exit_code"] == code
    assert not (run / "results.json").exists()


def _check_full_disk_records(run: Path, returncode: int, stderr: str, ranks: list[int]) -> None:
    assert returncode == 1, stderr[-2000:]
    text = " ".join(stderr.split())
    assert "no space left on device (ENOSPC)" in text and "{'message'" not in text
    launch = json.loads((run / "launch.json").read_text())
    err = launch["error"]
    assert launch["outcome"] == "failed" and err["type"] == "DiskFullError" and err["errno"] == "ENOSPC"
    assert err["rank"] in ranks and err["path"].startswith(str(run)) and err["bytes_needed"] > 0
    assert err["path"] in text and f"{err['bytes_needed']:,} bytes" in text
    assert not (run / "results.json").exists() and not list(run.glob("**/.results.json.*.tmp"))
    code, diag = doctor_json(run)
    assert code == 1 and "ENOSPC" in json.dumps(diag["verdict"]), diag["verdict"]


def test_injected_full_disk_is_named(tmp_path):
    run = tmp_path / "run"
    proc = run_disteval(*QUICK, "dist.world_size=2", run_dir=run, env={"DISTEVAL_FAULTS": "diskfull@1:batch=2"})
    _check_full_disk_records(run, proc.returncode, proc.stderr, [1])
    _, diag = doctor_json(run)  # recognised as the drill it is: its remedy unsets it
    assert "injected by a fault drill" in diag["verdict"]["finding"] and diag["remedy"]["unset"] == ["DISTEVAL_FAULTS"]


@pytest.fixture
def small_fs(tmp_path):
    """A real 16 MiB tmpfs (root may mount one: CI runs as root); skipped with the reason elsewhere."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"no permission to mount a small tmpfs here ({proc.stderr.strip()}); "
                    "test_injected_full_disk_is_named covers the same path with an injected ENOSPC")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_is_named(small_fs, tmp_path):
    run = small_fs / "run"
    proc = start(run, "dist.world_size=2", env={"DISTEVAL_FAULTS": "delay@*:batch=2,seconds=3"})
    wait_for_phase(run, range(2), "forward")
    with open(small_fs / "filler", "wb") as f:  # fill the filesystem while the ranks evaluate
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    out, err = proc.communicate(timeout=240)
    failed = [r for r in range(2) if (status(run, r).get("error") or {}).get("type") == "DiskFullError"]
    assert failed, [status(run, r).get("error") for r in range(2)]
    _check_full_disk_records(run, proc.returncode, err, failed)
    _, diag = doctor_json(run)  # a real full disk under a delay drill: not called the drill's
    assert "injected" not in diag["verdict"]["finding"] and not diag["remedy"]["unset"], diag


def test_idle_ranks_and_empty_predictions_are_warned_about(tmp_path):
    from conftest import SHARED

    run = tmp_path / "idle"
    proc = run_disteval(*QUICK, "dist.world_size=3", "data.limit=20", run_dir=run)  # 2 batches of 16 for 3 ranks
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = load_results(run)
    idle = [p["rank"] for p in res["per_rank"] if p["samples"] == 0]
    assert idle == [2] and any("rank(s) [2] of 3 had nothing to evaluate" in w for w in res["warnings"])
    assert "had nothing to evaluate" in " ".join(proc.stdout.split())

    gt = SHARED / "data" / "coco" / "fce_cocoapi" / "instances_val2014_100.json"
    if not gt.exists():
        pytest.skip(f"{gt} is absent (../shared/data beside the checkout)")
    empty = tmp_path / "empty_results.json"
    empty.write_text("[]")
    run = tmp_path / "empty"
    proc = run_disteval("eval.progress=false", "+experiment=coco_replay", f"data.annotations={gt}",
                        f"data.predictions={empty}", "dist.world_size=1", run_dir=run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = load_results(run)
    assert res["metrics"]["AP"] in (0.0, -1.0)
    assert any("holds no detections" in w for w in res["warnings"]), res["warnings"]
    assert "holds no detections" in " ".join(proc.stderr.split())


def test_a_reused_sweep_directory_is_refused_then_archived_with_overwrite(tmp_path):
    sweep = tmp_path / "sweep"

    def multirun(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "disteval", "-m", "data.limit=40,60", "dist.world_size=1",
                               f"hydra.sweep.dir={sweep}", *QUICK, *extra], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)

    first = multirun()
    assert first.returncode == 0, first.stderr[-2000:]
    jobs = [sweep / "0", sweep / "1"]
    before = [load_results(j) for j in jobs]
    assert [r["dataset"]["num_samples"] for r in before] == [40, 60]
    for j in jobs:  # each job keeps its own config and driver log (nothing of the job itself archived)
        assert (j / ".hydra" / "config.yaml").exists() and (j / "disteval.log").stat().st_size > 0
        assert not (j / "previous").exists()

    again = multirun()
    assert again.returncode == 2 and "eval.overwrite=true" in again.stderr, again.stderr[-2000:]
    assert [load_results(j) for j in jobs] == before

    # a second sweep into the directory of a live one is refused before it writes anything
    live = subprocess.Popen([sys.executable, "-m", "disteval", "-m", "data.limit=40", "dist.world_size=1",
                             f"hydra.sweep.dir={sweep}", "eval.overwrite=true", *QUICK], cwd=tmp_path, text=True,
                            env={**os.environ, "DISTEVAL_FAULTS": "delay@0:batch=1,seconds=6"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_phase(sweep / "0", range(1), "forward")
    rival = multirun("eval.overwrite=true")
    assert rival.returncode == 2 and f"run directory {sweep} is in use by another run: pid {live.pid}" in \
        " ".join(rival.stderr.split()), rival.stderr[-2000:]
    live.communicate(timeout=240)
    assert live.returncode == 0
    kept = [p for p in (sweep / "previous").iterdir()]
    assert len(kept) == 1  # the first sweep, whole: both jobs with their configs, its summary
    for name, old in zip(("0", "1"), before):
        assert json.loads((kept[0] / name / "results.json").read_text()) == old
        assert (kept[0] / name / ".hydra" / "config.yaml").exists()
    assert (kept[0] / "summary.csv").exists() and not (sweep / "1").exists()  # no stale job of the old sweep
    assert load_results(sweep / "0")["dataset"]["num_samples"] == 40


def test_a_signal_sent_to_one_rank_names_that_rank(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "dist.world_size=2", env={"DISTEVAL_FAULTS": "delay@*:batch=1,seconds=30"})
    wait_for_phase(run, range(2), "forward")
    os.kill(status(run, 1)["pid"], signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    launch = json.loads((run / "launch.json").read_text())
    assert launch["error"]["rank"] == 1 and "rank 1 was interrupted from outside" in launch["error"]["message"]
    assert "0" not in launch["error"].get("deaths", {})  # rank 0 was only stopped by the launcher, not a death


def test_a_refused_torchrun_rerun_writes_nothing_into_a_finished_run(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "disteval",
           f"hydra.run.dir={run}", *QUICK, "communication.timeout_s=20"]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    snapshot = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".disteval.lock"}
    again = subprocess.run(cmd + ["data.limit=100", "seed=5"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode != 0 and "eval.overwrite=true" in again.stderr, again.stderr[-2000:]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".disteval.lock"} == snapshot


def test_a_rank_without_any_record_still_reports_a_full_disk_to_the_launcher():
    """A rank that cannot even write its first status record tells the launcher only its error message; the
    launcher recovers the DiskFullError's fields from it for launch.json."""
    from disteval.errors import DiskFullError
    from launchers.local import disk_full_from_message

    exc = DiskFullError("/runs/a b/ranks/rank1/status.json", 1234, 0)
    fields = disk_full_from_message(f"exited with code 1 (DiskFullError: {exc})")
    assert fields == {"type": "DiskFullError", "errno": "ENOSPC", "path": "/runs/a b/ranks/rank1/status.json",
                      "bytes_needed": 1234, "free_bytes": None}
    assert disk_full_from_message("exited with code 1 (RuntimeError: boom)") == {}
