"""``python -m diagnostics doctor`` on runs with real faults: ranks really killed, delayed, pointed at the wrong
port, a port really held by another socket, a padded sampler, a nondeterministic model, a rank with other
weights. For each, the verdict, the culprit rank and the remedy are asserted; --apply fixes the delayed rank
end to end; a healthy run is healthy (exit 0)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from conftest import REPO, load_results, run_disteval
from recorded_runs import copy_run, diagnostics_cli
from test_doctor_experiments import assert_report
from disteval.common.ranges import batch_aligned_bounds
from disteval.models.reference_cnn import DigitsCNN

pytestmark = pytest.mark.slow
CKPT = REPO / "disteval" / "models" / "checkpoints" / "digits_cnn.pt"
QUICK = ("eval.progress=false", "data.batch_size=16")


def doctor(run_dir: Path, *flags: str, env: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """Run ``python -m diagnostics doctor RUN_DIR --json`` as a user would, from the run's parent directory;
    returns (exit code, the JSON). Reading records only, it runs in this process (``diagnostics_cli``)."""
    proc = diagnostics_cli(["doctor", str(run_dir), "--json", *flags], cwd=run_dir.parent, env=env, timeout=timeout)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema_version"] == 2
    for entry in report["runs"]:  # every verdict rests on recorded evidence and says where the failure happened
        v = entry["verdict"]
        if v is not None:
            assert v["status"] in ("fail", "unknown") and v["evidence"], v
            assert v["phase"] is not None or v["status"] == "unknown", v
            assert proc.returncode != 0 or entry.get("fixed"), entry  # --apply may have fixed it
    return proc.returncode, report


def verdict(report: dict) -> tuple[str | None, int | None, list[str] | None, dict]:
    run = report["runs"][0]
    v = run["verdict"]
    remedy = run["remedy"]
    return (None if v is None else f"{v['state']}/{v['check']}", run["culprit_rank"],
            None if remedy is None else remedy["overrides"], remedy or {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_external(run_dir: Path, world_size: int, overrides: list[str], ports: list[int] | None = None,
                    cwds: list[Path] | None = None, timeout: float = 180, env: dict | None = None) -> list[int]:
    """Start ``world_size`` processes of ``python -m disteval`` as an external launcher (torchrun, srun) would:
    env:// variables per rank; ``ports``/``cwds`` per rank let a test misconfigure one. Returns exit codes."""
    port = free_port()
    procs = []
    for r in range(world_size):
        rank_env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str((ports or [port] * world_size)[r]), PYTHONUNBUFFERED="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", *overrides],
                                      cwd=(cwds or [run_dir.parent] * world_size)[r], env=rank_env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


def digits_logits(checkpoint: Path) -> tuple[np.ndarray, np.ndarray]:
    """Independent single-process forward over the digits test split (sklearn's split, as the dataset's ids)."""
    x, y = load_digits(return_X_y=True)
    _, x_te, _, y_te = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    model = DigitsCNN()
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    with torch.no_grad():
        logits = model.eval()(torch.tensor(x_te / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)).numpy()
    return logits, y_te


def test_healthy_run_with_trials_and_probes(tmp_path):
    run = tmp_path / "healthy"
    proc = run_disteval(*QUICK, "dist.world_size=3", "eval.trials=2", run_dir=run)
    assert proc.returncode == 0, proc.stderr
    res = load_results(run)
    logits, labels = digits_logits(CKPT)
    assert res["metrics"]["top1"] == pytest.approx(float((logits.argmax(1) == labels).mean()), abs=1e-12)
    assert res["trials"]["agree"] and res["trials"]["values"]["top1"] == [res["metrics"]["top1"]] * 2
    code, report = doctor(run, "--probe")
    assert code == 0, report
    assert verdict(report)[0] is None
    statuses = {c["check"]: c["status"] for c in report["runs"][0]["checks"]}
    assert statuses["launch"] == statuses["started"] == statuses["joined"] == statuses["ranks_ran"] == "pass"
    assert statuses["trials"] == "pass" and statuses["coverage"] == "pass"
    probes = report["runs"][0]["probes"]
    assert probes["rendezvous"]["missing"] == []
    assert probes["drift"]["max_abs_logit_diff"] == [0.0, 0.0, 0.0]  # same weights, same CPU: identical logits
    assert probes["balance"]["samples"] == [e - s for s, e in (batch_aligned_bounds(540, 16, 3, r) for r in range(3))]
    assert probes["latency"]["suggested_timeout_s"] >= 30


