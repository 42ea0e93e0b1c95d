"""Durable progress and resume at any world size (eval.journal, eval.resume; disteval.rank.journal) with real
``python -m disteval`` runs on the digits test set (540 samples, 34 batches of 16): a rank SIGKILLed mid-loop at
W = 4, the run resumed at W = 1 and at W = 3, that resumed run killed in turn and resumed again at W = 2 (a
chain of records), a record altered on disk, a driver SIGKILLed, a disk that fills while records are written,
fast mode: each run's metrics ``==`` an uninterrupted run's (fast mode: counts exact, floats within rounding),
every sample counted once (results.json coverage) and the split between recorded and evaluated samples
reported. A resume with another setting, or of a run that cannot be resumed exactly, is refused before any
rank starts, naming the setting."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SHARED, load_results, run_disteval
from disteval.testing.checkpoints import perturbed_checkpoints

N = 540
DIGITS_CNN = Path(__file__).resolve().parent.parent / "disteval" / "models" / "checkpoints" / "digits_cnn.pt"
Q = ("eval.progress=false", "data.batch_size=16", "eval.journal.every_batches=2", "eval.ci.resamples=0")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run (W = 1) every resumed run of the default job must equal: its metrics."""
    _, run = _run(tmp_path_factory.mktemp("full"), "full", "dist.world_size=1")
    res = load_results(run)
    assert res["journal"]["samples_recorded"] == N
    return res["metrics"]


def _run(tmp_path, name, *overrides, env=None, ok=True):
    run = tmp_path / name
    proc = run_disteval(*Q, *overrides, run_dir=run, env=env)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run


def _check_resumed(run, want: dict, resumed_from) -> dict:
    got = load_results(run)
    assert got["metrics"] == want, run
    assert got["coverage"]["ok"] and got["exact"], got["coverage"]  # every id once: none twice, none missing
    j = got["journal"]
    assert j["resumed_from"] == str(resumed_from.resolve())
    assert j["samples_resumed"] > 0 and j["samples_resumed"] + j["samples_evaluated"] == N, j
    # the throughput counts the forwarded samples only (over the slowest rank's forward seconds; of the last
    # trial: with eval.trials=2 the second pass evaluated everything)
    forwarded = N if got["trials"] else j["samples_evaluated"]
    assert got["throughput"]["images_per_s"] * got["timings"]["forward"] == pytest.approx(forwarded)
    return j


def test_killed_runs_resume_at_other_world_sizes_with_identical_metrics(tmp_path, full):
    want = full
    proc, killed = _run(tmp_path, "killed", "dist.world_size=4", env={"DISTEVAL_FAULTS": "kill@1:batch=5"}, ok=False)
    assert proc.returncode != 0 and not (killed / "results.json").exists()
    recorded = sorted(p.name for p in killed.glob("ranks/rank1/journal/*.pt"))
    assert recorded == ["000000000144-000000000176.pt", "000000000176-000000000208.pt"]  # batches 9-12 of rank 1
    for w in (1, 3):  # W = 1 with two trials: the first resumes from the records, the second evaluates all
        _, run = _run(tmp_path, f"resumed_w{w}", f"dist.world_size={w}", f"eval.resume={killed}",
                      *(["eval.trials=2"] if w == 1 else []))
        _check_resumed(run, want, killed)
    # a resumed run killed in turn, resumed again at W = 2: the records of both runs are used
    _run(tmp_path, "again", "dist.world_size=3", f"eval.resume={killed}", env={"DISTEVAL_FAULTS": "kill@0:batch=1"},
         ok=False)
    _, run = _run(tmp_path, "chain", "dist.world_size=2", f"eval.resume={tmp_path / 'again'}")
    j = _check_resumed(run, want, tmp_path / "again")
    assert j["samples_resumed"] > load_results(tmp_path / "resumed_w1")["journal"]["samples_resumed"]
    # records torn (cut short) and altered on disk are refused and their batches evaluated again
    torn, altered = (killed / "ranks" / "rank1" / "journal" / name for name in recorded)
    torn.write_bytes(torn.read_bytes()[:-100])
    data = torch.load(altered, weights_only=True)
    key = next(k for k, v in data["states"].items() if v.dtype == torch.int64 and v.numel())
    data["states"][key].view(-1)[0] += 1
    torch.save(data, altered)
    _, run = _run(tmp_path, "altered", "dist.world_size=2", f"eval.resume={killed}")
    j = _check_resumed(run, want, killed)
    assert len(j["refused"]) == 2 and "digest" in j["refused"][1], j["refused"]


