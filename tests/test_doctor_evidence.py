"""Verdicts from evidence, not from patterns (issue 13 item 7): real runs of ``python -m disteval`` with real
faults, and for each the doctor's verdict, the record and phase it rests on, and whether ``--apply`` may run
its remedy. Values are checked against what the test itself knows (the URL in torchvision's table, the pid it
killed, the filesystem it filled, the fault it injected), not against the doctor's own reading.

Cases: a weights download failing offline, on the driver and in a rank (a model problem, never a rendezvous
one); ``dist.master_port`` out of range (up front, and under an external launcher); a submitit launcher
without ``-m``; external ranks that stop before opening their records ('unknown' when nothing says why); a
driver killed mid-run (never healthy; 'unknown' where the evidence conflicts); a full disk recorded, and a
dead driver on a full disk; a rank stopped (SIGSTOP) in the forward pass, in the synchronisation and while
the run still runs; a blamed rank that was only waiting in a collective.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torchvision

from conftest import REPO, run_disteval
from disteval.tasks.classification import ClassificationTask
from recorded_runs import copy_run
from test_doctor import QUICK, doctor, launch_external

pytestmark = pytest.mark.slow
WEIGHTS = ("model.name=resnet18", "model.weights=IMAGENET1K_V1", "model.num_classes=null", "data.name=imagefolder",
           "data.limit=4")
WEIGHTS_URL = torchvision.models.get_model_weights("resnet18")["IMAGENET1K_V1"].url


class FetchInRankTask(ClassificationTask):
    """A plug-in classification task whose author left out the driver-side preflight: each rank fetches the
    weights itself while building the model, after the process group exists."""

    def preflight(self, notes):
        pass


def offline(tmp_path: Path) -> dict:
    """An empty torch hub cache and an HTTPS proxy whose name cannot resolve (``.invalid`` never does, RFC
    2606): the download fails with 'Name or service not known' on any machine, online or not."""
    home = tmp_path / "torch_home"
    home.mkdir(exist_ok=True)
    proxy = "http://proxy.invalid:3128"
    return {"TORCH_HOME": str(home), "https_proxy": proxy, "HTTPS_PROXY": proxy, "no_proxy": "", "NO_PROXY": "",
            "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory) -> Path:
    """An ImageFolder root with the 1000 class folders the ImageNet weights need, one 8x8 image each."""
    from PIL import Image

    root = tmp_path_factory.mktemp("imagenet_like")
    img = Image.new("RGB", (8, 8), (40, 80, 120))
    for c in range(1000):
        (root / f"n{c:08d}").mkdir()
        img.save(root / f"n{c:08d}" / "a.png")
    return root


def entry(report: dict) -> tuple[dict, dict | None]:
    run = report["runs"][0]
    return run["verdict"], run["remedy"]


def edit(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def assert_apply_refuses(run: Path, why: str, env: dict | None = None) -> None:
    """``--apply`` stops with a clear line instead of rerunning: no attempt, no attempt directory."""
    code, report = doctor(run, "--apply", "--backoff-s=0", env=env)
    run_entry = report["runs"][0]
    assert code == 1 and run_entry["attempts"] == [] and why in (run_entry["apply_stopped"] or ""), run_entry
    assert not (run / "doctor").exists()


# ------------------------------------------------------------------------------------ download offline
def test_offline_weights_download_on_the_driver_is_a_model_problem(tmp_path, imagenet_like):
    """The driver's preflight fetches the weights: 'Name or service not known' in its message is about the
    download host, not the rendezvous address (the old doctor remedied dist.master_addr=127.0.0.1)."""
    run = tmp_path / "fetch_driver"
    proc = run_disteval(*QUICK, *WEIGHTS, f"data.root={imagenet_like}", run_dir=run, env=offline(tmp_path))
    assert proc.returncode == 2 and not (run / "ranks").exists(), proc.stderr
    error = json.loads((run / "launch.json").read_text())["error"]
    assert error["key"] == "model.weights" and "Name or service not known" in error["message"]
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["status"], v["phase"]) == (1, "INIT", "launch", "fail", "preflight")
    assert WEIGHTS_URL in v["finding"] and urlparse(WEIGHTS_URL).hostname in v["finding"]
    assert "rendezvous" in v["finding"] and "not involved" in v["finding"]
    assert {"source": "launch.json", "field": "error.key", "line": None, "value": "model.weights"} in v["evidence"]
    assert remedy["overrides"] == [] and remedy["env"] == {} and remedy["changes_cause"] is False
    assert remedy["command"] is None and "model.checkpoint=PATH" in remedy["why"]
    assert_apply_refuses(run, "cannot change the cause", env=offline(tmp_path))


def test_offline_weights_download_in_a_rank_is_a_data_problem(tmp_path, imagenet_like):
    """The ranks build the model after joining the process group; the download fails there: the traceback
    (torch.hub's download) decides the phase, the process group is not blamed."""
    run = tmp_path / "fetch_rank"
    proc = run_disteval(*QUICK, *WEIGHTS, f"data.root={imagenet_like}", "eval.task=test_doctor_evidence:FetchInRankTask",
                        run_dir=run, env=offline(tmp_path))
    assert proc.returncode == 1, proc.stderr
    statuses = {r: json.loads((run / "ranks" / f"rank{r}" / "status.json").read_text()) for r in range(2)}
    failed = {r for r, s in statuses.items() if (s.get("error") or {}).get("type") == "URLError"}
    assert failed and all(statuses[r]["joined"] for r in failed)  # the process group existed when it failed
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["status"], v["phase"]) == (1, "INIT", "ranks_ran", "fail", "data")
    assert v["culprit_rank"] in failed and WEIGHTS_URL in v["finding"]
    assert any(e["source"].endswith("torch/hub.py") and e["line"] for e in v["evidence"])  # the frame it rests on
    checks = {c["check"]: c["status"] for c in report["runs"][0]["checks"]}
    assert checks["joined"] == "pass" and remedy["changes_cause"] is False
    assert_apply_refuses(run, "cannot change the cause", env=offline(tmp_path))
    # the same failure before `joined` was set (records edited: today the model is built only after the process
    # group exists, so no rank can reach this download before joining): still a data problem, never rendezvous
    for r in failed:
        edit(run / "ranks" / f"rank{r}" / "status.json", lambda s: s.pop("joined"))
    code, report = doctor(run)
    v, _ = entry(report)
    assert (v["check"], v["phase"]) == ("ranks_ran", "data")
    assert {c["check"]: c["status"] for c in report["runs"][0]["checks"]}["joined"] == "pass"