def test_killed_rank(tmp_path):
    """With loader workers (their processes outlive the killed rank and hold its pipes, so elastic sees rank 0
    end first): the driver still names rank 1 and how it died (the launcher's reaper reads the zombie's exit)."""
    run = tmp_path / "killed"
    proc = run_disteval(*QUICK, "dist.world_size=2", "data.num_workers=2", run_dir=run,
                        env={"DISTEVAL_FAULTS": "kill@1:batch=2"})
    assert proc.returncode == 1
    assert "rank 1 was killed by SIGKILL" in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    assert json.loads((run / "launch.json").read_text())["error"]["rank"] == 1
    code, report = doctor(run)
    state, culprit, overrides, remedy = verdict(report)
    assert (code, state, culprit) == (1, "INIT/ranks_ran", 1)
    assert "SIGKILL" in report["runs"][0]["verdict"]["finding"]
    # launch.json knows it was a drill, so the remedy is to unset it (not the OOM remedy: a smaller batch)
    assert overrides == [] and "fault drill" in remedy["why"]
    # only what is true: its record is a lower bound of its progress, and the run was killed, not timed out
    assert "a lower bound" in report["runs"][0]["verdict"]["finding"]
    code, report = doctor(run, "--apply", "--backoff-s=0")
    effect = report["runs"][0]["attempts"][0]["effect"]
    assert code == 0 and effect["failed_run_timeout_s"] is None, effect
    assert "gave up" not in effect["said"] and "after its launch" in effect["said"], effect
    launch = json.loads((run / "launch.json").read_text())
    launch.pop("faults")
    (run / "launch.json").write_text(json.dumps(launch))
    code, report = doctor(run)
    assert verdict(report)[2] == ["data.batch_size=8"]  # SIGKILL without an error: the OOM killer's signature
    assert "data.batch_size=8" in report["runs"][0]["remedy"]["command"]


def test_delayed_rank_past_timeout_and_apply_fixes_it(tmp_path):
    run = tmp_path / "delayed"
    env = {"DISTEVAL_FAULTS": "delay@1:batch=2,seconds=8"}
    proc = run_disteval(*QUICK, "dist.world_size=2", "communication.timeout_s=3", run_dir=run, env=env)
    assert proc.returncode == 1 and ("rank 1 stalled" in proc.stderr or "rank 1 stopped making progress" in proc.stderr)
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    assert (code, state, culprit, overrides) == (1, "COMM/timeout", 1, ["communication.timeout_s=60"])
    # --apply: the fault is still there (same environment), the remedy makes the run pass
    code, report = doctor(run, "--apply", "--backoff-s=0", env=env)
    attempts = report["runs"][0]["attempts"]
    assert code == 0, attempts
    assert len(attempts) == 1 and attempts[0]["fixed"] and "communication.timeout_s=60" in attempts[0]["overrides"]
    fixed = load_results(Path(attempts[0]["run_dir"]))
    logits, labels = digits_logits(CKPT)
    assert fixed["metrics"]["top1"] == pytest.approx(float((logits.argmax(1) == labels).mean()), abs=1e-12)
    assert fixed["coverage"]["ok"]


@pytest.mark.parametrize("external", [False, True])
def test_slow_rank_zero_is_named_not_the_peers_that_waited(tmp_path, external):
    """Rank 0 (which also watches its peers) is the slow one: the peers finish, wait in the synchronisation
    and time out. The culprit is rank 0 and the remedy a longer timeout, under either launcher."""
    run = tmp_path / "slow0"
    faults = {"DISTEVAL_FAULTS": "delay@0:batch=1,seconds=12"}
    if external:
        launch_external(run, 3, ["communication.timeout_s=4", *QUICK], env=faults)
    else:
        proc = run_disteval(*QUICK, "dist.world_size=3", "communication.timeout_s=4", run_dir=run, env=faults)
        assert proc.returncode == 1
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    assert (code, state, culprit, overrides) == (1, "COMM/timeout", 0, ["communication.timeout_s=60"])


def test_interrupted_run_blames_no_rank(tmp_path, recorded_run):
    """Ctrl-C (SIGINT) on the driver while rank 1 is delayed (recorded_runs.signalled_driver, a run shared with
    test_hardening.py::test_signals_exit_as_shells_expect)."""
    interrupted = recorded_run("driver-SIGINT")
    assert interrupted.returncode == 130
    run = copy_run(interrupted.run_dir, tmp_path / "interrupted")
    code, report = doctor(run)
    state, culprit, _, _ = verdict(report)
    assert (code, state, culprit) == (1, "INIT/launch", None) and "interrupted" in report["runs"][0]["verdict"]["finding"]