def test_the_same_run_directory_given_again_resumes_its_unfinished_run(tmp_path, full):
    """eval.resume=auto (the default): the earlier run's records are moved to RUN_DIR/previous/<time>-<pid>/ and,
    when its settings match, resumed from; eval.resume=null or other settings evaluate everything."""
    want = full
    _run(tmp_path, "run", "dist.world_size=4", env={"DISTEVAL_FAULTS": "kill@2:batch=3"}, ok=False)
    proc, run = _run(tmp_path, "run", "dist.world_size=2")
    (earlier,) = (run / "previous").iterdir()
    assert "resuming the unfinished earlier run" in proc.stderr
    _check_resumed(run, want, earlier)
    # finished now: given again with eval.overwrite=true, nothing unfinished is left to resume
    _run(tmp_path, "run", "dist.world_size=2", "eval.overwrite=true")
    assert load_results(run)["journal"]["resumed_from"] is None
    # other settings, and eval.resume=null: everything evaluated
    _run(tmp_path, "third", "dist.world_size=4", env={"DISTEVAL_FAULTS": "kill@2:batch=3"}, ok=False)
    proc, third = _run(tmp_path, "third", "dist.world_size=1", "data.batch_size=32")
    assert "had other settings (data.batch_size)" in proc.stderr
    assert load_results(third)["journal"]["samples_resumed"] == 0 and load_results(third)["metrics"] == want
    _run(tmp_path, "fourth", "dist.world_size=4", env={"DISTEVAL_FAULTS": "kill@2:batch=3"}, ok=False)
    _, fourth = _run(tmp_path, "fourth", "dist.world_size=1", "eval.resume=null")
    assert load_results(fourth)["journal"]["samples_resumed"] == 0 and load_results(fourth)["metrics"] == want


def test_the_doctor_s_remedy_resumes_and_apply_runs_it(tmp_path, full):
    """A failed run that recorded progress: the doctor's command carries eval.resume=RUN_DIR, and --apply's rerun
    evaluates only what the run did not record, with metrics == an uninterrupted run's."""
    # a rank that fails with an error of its own (its record names it: the verdict does not depend on timing)
    _run(tmp_path, "killed", "dist.world_size=4", env={"DISTEVAL_FAULTS": "error@1:batch=5"}, ok=False)
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(killed), "--apply", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "DISTEVAL_FAULTS"})
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    (entry,) = json.loads(proc.stdout)["runs"]
    assert entry["remedy"]["command"].endswith(f"eval.resume={killed}")
    (attempt,) = entry["attempts"]
    assert attempt["fixed"] and attempt["overrides"][-1] == f"eval.resume={killed}"
    _check_resumed(Path(attempt["run_dir"]), full, killed)


def test_a_resume_of_another_run_is_refused_before_ranks_start(tmp_path, full):
    _, done = _run(tmp_path, "done", "dist.world_size=1", "data.limit=64")
    proc, run = _run(tmp_path, "other", "dist.world_size=1", "data.limit=64", "data.batch_size=32",
                     f"eval.resume={done}", ok=False)
    assert proc.returncode == 2 and "eval.resume" in proc.stderr and "data.batch_size: recorded 16, now 32" in proc.stderr
    assert not (run / "ranks").exists()
    proc, _ = _run(tmp_path, "padded", "dist.world_size=1", "data.limit=64", "data.sampler=padded",
                   f"eval.resume={done}", ok=False)
    assert proc.returncode == 2 and "data.sampler=padded (it pads or drops" in proc.stderr
    proc, _ = _run(tmp_path, "store", "dist.world_size=1", "data.limit=64", "eval.save_predictions=true",
                   f"eval.resume={done}", ok=False)
    assert proc.returncode == 2 and "wrote no prediction store" in proc.stderr
    proc, _ = _run(tmp_path, "none", "dist.world_size=1", f"eval.resume={tmp_path / 'absent'}", ok=False)
    assert proc.returncode == 2 and "no run directory" in proc.stderr