# ----------------------------------------------------------------------------------------- ports, launchers
def test_master_port_out_of_range_is_refused_up_front(tmp_path):
    run = tmp_path / "port70000"
    proc = run_disteval(*QUICK, "dist.master_port=70000", run_dir=run)
    assert proc.returncode == 2 and not (run / "ranks").exists()
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["check"], v["status"], v["phase"]) == (1, "launch", "fail", "preflight")
    assert "dist.master_port=70000" in v["finding"] and "never started" not in v["finding"]
    assert remedy["overrides"] == ["dist.master_port=0"] and remedy["changes_cause"] is True


def test_master_port_out_of_range_under_an_external_launcher(tmp_path):
    """An external launcher hands the ranks MASTER_PORT=70000: each fails inside the process-group start."""
    run = tmp_path / "extport"
    codes = launch_external(run, 2, [*QUICK, "communication.timeout_s=5"], ports=[70000, 70000])
    assert all(c != 0 for c in codes)
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["status"], v["phase"]) == (1, "INIT", "joined", "fail", "rendezvous")
    r = v["culprit_rank"]
    assert {"source": f"ranks/rank{r}/status.json", "field": "rendezvous.master_port", "line": None,
            "value": "70000"} in v["evidence"]
    assert remedy["changes_cause"] is False  # the external launcher's setting: not the doctor's to change