def test_wrong_master_port_on_one_rank(tmp_path):
    run = tmp_path / "wrongport"
    good, bad = free_port(), free_port()
    codes = launch_external(run, 2, ["communication.timeout_s=5", *QUICK], ports=[good, bad])
    assert codes[0] != 0 and codes[1] != 0
    code, report = doctor(run)
    state, culprit, overrides, remedy = verdict(report)
    assert (code, state, culprit) == (1, "INIT/joined", 1)
    assert remedy["env"] == {"MASTER_PORT": str(good)} and overrides == []


def test_killed_rank_under_an_external_launcher(tmp_path):
    """No launcher record says how the rank ended: its status stops in 'forward' with no error while its peers
    fail with network errors. The doctor must name it, not a victim, and never call the run healthy."""
    run = tmp_path / "extkill"
    env_codes = launch_external(run, 3, ["communication.timeout_s=5", *QUICK], env={"DISTEVAL_FAULTS": "kill@1:batch=1"})
    assert env_codes[1] == -9 and all(c != 0 for c in env_codes)
    code, report = doctor(run)
    state, culprit, _, _ = verdict(report)
    assert (code, state, culprit) == (1, "INIT/ranks_ran", 1)


def test_exclusion_is_decided_once_for_all_trials(tmp_path):
    run = tmp_path / "trials_excl"
    proc = run_disteval(*QUICK, "dist.world_size=3", "eval.trials=2", "eval.exclude_outlier_ranks=true", run_dir=run,
                        env={"DISTEVAL_FAULTS": "weights@2:std=0.5"})
    assert proc.returncode == 0, proc.stderr
    res = load_results(run)
    start, end = res["per_rank"][2]["shard"]
    assert res["exclusion"]["ranks"] == [2] and res["metrics"]["num_samples"] == 540 - (end - start)
    assert res["trials"]["agree"]  # both trials evaluated the same kept samples
    logits, labels = digits_logits(CKPT)
    keep = np.r_[0:start, end:len(labels)]
    assert res["metrics"]["top1"] == pytest.approx(float((logits[keep].argmax(1) == labels[keep]).mean()), abs=1e-12)


def test_port_in_use(tmp_path, recorded_run):
    """``dist.master_port`` held by another socket (recorded_runs.port_in_use, a run shared with
    test_cli.py::test_master_port_in_use_fails_before_ranks)."""
    proc = recorded_run("port-in-use")
    assert proc.returncode == 2 and "already in use" in proc.stderr
    run = copy_run(proc.run_dir, tmp_path / "portinuse")
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    assert (code, state, culprit, overrides) == (1, "INIT/launch", None, ["dist.master_port=0"])


def test_padded_sampler_duplicates(tmp_path):
    run = tmp_path / "padded"
    proc = run_disteval(*QUICK, "dist.world_size=4", "data.limit=10", "data.sampler=padded", run_dir=run)
    assert proc.returncode == 0, proc.stderr
    res = load_results(run)
    # torch's DistributedSampler pads 10 samples to 12 over 4 ranks: 2 ids counted twice, on ranks 2 and 3
    assert res["exact"] is False and res["coverage"]["duplicated"] == 2 and res["metrics"]["num_samples"] == 12
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    assert (code, state, culprit, overrides) == (1, "SHARDS/plan", 2, ["data.sampler=exact"])


def test_nondeterministic_trials_disagree(tmp_path):
    run = tmp_path / "noisy"
    proc = run_disteval(*QUICK, "dist.world_size=2", "eval.trials=3", run_dir=run, env={"DISTEVAL_FAULTS": "noise@*:std=3"})
    assert proc.returncode == 0, proc.stderr
    trials = load_results(run)["trials"]
    # NLL, not top-1: a confident model's top-1 count can come out equal in three noisy trials by chance
    values = np.array(trials["values"]["nll"])
    assert not trials["agree"] and len(set(values.tolist())) > 1
    st = trials["stats"]["nll"]
    assert st["median"] == np.median(values) and st["std"] == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    assert load_results(run)["metrics"]["nll"] == np.median(values)  # eval.trial_aggregate=median by default
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    # on CPU the forward is deterministic anyway: no config remedy, the finding names the model as the source
    assert (code, state, overrides) == (1, "CONVERGENCE/trials", None)
    assert "draws random numbers" in report["runs"][0]["verdict"]["finding"]