def test_a_killed_driver_and_a_full_disk(tmp_path, full):
    want = full
    # the driver SIGKILLed while its ranks evaluate (every rank slowed after its 3rd batch): the ranks end
    # (they watch the driver), the records stay
    killed = tmp_path / "driver_killed"
    env = dict(os.environ, DISTEVAL_FAULTS="delay@*:batch=3,seconds=30", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={killed}", "dist.world_size=2", *Q],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 120
    while len(list(killed.glob("ranks/rank*/journal/*.pt"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(list(killed.glob("ranks/rank*/journal/*.pt"))) >= 2
    _, run = _run(tmp_path, "after_driver", "dist.world_size=3", f"eval.resume={killed}")
    _check_resumed(run, want, killed)
    # the disk fills after rank 0's 2nd batch: the run fails naming it; the records written before it are whole
    # (no temporary file left) and the run resumes from them once there is space
    proc, disk = _run(tmp_path, "diskfull", "dist.world_size=2", env={"DISTEVAL_FAULTS": "diskfull@0:batch=2"}, ok=False)
    assert proc.returncode == 1 and "ENOSPC" in proc.stderr
    assert not list(disk.glob("ranks/rank*/journal/.tmp*"))
    _, run = _run(tmp_path, "after_disk", "dist.world_size=1", f"eval.resume={disk}")
    _check_resumed(run, want, disk)


def _start(run, *overrides, faults: str):
    env = dict(os.environ, DISTEVAL_FAULTS=faults, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run}", *Q, *overrides], env=env,
                            cwd=run.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _when_recorded(run, windows: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(list(run.glob("ranks/rank*/journal/*.pt"))) < windows:
        assert time.time() < deadline, f"{run}: fewer than {windows} windows recorded in {timeout} s"
        time.sleep(0.2)


def test_interrupted_frozen_and_preempted_runs_resume(tmp_path, full):
    """SIGTERM and SIGINT to the driver mid-loop, a rank frozen (SIGSTOP) until the others give up on it, and the
    checkpoint signal where no launcher requeues (its default action ends the ranks): each resumed at another
    world size, == an uninterrupted run."""
    want = full
    for sig, w in ((signal.SIGTERM, 1), (signal.SIGINT, 3)):
        run = tmp_path / f"driver_{sig.name}"
        proc = _start(run, "dist.world_size=2", faults="delay@*:batch=3,seconds=30")
        _when_recorded(run, 2)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig  # as shells report a death by the signal
        _, resumed = _run(tmp_path, f"resumed_{sig.name}", f"dist.world_size={w}", f"eval.resume={run}")
        _check_resumed(resumed, want, run)
    proc, frozen = _run(tmp_path, "frozen", "dist.world_size=2", "communication.timeout_s=4",
                        env={"DISTEVAL_FAULTS": "stop@1:batch=5"}, ok=False)
    assert proc.returncode == 1 and "rank 1 stopped making progress" in proc.stderr
    _, resumed = _run(tmp_path, "resumed_frozen", "dist.world_size=3", f"eval.resume={frozen}")
    _check_resumed(resumed, want, frozen)
    proc, preempted = _run(tmp_path, "preempted", "dist.world_size=2", env={"DISTEVAL_FAULTS": "preempt@*:batch=5"},
                           ok=False)
    assert proc.returncode != 0 and not (preempted / "results.json").exists()
    _, resumed = _run(tmp_path, "resumed_preempted", "dist.world_size=1", f"eval.resume={preempted}")
    _check_resumed(resumed, want, preempted)


def _store(run) -> dict:
    """A run's prediction store: every column in sample-id order (``read_tables``, which checks each rank file
    against the manifest and the ids 0..N-1 once), as Python lists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from disteval.data.prediction_store import read_manifest, read_tables

    store = run / "predictions"
    manifest = read_manifest(store)
    names = pq.read_schema(store / manifest["files"][0]["path"]).names
    tables, order = read_tables(store, manifest, names)
    table = pa.concat_tables(tables).take(pa.array(order))
    return {name: table.column(name).to_pylist() for name in names}


def test_bootstrap_intervals_and_the_store_of_a_resumed_run_are_identical(tmp_path):
    """eval.ci and eval.save_predictions: the per-sample rows the bootstrap resamples and the prediction store's
    rows travel in the windows, in sample order, so the intervals and the store of a run killed at W = 3 and
    resumed at W = 2 with 2 loader workers == an uninterrupted run's."""
    ci = ("eval.ci.resamples=100", "eval.ci.seed=3", "eval.save_predictions=true")
    _, full = _run(tmp_path, "full", "dist.world_size=1", *ci)
    want = load_results(full)
    _run(tmp_path, "killed", "dist.world_size=3", *ci, env={"DISTEVAL_FAULTS": "kill@1:batch=4"}, ok=False)
    # resumed with loader workers (the killed run had none): the batches around the records come from them
    _, run = _run(tmp_path, "resumed", "dist.world_size=2", "data.num_workers=2", *ci,
                  f"eval.resume={tmp_path / 'killed'}")
    _check_resumed(run, want["metrics"], tmp_path / "killed")

    def drop_seconds(intervals: dict) -> dict:
        return {k: v for k, v in intervals.items() if k != "seconds"}
    got = load_results(run)["confidence_intervals"]
    assert got and drop_seconds(got) == drop_seconds(want["confidence_intervals"])
    stored = _store(run)
    assert stored == _store(full) and stored["sample_id"] == list(range(N))


def test_a_checkpoint_set_resumes_every_checkpoint(tmp_path):
    """model.checkpoints: every checkpoint's states, per-sample rows and store rows travel in the same windows;
    each checkpoint's results.json (metrics and intervals) and prediction store of a resumed run == the
    uninterrupted run's."""
    (tmp_path / "ckpts").mkdir()
    ckpts = perturbed_checkpoints(DIGITS_CNN, tmp_path / "ckpts", (0.0, 0.3), "step")
    job = (f"model.checkpoints={ckpts[0].parent / 'step_*.pt'}", "eval.ci.resamples=100", "eval.save_predictions=true")
    _, full = _run(tmp_path, "full", "dist.world_size=1", *job)
    _run(tmp_path, "killed", "dist.world_size=3", *job, env={"DISTEVAL_FAULTS": "kill@2:batch=4"}, ok=False)
    _, run = _run(tmp_path, "resumed", "dist.world_size=2", *job, f"eval.resume={tmp_path / 'killed'}")
    _check_resumed(run, load_results(full)["metrics"], tmp_path / "killed")
    for c in ckpts:
        want, got = (load_results(r / "checkpoints" / c.stem) for r in (full, run))
        assert got["metrics"] == want["metrics"], c.stem
        assert {k: v for k, v in got["confidence_intervals"].items() if k != "seconds"} == \
            {k: v for k, v in want["confidence_intervals"].items() if k != "seconds"}, c.stem
        assert _store(run / "checkpoints" / c.stem) == _store(full / "checkpoints" / c.stem), c.stem


def test_fast_mode_resume_counts_exact_floats_within_rounding(tmp_path):
    _, full = _run(tmp_path, "full", "dist.world_size=1", "eval.mode=fast")
    want = load_results(full)["metrics"]
    _run(tmp_path, "killed", "dist.world_size=3", "eval.mode=fast", env={"DISTEVAL_FAULTS": "kill@2:batch=4"},
         ok=False)
    _, run = _run(tmp_path, "resumed", "dist.world_size=2", "eval.mode=fast", f"eval.resume={tmp_path / 'killed'}")
    got = load_results(run)
    assert got["coverage"]["ok"] and got["journal"]["samples_resumed"] > 0
    for key, value in want.items():
        _close(got["metrics"][key], value, key)


def _close(got, want, key):
    """Equal, floats within rounding (nested lists and dicts element by element)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), key
    elif isinstance(want, list):
        assert len(got) == len(want), key
        for g, w in zip(got, want):
            _close(g, w, key)
    elif isinstance(want, dict):
        assert set(got) == set(want), key
        for k in want:
            _close(got[k], want[k], f"{key}.{k}")
    else:
        assert got == want, key


COCO = SHARED / "data" / "coco" / "fce_cocoapi"


@pytest.mark.skipif(not COCO.is_dir(), reason=f"the COCO sample files are not there ({COCO}: ../shared/data)")
def test_a_coco_replay_resumes_its_metrics_and_its_detection_store(tmp_path):
    """COCO boxes (pycocotools' matching state, list-valued detection store rows): killed at W = 3 while its last
    windows were open, resumed at W = 2: AP@[.5:.95] and the other 11 statistics and the store == uninterrupted."""
    job = ("+experiment=coco_replay", f"data.annotations={COCO / 'instances_val2014_100.json'}",
           f"data.predictions={COCO / 'instances_val2014_fakebbox100_results.json'}", "data.batch_size=8",
           "eval.save_predictions=true")
    _, full = _run(tmp_path, "full", "dist.world_size=1", *job)
    _run(tmp_path, "killed", "dist.world_size=3", *job, env={"DISTEVAL_FAULTS": "kill@1:batch=3"}, ok=False)
    _, run = _run(tmp_path, "resumed", "dist.world_size=2", *job, f"eval.resume={tmp_path / 'killed'}")
    got, want = load_results(run), load_results(full)
    assert got["metrics"] == want["metrics"] and got["coverage"]["ok"]
    assert 0 < got["journal"]["samples_resumed"] < 100
    assert _store(run) == _store(full)