def test_submitit_launcher_without_multirun_that_was_refused(tmp_path):
    """``hydra/launcher=submitit_slurm`` without ``-m`` used to be refused before anything was recorded but
    .hydra/, and the doctor said 'rank 0 never started: rerun unchanged'. Records edited from a real refused run
    (``data.batch_size=0``): .hydra/hydra.yaml's launcher choice set to submitit_slurm and launch.json removed,
    as such a refusal left them (today the job is submitted instead, so it cannot be reproduced)."""
    from omegaconf import OmegaConf

    run = tmp_path / "slurm_no_m"
    assert run_disteval(*QUICK, "data.batch_size=0", run_dir=run).returncode == 2
    hydra_yaml = run / ".hydra" / "hydra.yaml"
    cfg = OmegaConf.load(hydra_yaml)
    assert cfg.hydra.mode == "RUN"
    cfg.hydra.runtime.choices["hydra/launcher"] = "submitit_slurm"
    OmegaConf.save(cfg, hydra_yaml)
    (run / "launch.json").unlink()
    (run / "disteval.log").unlink(missing_ok=True)
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["check"], v["status"], v["phase"]) == (1, "launch", "fail", "preflight")
    assert "without -m" in v["finding"] and remedy["changes_cause"] is False and remedy["command"] is None
    assert {"source": ".hydra/hydra.yaml", "field": "hydra.mode", "line": None, "value": "RUN"} in v["evidence"]
    assert not any(c["check"] == "started" and c["status"] == "fail" for c in report["runs"][0]["checks"])
    assert_apply_refuses(run, "cannot change the cause")


def test_external_ranks_that_stop_before_their_records(tmp_path):
    """Externally launched ranks refuse a bad config before opening any record: no launch.json, no status. The
    driver log (when written) names a configuration error; without it nothing says why: 'unknown'."""
    run = tmp_path / "extconfig"
    assert launch_external(run, 2, [*QUICK, "data.batch_size=0"]) == [2, 2]
    assert not (run / "ranks").exists() and not (run / "launch.json").exists()
    code, report = doctor(run)
    v, remedy = entry(report)
    assert code == 1 and v["check"] == "started" and remedy is None
    log = run / "disteval.log"
    if log.exists() and "configuration error" in log.read_text():
        assert (v["status"], v["phase"]) == ("fail", "preflight")
        assert any(e["source"] == "disteval.log" and e["line"] for e in v["evidence"])
    log.unlink(missing_ok=True)  # records of a disteval without a driver log: nothing says why
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["status"], remedy) == (1, "unknown", None)
    assert "no launch.json" in v["finding"] and "no rank status record" in v["finding"]
    assert_apply_refuses(run, "unknown")


# ------------------------------------------------------------------------------------------ driver died
def _start(run: Path, overrides: list[str], faults: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", DISTEVAL_FAULTS=faults)
    return subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run}", *overrides], cwd=run.parent,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.3)