def test_rank_with_different_weights_is_an_outlier(tmp_path):
    """Three externally launched ranks with the same overrides; rank 1's working directory holds another
    checkpoint under the same relative path (a node with a stale file)."""
    state = torch.load(CKPT, weights_only=True)
    gen = torch.Generator().manual_seed(7)
    stale = {k: v + 0.5 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in state.items()}
    cwds = []
    for r in range(3):
        d = tmp_path / f"node{r}"
        d.mkdir()
        torch.save(stale if r == 1 else state, d / "weights.pt")
        cwds.append(d)
    torch.save(stale, tmp_path / "stale.pt")
    run = tmp_path / "outlier"
    assert launch_external(run, 3, [*QUICK, "model.checkpoint=weights.pt"], cwds=cwds) == [0, 0, 0]
    code, report = doctor(run)
    state_, culprit, overrides, _ = verdict(report)
    assert (code, state_, culprit, overrides) == (1, "RESULT/outliers", 1, ["eval.exclude_outlier_ranks=true"])
    # the canary saw rank 1's other bits on the same kernels: not the hardware, a warning that points here
    hw = next(c for c in report["runs"][0]["checks"] if (c["state"], c["check"]) == ("CONVERGENCE", "hardware"))
    assert hw["status"] == "warn" and hw["culprit_rank"] == 1 and "same kernels" in hw["finding"], hw
    # opt-in exclusion: the metric leaves out exactly rank 1's shard and says so
    run2 = tmp_path / "excluded"
    assert launch_external(run2, 3, [*QUICK, "model.checkpoint=weights.pt", "eval.exclude_outlier_ranks=true"],
                           cwds=cwds) == [0, 0, 0]
    res = load_results(run2)
    start, end = res["per_rank"][1]["shard"]
    assert res["exclusion"]["ranks"] == [1] and res["exclusion"]["samples_left_out"] == end - start
    logits, labels = digits_logits(CKPT)
    keep = np.r_[0:start, end:len(labels)]
    assert res["metrics"]["num_samples"] == len(keep)
    assert res["metrics"]["top1"] == pytest.approx(float((logits[keep].argmax(1) == labels[keep]).mean()), abs=1e-12)
    stale_logits, _ = digits_logits(tmp_path / "stale.pt")
    mixed = np.concatenate([logits[:start], stale_logits[start:end], logits[end:]])
    assert res["exclusion"]["metrics_all_ranks"]["top1"] == pytest.approx(float((mixed.argmax(1) == labels).mean()),
                                                                          abs=1e-12)
    code, report = doctor(run2)
    assert code == 0 and verdict(report)[0] is None  # excluded as asked: a warning, not a failure


def test_failed_job_of_a_local_sweep_does_not_stop_the_sweep(tmp_path):
    """Hydra's basic launcher runs the jobs in one process: a failed job is marked failed, the next job runs,
    the summary lists both, and the doctor diagnoses the sweep directory job by job."""
    sweep = tmp_path / "sweep"
    with socket.socket() as holder:  # the W=2 job needs the rendezvous port, the W=1 job does not
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "disteval", "-m", "dist.world_size=2,1", f"dist.master_port={port}",
                               f"hydra.sweep.dir={sweep}", *QUICK], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
    assert proc.returncode == 1
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert rows[1].startswith("1,1,completed") and rows[2].startswith("0,2,failed") and "already in use" in rows[2]
    # Hydra's sweeper ends the sweep before its end callbacks: the CLI prints the summary and the last line
    assert proc.stderr.strip().splitlines()[-1] == f"disteval: report: {sweep / 'report.html'}", proc.stderr[-2000:]
    assert "sweep summary" in proc.stderr and (sweep / "report.html").is_file()
    code, report = doctor(sweep)
    assert code == 1 and [r["verdict"] and r["verdict"]["check"] for r in report["runs"]] == ["launch", None]