def _status(run: Path, r: int) -> dict:
    try:
        return json.loads((run / "ranks" / f"rank{r}" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _stop_group(proc: subprocess.Popen, run: Path, world_size: int) -> None:
    """End the driver's session (its ranks are in its process group; a stopped rank takes SIGKILL) and any rank
    of this run still alive outside it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the driver's pid
    proc.wait(timeout=60)
    for r in range(world_size):
        pid = _status(run, r).get("pid")
        try:
            if pid and "disteval" in Path(f"/proc/{pid}/cmdline").read_text() + Path(f"/proc/{pid}/environ").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture(scope="module")
def killed_driver(tmp_path_factory) -> dict:
    """One driver SIGKILLed mid-run, read by the two tests below (each diagnoses its own copy): two ranks, rank 1
    delayed in its first batch; the doctor's report while the run was alive; then the kill, and both ranks'
    records left 'failed'. Returns the run directory, the driver's pid and that report."""
    run = tmp_path_factory.mktemp("killed_driver") / "driverkill"
    proc = _start(run, ["dist.world_size=2", *QUICK], "delay@1:batch=1,seconds=60")
    try:
        _wait_for(lambda: all(_status(run, r).get("phase") in ("forward", "sync") for r in range(2)))
        _, alive = doctor(run)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_for(lambda: all(_status(run, r).get("phase") == "failed" for r in range(2)), timeout=60)
    finally:
        _stop_group(proc, run, 2)
    return {"run": run, "pid": proc.pid, "alive_report": alive}


def test_killed_driver_is_never_healthy(tmp_path, killed_driver):
    """SIGKILL the driver mid-run: launch.json stays 'running'. The doctor must say the driver died, citing
    its pid and host, never 'healthy' or 'still running'."""
    report = killed_driver["alive_report"]  # alive: a warning, not a verdict
    launch_check = next(c for c in report["runs"][0]["checks"] if c["check"] == "launch")
    assert launch_check["status"] == "warn" and "alive" in launch_check["finding"]
    run, pid = copy_run(killed_driver["run"], tmp_path / "driverkill"), killed_driver["pid"]
    launch = json.loads((run / "launch.json").read_text())
    assert launch["outcome"] == "running" and launch["pid"] == pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["status"], v["culprit_rank"]) == (1, "INIT", "launch", "fail", None)
    assert "died" in v["finding"] and str(pid) in v["finding"]
    assert {"source": "launch.json", "field": "pid", "line": None, "value": str(pid)} in v["evidence"]
    assert any(e["source"] == "launch.json" and e["field"] == "t_heartbeat" for e in v["evidence"])
    assert remedy["changes_cause"] is False
    assert_apply_refuses(run, "cannot change the cause")


def test_killed_driver_from_records_without_driver_died_errors(tmp_path, killed_driver):
    """The same kill (the same run, copied), judged from the pid and the heartbeats alone (records edited to
    what a runtime without DriverDiedError leaves: ranks stopped silently; timestamps aged by 60 s instead of
    waiting 10 s for the heartbeats to go stale). Fresh heartbeats, or another host, leave the evidence
    undecided: 'unknown'."""
    run = copy_run(killed_driver["run"], tmp_path / "driverkill_old")

    def age(record, by=60.0):
        for key in ("t_heartbeat", "t_update", "t_progress", "t_start", "joined"):
            if isinstance(record.get(key), (int, float)):
                record[key] -= by
    for r in range(2):
        edit(run / "ranks" / f"rank{r}" / "status.json", lambda s: (age(s), s.update(phase="forward", error=None)))
    edit(run / "launch.json", age)
    code, report = doctor(run)
    v, _ = entry(report)
    assert (code, v["check"], v["status"]) == (1, "launch", "fail") and "died" in v["finding"]
    # fresh by the record's own period (60 s: stale after 180 s), so a doctor slow to start on a busy machine
    # still reads it fresh (the default period's 10 s floor was once passed before the doctor read the record)
    edit(run / "launch.json", lambda rec: rec.update(t_heartbeat=time.time(), heartbeat_s=60.0))
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["check"], v["status"], remedy) == (1, "launch", "unknown", None)
    assert "fresh" in v["finding"]
    edit(run / "launch.json", lambda rec: (age(rec), rec.pop("heartbeat_s"), rec.update(host="another-host.example")))
    code, report = doctor(run)
    v, _ = entry(report)
    assert (code, v["check"], v["status"]) == (1, "launch", "unknown") and "another-host.example" in v["finding"]


# -------------------------------------------------------------------------------------------- full disk
def _in_tiny_filesystem(tmp_path: Path, size: str, script: str, timeout: float = 300) -> Path:
    """Run ``script`` (bash; $FS is a fresh tmpfs of ``size``, $OUT a folder outside it) in a private mount
    namespace (``unshare -rm``: no privileges needed, nothing mounted outside); returns $OUT, where the script
    copies what the test reads."""
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is needed to mount a small private tmpfs")
    out, fs = tmp_path / "out", tmp_path / "fs"
    out.mkdir()
    fs.mkdir()
    env = dict(os.environ, FS=str(fs), OUT=str(out), PYTHONUNBUFFERED="1")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"unprivileged mount namespaces are disabled here: {probe.stderr.decode()[:200]}")
    proc = subprocess.run(["unshare", "-rm", "bash", "-c", f'mount -t tmpfs -o size={size} tmpfs "$FS" && {script}'],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_full_disk_is_named_and_not_rerun(tmp_path):
    """A run directory on a filesystem with room for the 1 MiB reserve and little more: a rank's record hits
    ENOSPC. The verdict names ENOSPC, the file and the bytes it needed; --apply would rerun into the same disk."""
    out = _in_tiny_filesystem(tmp_path, "1060k", f'''
        cd "$FS" && {sys.executable} -m disteval hydra.run.dir="$FS/run" {" ".join(QUICK)} > "$OUT/console.txt" 2>&1
        echo $? > "$OUT/rc"
        python_doctor() {{ {sys.executable} -m diagnostics doctor "$FS/run" --json "$@"; }}
        python_doctor > "$OUT/doctor.json"; echo $? > "$OUT/doctor_rc"
        python_doctor --apply > "$OUT/apply.json"; ls "$FS/run" > "$OUT/after_apply.txt"
        cp -r "$FS/run" "$OUT/run"''')
    assert (out / "rc").read_text().strip() == "1", (out / "console.txt").read_text()
    launch = json.loads((out / "run" / "launch.json").read_text())
    err = launch["error"]
    assert err["errno"] == "ENOSPC" and err["bytes_needed"] > 0
    report = json.loads((out / "doctor.json").read_text())
    v, remedy = entry(report)
    assert ((out / "doctor_rc").read_text().strip(), v["check"], v["status"]) == ("1", "launch", "fail")
    assert "ENOSPC" in v["finding"] and err["path"] in v["finding"] and f"{err['bytes_needed']:,} bytes" in v["finding"]
    assert v["phase"] is not None and remedy["changes_cause"] is False and "hydra.run.dir" in remedy["why"]
    applied = json.loads((out / "apply.json").read_text())["runs"][0]
    assert applied["attempts"] == [] and "cannot change the cause" in applied["apply_stopped"]
    assert "doctor" not in (out / "after_apply.txt").read_text().split()


def test_dead_driver_on_a_full_disk(tmp_path):
    """The driver dies mid-run (SIGKILL) and its run directory's filesystem is full: the driver most likely
    died of the full disk, and the verdict says so with the free bytes it rests on."""
    out = _in_tiny_filesystem(tmp_path, "4m", f'''
        cd "$FS"
        DISTEVAL_FAULTS="delay@1:batch=1,seconds=60" {sys.executable} -m disteval hydra.run.dir="$FS/run" \\
            {" ".join(QUICK)} > "$OUT/console.txt" 2>&1 &
        DRIVER=$!  # the python process itself (a simple command in the background)
        for i in $(seq 600); do grep -qs '"phase": "forward"' "$FS/run/ranks/rank1/status.json" && break; sleep 0.2; done
        kill -9 $DRIVER; wait $DRIVER; echo $DRIVER > "$OUT/driver_pid"
        for i in $(seq 300); do grep -qs '"phase": "failed"' "$FS/run/ranks/rank1/status.json" && break; sleep 0.2; done
        dd if=/dev/zero of="$FS/fill" bs=4k 2>/dev/null; true
        {sys.executable} -c "import shutil; print(shutil.disk_usage('$FS/run').free)" > "$OUT/free"
        {sys.executable} -m diagnostics doctor "$FS/run" --json > "$OUT/doctor.json"; echo $? > "$OUT/doctor_rc"
        cp "$FS/run/launch.json" "$OUT/"''')
    free = int((out / "free").read_text())
    assert free < 64 * 1024  # the filesystem is full (independently of the doctor)
    assert json.loads((out / "launch.json").read_text())["outcome"] == "running"
    v, remedy = entry(json.loads((out / "doctor.json").read_text()))
    assert ((out / "doctor_rc").read_text().strip(), v["check"], v["status"]) == ("1", "launch", "fail")
    assert "full disk" in v["finding"] and (out / "driver_pid").read_text().strip() in v["finding"]
    assert any(e["field"] == "shutil.disk_usage.free" for e in v["evidence"])
    assert remedy["changes_cause"] is False


# ---------------------------------------------------------------------------------------------- stalls
def test_stopped_rank_in_forward_is_the_culprit_and_no_timeout_helps(tmp_path):
    """Rank 1 stops itself (SIGSTOP) in the forward pass: its heartbeat stops; rank 0 finishes and waits. The
    culprit is rank 1 (not the waiting rank 0), and the remedy is not a longer timeout."""
    run = tmp_path / "stop1"
    proc = run_disteval(*QUICK, "dist.world_size=2", "communication.timeout_s=4", run_dir=run,
                        env={"DISTEVAL_FAULTS": "stop@1:batch=2"})
    assert proc.returncode == 1
    s0, s1 = _status(run, 0), _status(run, 1)
    assert s0["error"]["blames"] == 1 and s1["error"] is None
    assert s0["error"]["time"] - s1["t_heartbeat"] > 3 * s1["heartbeat_s"]  # rank 1's heartbeat stopped first
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["culprit_rank"], v["phase"]) == (1, "COMM", "timeout", 1, "forward")
    assert "stopped" in v["finding"]
    assert {"source": "ranks/rank1/status.json", "field": "t_heartbeat", "line": None,
            "value": repr(s1["t_heartbeat"])} in v["evidence"]
    assert not any(o.startswith("communication.timeout_s") for o in remedy["overrides"])
    assert remedy["unset"] == ["DISTEVAL_FAULTS"]  # launch.json says it was a drill
    edit(run / "launch.json", lambda rec: rec.update(faults=None))  # the same records without the drill
    code, report = doctor(run)
    v, remedy = entry(report)
    assert (v["culprit_rank"], remedy["overrides"], remedy["changes_cause"]) == (1, [], False)