def test_doctor_cannot_finish_on_a_missing_directory(tmp_path):
    proc = diagnostics_cli(["doctor", str(tmp_path / "nope")], cwd=tmp_path)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_probes_and_sanity_on_every_task_family(tmp_path):
    """``doctor --probe`` builds data and model through the run's Task: detection, keypoints, embedding (kNN),
    segmentation (shared files) and streamed runs are probed (drift on the canary: identical outputs on every
    rank; streamed data says why there is no balance), and each healthy run's verdict is none (its task names
    its main metric in results.json ``task.main_metric``)."""
    import importlib.util

    from disteval.data.coco_keypoints_synthetic import make_synthetic_keypoints
    from disteval.data.coco_synthetic import make_synthetic_coco

    gt, dt = make_synthetic_coco(tmp_path / "coco", num_images=20, num_categories=3, dets_per_image=6, seed=2)
    kgt, kdt = make_synthetic_keypoints(tmp_path / "kp", num_images=20, seed=2)
    jobs = {"detection": ("+experiment=coco_replay", f"data.annotations={gt}", f"data.predictions={dt}",
                          "data.batch_size=4"),
            "keypoints": ("+experiment=coco_keypoints_replay", f"data.annotations={kgt}", f"data.predictions={kdt}",
                          "data.batch_size=4"),
            "embedding": ("+experiment=fashion_mnist_knn", "eval.embedding.gallery_limit=300",
                          "eval.embedding.query_limit=60", "eval.embedding.knn_k=[10]", "data.batch_size=64")}
    shared = REPO.parent / "shared"
    if (shared / "data" / "coco").is_dir():
        jobs["segmentation"] = ("+experiment=coco_semseg_replay", "data.limit=12", "data.batch_size=4")
    spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
    make_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_shards)
    assert make_shards.main(["--root", "/usr/share/datasets/fashion-mnist", "--out", str(tmp_path / "shards"),
                             "--samples-per-shard", "100", "--limit", "200", "--index"]) == 0
    jobs["streamed"] = ("+experiment=fashion_mnist_shards", f"data.urls='{tmp_path}/shards/fashion-mnist-test-"
                        "{000000..000001}.tar'", "data.index=null", "data.batch_size=50")
    for name, job in jobs.items():
        run = tmp_path / name
        proc = run_disteval(*job, "dist.world_size=2", "eval.progress=false", run_dir=run,
                            env={"DISTEVAL_SHARED": str(shared)})
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        main = load_results(run)["task"]["main_metric"]
        assert main in load_results(run)["metrics"], name
        assert_report(run, proc.stderr)  # every experiment's report.html renders
        code, report = doctor(run, "--probe", env={"DISTEVAL_SHARED": str(shared)})  # the config names ../shared
        assert (code, verdict(report)[0]) == (0, None), (name, report["runs"][0]["verdict"])
        probes = report["runs"][0]["probes"]
        assert probes["rendezvous"]["missing"] == [] and not probes.get("error"), (name, probes)
        if name == "streamed":
            assert "streamed data" in probes["balance"]["skipped"] and "drift" not in probes
        else:
            assert probes["drift"]["max_abs_logit_diff"] == [0.0, 0.0], (name, probes["drift"])
            assert sum(probes["balance"]["samples"]) == load_results(run)["dataset"]["num_samples"], name


def test_two_nodes_without_a_rendezvous_endpoint(tmp_path):
    """dist.nnodes=2 without dist.rdzv_endpoint stops at the config check (exit 2); its record is the run
    directory's own launch.json, and the doctor quotes it (it once found no run there, or said the error went
    only to the console)."""
    run = tmp_path / "noendpoint"
    proc = run_disteval(*QUICK, "dist.nnodes=2", run_dir=run)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert json.loads((run / "launch.json").read_text())["error"]["key"] == "dist.rdzv_endpoint"
    code, report = doctor(run)
    state, culprit, overrides, _ = verdict(report)
    assert (code, state, culprit) == (1, "INIT/launch", None)
    finding = report["runs"][0]["verdict"]["finding"]
    assert "at dist.rdzv_endpoint: dist.nnodes=2 needs the rendezvous" in finding, finding


def test_preemption_drill_is_recognised(tmp_path):
    """DISTEVAL_FAULTS=preempt@*:batch=3 outside SLURM: the checkpoint signal (SIGUSR2) ends the ranks; the doctor
    names the death and, seeing the drill in launch.json, says to unset it (not "rerun unchanged")."""
    run = tmp_path / "preempt"
    proc = run_disteval(*QUICK, "dist.world_size=2", run_dir=run, env={"DISTEVAL_FAULTS": "preempt@*:batch=3"})
    assert proc.returncode == 1 and "SIGUSR2" in proc.stderr, proc.stderr[-2000:]
    code, report = doctor(run)
    state, culprit, overrides, remedy = verdict(report)
    assert (code, state) == (1, "INIT/ranks_ran") and "SIGUSR2" in report["runs"][0]["verdict"]["finding"]
    assert overrides == [] and remedy["unset"] == ["DISTEVAL_FAULTS"] and "fault drill" in remedy["why"]