def test_stopped_rank_zero_in_the_synchronisation(tmp_path):
    """Rank 0 stops on reaching the synchronisation; ranks 1 and 2 wait in it with fresh heartbeats until their
    collective times out (or their watchdog blames rank 0, whichever comes first). Every rank then shows a
    consequence or nothing, all shards are complete: only the heartbeats tell rank 0 (the earliest network
    error or the lowest waiting rank was the old rule's answer)."""
    run = tmp_path / "stop0sync"
    proc = run_disteval(*QUICK, "dist.world_size=3", "communication.timeout_s=4", run_dir=run,
                        env={"DISTEVAL_FAULTS": "stop@0:sync=1"})
    assert proc.returncode == 1
    s = {r: _status(run, r) for r in range(3)}
    assert s[0]["error"] is None and s[0]["phase"] == "sync"
    for r in (1, 2):  # waiting in the synchronisation, beating, when rank 0 had long stopped
        assert s[r]["in_collective"]["op"] == "synchronise"
        assert s[r]["t_heartbeat"] - s[0]["t_heartbeat"] > 3 * s[0]["heartbeat_s"]
    # the first to time out records it; the other may be terminated by the launcher before its own timeout (a
    # loaded machine lets them enter the synchronisation a second apart) and then records nothing
    assert any(s[r]["error"] for r in (1, 2))
    code, report = doctor(run)
    v, _ = entry(report)
    assert (code, v["check"], v["culprit_rank"], v["phase"]) == (1, "timeout", 0, "sync") and "stopped" in v["finding"]
    # the other order of a loaded machine: only the later waiter recorded its timeout, the first was terminated
    late = max((1, 2), key=lambda r: (bool(s[r]["error"]), s[r]["t_heartbeat"]))
    edit(run / "ranks" / f"rank{3 - late}" / "status.json", lambda rec: rec.update(error=None))
    code, report = doctor(run)
    v, _ = entry(report)
    assert (code, v["check"], v["culprit_rank"], v["phase"]) == (1, "timeout", 0, "sync")


def test_stopped_rank_while_the_run_still_runs(tmp_path):
    """With a long timeout nobody gives up yet: launch.json says running and the driver lives, but rank 1 is
    stopped (its /proc state T): the run is not healthy and rank 1 is named."""
    run = tmp_path / "stop_live"
    proc = _start(run, ["dist.world_size=2", "communication.timeout_s=300", *QUICK], "stop@1:batch=2")
    try:
        _wait_for(lambda: _status(run, 1).get("pid") and
                  Path(f"/proc/{_status(run, 1)['pid']}/stat").read_text().rsplit(") ", 1)[1][:1] == "T")
        code, report = doctor(run)
    finally:
        _stop_group(proc, run, 2)
    v, remedy = entry(report)
    assert (code, v["state"], v["check"], v["status"], v["culprit_rank"]) == (1, "COMM", "heartbeats", "fail", 1)
    assert "stopped" in v["finding"] and any(e["source"].startswith("/proc/") for e in v["evidence"])
    checks = {c["check"]: c["status"] for c in report["runs"][0]["checks"]}
    assert checks["launch"] == "warn"  # the driver itself is alive


def test_a_blamed_rank_that_waited_in_a_collective_is_not_the_culprit(tmp_path):
    """Rank 2 stops; rank 1 finished and waits in the synchronisation with a fresh heartbeat. Records edited so
    that rank 0's error blames rank 1 (what a progress-only watcher would do; the runtime's heartbeat watcher
    cannot be made to): the rule still names rank 2, whose heartbeat stopped first."""
    from launchers.culprit import culprit_from_records

    run = tmp_path / "stop2"
    # rank 0's watchdog (3 s without rank 2's heartbeat) records its error before rank 1's collective times out
    # (10 s) and the launcher stops rank 0 inside its own collective, where it records nothing
    proc = run_disteval(*QUICK, "dist.world_size=3", "communication.timeout_s=10", "dist.heartbeat_timeout_s=3",
                        run_dir=run, env={"DISTEVAL_FAULTS": "stop@2:batch=1"})
    assert proc.returncode == 1
    waiting = _status(run, 1)
    assert waiting["in_collective"] and waiting["t_heartbeat"] >= _status(run, 2)["t_heartbeat"] + 2
    edit(run / "ranks" / "rank0" / "status.json", lambda s: s["error"].update(blames=1))
    records = {r: _status(run, r) for r in range(3)}
    assert culprit_from_records(records).rank == 2
    code, report = doctor(run)
    v, _ = entry(report)
    assert (code, v["check"], v["culprit_rank"]) == (1, "timeout", 2) and "stopped" in v["finding"]


@pytest.mark.parametrize("mode,batch,want", [("bitwise", 64, 1), ("bitwise", 16, 4), ("fast", 64, 3)])
def test_ranks_without_samples_get_a_world_size_that_gives_each_some(mode, batch, want):
    """N=64 over W=8 in whole global batches of 64 (bitwise mode) leaves ranks 1..7 empty: the remedy is the
    number of ranks that hold samples (1), not N (which only fits sample-even shards). Computed by hand: batch 16
    gives 4 batches (4 ranks); fast mode's sample-even shards of N=3 over W=8 leave 5 empty (3 ranks)."""
    from omegaconf import OmegaConf

    from diagnostics.checks import shards_plan
    from diagnostics.evidence import Run

    n = 3 if mode == "fast" else 64
    run = Run(path=Path("run"), config=OmegaConf.create({"eval": {"mode": mode}, "data": {"batch_size": batch},
                                                          "dist": {"world_size": 8}}),
              results={"world_size": 8, "dataset": {"num_samples": n}, "sampler": "exact"})
    finding = shards_plan(run, None)
    assert finding.status == "warn" and "hold no sample" in finding.finding, finding.finding
    assert finding.remedy.overrides == [f"dist.world_size={want}"], finding.remedy


def test_a_live_rank_late_to_the_synchronisation_is_the_culprit_with_the_timeout_that_fired():
    """Issue 48 item 11, on records: rank 0 (no error, phase sync, outside any collective, heartbeat fresh when
    rank 1 gave up) is named as late, with the key and seconds of the CollectiveTimeout rank 1 recorded; with its
    heartbeat stopped 10 s before, it is named as stopped instead (the end-to-end case: tests/test_chaos.py)."""
    from launchers.culprit import culprit_from_records

    def records(beat0: float) -> dict:
        return {0: {"phase": "sync", "error": None, "t_heartbeat": beat0, "heartbeat_s": 1.0, "t_progress": 90.0,
                    "samples_done": 10, "samples_planned": 10, "in_collective": None},
                1: {"phase": "failed", "t_heartbeat": 100.2, "heartbeat_s": 1.0, "t_progress": 95.0,
                    "samples_done": 12, "samples_planned": 12, "in_collective": {"op": "synchronise", "since": 95.0},
                    "error": {"type": "CollectiveTimeout", "time": 100.2, "op": "all_reduce", "timeout_s": 5.0,
                              "timeout_key": "communication.sync_timeout_s",
                              "message": "all_reduce of 1,080 bytes timed out after 5.0 s"}}}

    late = culprit_from_records(records(100.0))
    assert late.rank == 0 and "rank 0 was late" in late.message, late.message
    assert "communication.sync_timeout_s = 5 s" in late.message and "rank 1 gave up" in late.message
    stopped = culprit_from_records(records(90.0))
    assert stopped.rank == 0 and "heartbeat stopped first" in stopped.message, stopped.message


def test_of_two_silent_node_mates_the_one_that_died_first_is_named():
    """The records of a CI run of test_netlab's kill@3 (shared run directory): rank 3 was SIGKILLed, its node-mate
    rank 2 was stopped by their launcher a few milliseconds later; neither recorded an error, rank 1 read the closed
    connection. Rank 2's last heartbeat (one a second) happened to come 18 ms before rank 3's, but it made progress
    after rank 3's last sign of life: rank 3 is named (the heartbeat alone named rank 2)."""
    from launchers.culprit import culprit_from_records

    def rank(r, beat, progress, error=None):
        return {"rank": r, "phase": "failed" if error else "forward", "t_heartbeat": beat, "t_progress": progress,
                "t_update": progress, "heartbeat_s": 1.0, "samples_done": 0, "samples_planned": 128,
                "batches_done": 0, "error": error, "in_collective": None}

    closed = {"type": "RuntimeError", "time": 1796657749.6947095, "message": "[/__w/pytorch/pytorch/third_party/gloo/"
              "gloo/transport/tcp/pair.cc:545] Read error [198.18.0.2]:62142: Connection reset by peer"}
    records = {0: rank(0, 1796657749.086827, 1796657749.6717238,
                       {"type": "PeerFailedError", "time": 1796657749.706072, "message": "rank 1 failed before the "
                        "synchronisation: RuntimeError: " + closed["message"]}),
               1: rank(1, 1796657749.1794531, 1796657749.6293755, closed),
               2: rank(2, 1796657748.803749, 1796657749.5647593),
               3: rank(3, 1796657748.821614, 1796657749.5481563)}
    assert culprit_from_records(records).rank == 3
    records[2]["t_progress"] = records[2]["t_update"] = 1796657749.50  # had rank 2 fallen silent first
    assert culprit_from_records(records).rank == 2
