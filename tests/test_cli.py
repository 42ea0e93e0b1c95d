"""``python -m disteval`` end to end, as a user runs it: real ranks, real data, real failures."""
import json
import re
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from conftest import REPO, load_results, run_disteval
from disteval.config import MOVED_KEYS, moved_key
from disteval.models.reference_cnn import DigitsCNN
from reference import reference_metrics

FASHION_ROOT = "/usr/share/datasets/fashion-mnist"
CKPT = REPO / "disteval" / "models" / "checkpoints"
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION_ROOT),
                                   reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it)")


def _digits_reference() -> dict:
    """Independent single-process reference: sklearn's split, the shipped checkpoint, one forward pass."""
    x, y = load_digits(return_X_y=True)
    _, x_te, _, y_te = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    model = DigitsCNN()
    model.load_state_dict(torch.load(CKPT / "digits_cnn.pt", weights_only=True))
    with torch.no_grad():
        logits = model.eval()(torch.tensor(x_te / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)).numpy()
    return reference_metrics(logits, y_te, 10, topk=(1, 5))


def _close(got: dict, want: dict) -> None:
    """Counts exactly; floats derived from model outputs within 1e-5 (batching changes float32 rounding)."""
    assert got["num_samples"] == want["num_samples"]
    for k in ("top1", "top5", "accuracy"):
        assert got[k] * got["num_samples"] == pytest.approx(want[k] * want["num_samples"], abs=1e-9), k
    for k in ("macro_precision", "macro_recall", "macro_f1"):
        assert got[k] == pytest.approx(want[k], rel=1e-12), k
    for k in ("nll", "ece"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


def _assert_start_up_reported(proc, run_dir) -> None:
    """The first stderr line says what is happening; one line per start-up step follows, in order; the driver's
    log holds the steps, the outcome and the results path; the metrics table's title is one line within 80
    columns (the run had COLUMNS=80)."""
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("disteval: [") and "starting" in lines[0] and "composing the config" in lines[0]
    steps = [line for line in lines if line.startswith("disteval: [")]
    for want in ("starting", "composing the config", "config composed: digits_cnn on digits, world size 2",
                 "starting 2 local ranks", "rank 0 of 2 up", "loading data and model", "evaluating 540 samples",
                 "done in"):
        assert any(want in line for line in steps), (want, steps)
    order = [next(i for i, line in enumerate(steps) if want in line)
             for want in ("starting:", "config composed", "starting 2 local ranks", "rank 0 of 2 up", "done in")]
    assert order == sorted(order), steps
    log = (run_dir / "disteval.log").read_text()
    assert "config composed" in log and "starting 2 local ranks" in log and "done in" in log
    assert str(run_dir / "results.json") in log
    title = next(line for line in proc.stdout.splitlines() if "disteval classification:" in line)
    assert "disteval classification: digits_cnn on digits" in title and len(title.rstrip()) <= 80


def test_default_job_two_ranks_equals_reference(cli):
    proc, run_dir = cli(env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    assert res["world_size"] == 2 and res["dataset"]["num_samples"] == 540
    _close(res["metrics"], _digits_reference())
    assert res["metrics"]["top1"] == pytest.approx(0.9852, abs=1e-4)  # as README states
    assert [p["shard"] for p in res["per_rank"]] == [[0, 320], [320, 540]]  # whole batches of 64
    assert sum(p["samples"] for p in res["per_rank"]) == 540 and res["coverage"]["ok"]
    for key in ("timings", "throughput", "comm", "versions", "config_digest", "schema_version"):
        assert key in res
    assert set(res["timings"]) == {"load", "forward", "sync", "after_loop", "total", "evaluation_s", "process_wall_s"}
    t = res["timings"]  # the whole run (imports and rank start-up included) and the evaluation, both wall s
    assert t["evaluation_s"] == t["total"] and 0 < t["evaluation_s"] <= t["process_wall_s"]
    # bitwise mode: int64 sums in one all_reduce, float sums as tree nodes inside the one all_gather; before the
    # loop, the canary's 24-byte all_gather (its probe gave the same bits on both ranks: no second exchange)
    assert res["comm"]["collectives"] == 3 and res["comm"]["by_op"] == {"all_reduce": 1, "all_gather": 2}
    assert res["canary"]["homogeneous"] and res["canary"]["classes"][0]["ranks"] == [0, 1]
    for r in range(2):
        status = json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())
        assert status["phase"] == "done" and status["samples_done"] == [320, 220][r] and status["error"] is None
        assert (run_dir / "ranks" / f"rank{r}" / "log.txt").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "top-1 accuracy" in proc.stdout
    assert "wall time: evaluation (s)" in proc.stdout and "wall time: whole run (s)" in proc.stdout
    _assert_start_up_reported(proc, run_dir)


def test_world_size_changes_nothing(cli):
    """W=1 and W=3 with another batch size give the same counts as the default W=2 run."""
    want = _digits_reference()
    for overrides in (["dist.world_size=1"], ["dist.world_size=3", "data.batch_size=7"]):
        proc, run_dir = cli(*overrides)
        assert proc.returncode == 0, proc.stderr
        _close(load_results(run_dir)["metrics"], want)


def test_under_external_torchrun(cli):
    proc, run_dir = cli("data.batch_size=13", cmd=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node=2", "-m", "disteval"])
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    assert res["world_size"] == 2
    _close(res["metrics"], _digits_reference())


@needs_fashion
def test_fashion_mnist_full_test_set(cli):
    proc, run_dir = cli("+experiment=fashion_mnist")
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    assert res["dataset"]["num_samples"] == 10_000 and res["experiment"] == "fashion_mnist"
    assert res["metrics"]["top1"] == pytest.approx(0.9207, abs=1e-4)  # as README states
    assert res["coverage"] == {"num_samples": 10000, "missing": 0, "duplicated": 0, "out_of_range": 0, "ok": True}


def _write_idx(path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _fake_fashion(root, labels) -> None:
    root.mkdir()
    rng = np.random.default_rng(0)
    _write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 255, size=(len(labels), 28, 28)))
    _write_idx(root / "t10k-labels-idx1-ubyte", np.asarray(labels))


def test_label_out_of_range_names_rank_sample_and_label(cli, tmp_path):
    labels = [0, 1, 2, 3, 4, 5, 6, 7, 12, 9]
    _fake_fashion(tmp_path / "fm", labels)
    proc, run_dir = cli("+experiment=fashion_mnist", f"data.root={tmp_path / 'fm'}", "data.batch_size=4")
    assert proc.returncode == 1  # batches of 4: rank 0 holds samples 0..7, rank 1 samples 8, 9
    assert "rank 1 failed: DataError: sample id 8: label 12 outside [0, 10)" in " ".join(proc.stderr.split())
    assert not (run_dir / "results.json").exists()
    status = json.loads((run_dir / "ranks" / "rank1" / "status.json").read_text())
    assert status["phase"] == "failed" and "label 12" in status["error"]["message"]
    assert "Traceback" in status["error"]["traceback"]


def test_non_finite_logits_name_sample(cli, tmp_path):
    state = torch.load(CKPT / "digits_cnn.pt", weights_only=True)
    state["classifier.3.bias"][4] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    proc, run_dir = cli(f"model.checkpoint={tmp_path / 'nan.pt'}")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1
    # recorded on the device per batch, raised once at the loop's end with the first id and its global batch
    assert re.search(r"DataError: non-finite logits \(nan or inf\) for sample id (0|320) \(\d+ such "
                     r"sample\(s\) on this rank\), in global batch \d+", text), text[-2000:]


@pytest.mark.parametrize("root", ["/nonexistent/fm", "EMPTY"])
def test_missing_or_empty_data_root_fails_before_ranks(cli, tmp_path, root):
    if root == "EMPTY":
        root = tmp_path / "empty"
        root.mkdir()
    for exp in ("fashion_mnist", "imagenet_vit"):
        proc, run_dir = cli(f"+experiment={exp}", f"data.root={root}", "model.checkpoint=/x.pt")
        assert proc.returncode == 2, proc.stderr
        text = " ".join(proc.stderr.split())
        assert "data.root" in text and str(root) in text
        assert not (run_dir / "ranks").exists()  # no rank ever started


def test_checkpoint_errors_before_ranks(cli, tmp_path):
    torch.save(DigitsCNN(num_classes=5).state_dict(), tmp_path / "five.pt")
    proc, run_dir = cli(f"model.checkpoint={tmp_path / 'five.pt'}")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "'classifier.3.weight' has shape (5, 64)" in text and "(10, 64)" in text
    torch.save(DigitsCNN(), tmp_path / "module.pt")  # a pickled nn.Module, not a state dict
    proc, _ = cli(f"model.checkpoint={tmp_path / 'module.pt'}")
    assert proc.returncode == 2 and "not a plain state dict" in " ".join(proc.stderr.split())
    torch.save({"epoch": 3, "model": DigitsCNN().state_dict()}, tmp_path / "train.pt")
    proc, _ = cli(f"model.checkpoint={tmp_path / 'train.pt'}")
    assert proc.returncode == 2 and "not a plain state dict" in " ".join(proc.stderr.split())
    assert not (run_dir / "ranks").exists()


@pytest.mark.parametrize("override,key", [("precision.count_dtype=float32", "precision.count_dtype"),
                                          ("precision.sum_dtype=float16", "precision.sum_dtype"),
                                          ("eval.classification.topk=[1,20]", "eval.classification.topk"),
                                          ("eval.classification.ece_bins=0", "eval.classification.ece_bins"),
                                          ("eval.detection.iou_type=keypoints", "eval.detection.iou_type"),
                                          ("eval.segmentation.ignore_index=-1", "eval.segmentation.ignore_index"),
                                          ("dist.world_size=0", "dist.world_size"),
                                          ("data.limit=0", "data.limit"),
                                          ("model.weights=null model.num_classes=5", "model.num_classes"),
                                          ("communication.chunk_bytes=0", "communication.chunk_bytes"),
                                          ("communication.compression=fp16 eval.metrics=[classification,ranking] "
                                           "communication.compress_states=[ranking.targets]", "'ranking.targets'"),
                                          ("communication.compression=lossless "
                                           "communication.compress_states=[classification.confusion]",
                                           "'classification.confusion'")])
def test_refused_configs_name_the_key(cli, override, key):
    proc, run_dir = cli(*override.split())
    assert proc.returncode == 2 and key in proc.stderr
    assert not (run_dir / "ranks").exists()
    assert "stopped before any rank started (configuration error)" in (run_dir / "disteval.log").read_text()


def test_fp16_scores_error_and_bytes_in_results(cli):
    """Opted-in fp16 scores: results.json comm.compression holds the measured error and bytes before/after;
    AUROC stays within the drift documented in docs/communication.md; exact states are untouched."""
    proc, run_dir = cli("eval.metrics=[classification,ranking]", "communication.compression=fp16")
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    comp = res["comm"]["compression"]
    n = res["dataset"]["num_samples"]
    scores, targets = comp["ranking.scores"], comp["ranking.targets"]
    assert scores["bytes_before"] == n * 10 * 8 and scores["bytes_after"] == n * 10 * 2
    assert 0 < scores["max_abs_error"] <= 2.0 ** -12  # softmax scores lie in [0, 1]: half an fp16 ulp at 1
    assert targets["wire"] == "raw:int64" and targets["max_abs_error"] == 0
    exact_proc, exact_dir = cli("eval.metrics=[classification,ranking]")
    exact = load_results(exact_dir)
    assert exact["comm"]["compression"] == {}
    assert abs(res["metrics"]["auroc_macro"] - exact["metrics"]["auroc_macro"]) < 1e-4
    assert res["metrics"]["top1"] == exact["metrics"]["top1"]  # counts are never compressed


def test_schema_error_from_cli_names_key(cli):
    proc, _ = cli("data.batchsize=3", inline=False)  # the process's own first line, printed before the CLI runs
    assert proc.returncode == 2 and "data.batchsize" in proc.stderr
    assert proc.stderr.startswith("disteval: [") and "starting" in proc.stderr.splitlines()[0]


def _start_long_run(tmp_path, *overrides):
    """Start a 2-rank Fashion-MNIST run with batch size 1 and wait until rank 1 is evaluating."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "disteval", "+experiment=fashion_mnist", "data.batch_size=1",
           "eval.status_interval_s=0.2", f"hydra.run.dir={run_dir}", *overrides]
    driver = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status_file = run_dir / "ranks" / "rank1" / "status.json"
    deadline = time.time() + 120
    status = None
    while time.time() < deadline:
        try:
            status = json.loads(status_file.read_text())
            if status["phase"] == "forward" and status["samples_done"] > 0:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    assert status and status["phase"] == "forward", status
    return driver, run_dir, status


def _assert_no_rank_left(run_dir):
    pids = [json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())["pid"] for r in range(2)]
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


@needs_fashion
def test_killed_rank_stops_all_and_is_named(tmp_path):
    driver, run_dir, status = _start_long_run(tmp_path)
    os.kill(status["pid"], signal.SIGKILL)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 1
    assert "rank 1 was killed by SIGKILL" in " ".join(err.split())
    assert not (run_dir / "results.json").exists()
    _assert_no_rank_left(run_dir)


@needs_fashion
def test_interrupted_driver_stops_all_ranks(tmp_path):
    driver, run_dir, _ = _start_long_run(tmp_path)
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 130
    assert "interrupted by SIGINT: all ranks were stopped" in " ".join(err.split())
    _assert_no_rank_left(run_dir)


@needs_fashion
def test_stalled_rank_is_named_within_one_timeout(tmp_path):
    """SIGSTOP rank 1: rank 0 finishes its shard, sees rank 1's record frozen for timeout_s, names it."""
    driver, run_dir, status = _start_long_run(tmp_path, "communication.timeout_s=5", "data.limit=3000")
    os.kill(status["pid"], signal.SIGSTOP)
    try:
        _, err = driver.communicate(timeout=120)
    finally:
        if os.path.exists(f"/proc/{status['pid']}"):
            os.kill(status["pid"], signal.SIGKILL)
    text = " ".join(err.split())
    assert driver.returncode == 1
    assert "rank 1 stopped making progress: its" in text and "in phase 'forward'" in text
    _assert_no_rank_left(run_dir)


def test_master_port_in_use_fails_before_ranks(recorded_run):
    """Another socket holds ``dist.master_port`` (recorded_runs.port_in_use, a run shared with
    test_doctor.py::test_port_in_use)."""
    proc = recorded_run("port-in-use")
    port, run_dir = proc.info["port"], proc.run_dir
    assert proc.returncode == 2
    assert f"dist.master_port: port {port} on 127.0.0.1 is already in use" in " ".join(proc.stderr.split())
    assert not (run_dir / "ranks").exists()


def test_reused_run_dir_keeps_previous_records(cli, tmp_path):
    proc, run_dir = cli("dist.world_size=3", "data.limit=30")
    assert proc.returncode == 0
    proc = run_disteval("data.limit=20", "dist.world_size=1", "eval.overwrite=true", run_dir=run_dir)
    assert proc.returncode == 0
    assert load_results(run_dir)["dataset"]["num_samples"] == 20
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0"]  # no stale rank1/rank2
    archived = list((run_dir / "previous").glob("*/results.json"))
    assert len(archived) == 1 and json.loads(archived[0].read_text())["dataset"]["num_samples"] == 30
    assert (archived[0].parent / "report.html").is_file() and (run_dir / "report.html").is_file()  # each its own


def test_override_hydra_cannot_parse_names_its_key_and_the_quoting_that_works(tmp_path):
    """docs/streaming.md's brace range unquoted: Hydra's own error names no key; ours does, exit 2, and the
    quoted form it shows composes to the literal pattern."""
    unquoted = run_disteval("data=webdataset", "data.urls=shards/val-{000000..000009}.tar", run_dir=tmp_path / "a")
    text = " ".join(unquoted.stderr.split())
    assert unquoted.returncode == 2 and "configuration error data.urls: Hydra cannot parse" in text, text[-2000:]
    assert "'data.urls=\"shards/val-{000000..000009}.tar\"'" in text and not (tmp_path / "a").exists()
    shown = subprocess.run([sys.executable, "-m", "disteval", "data=webdataset",
                            'data.urls="shards/val-{000000..000009}.tar"', "--cfg", "job"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert shown.returncode == 0 and "urls: shards/val-{000000..000009}.tar" in shown.stdout, shown.stderr[-2000:]


@pytest.mark.parametrize("old,new", sorted(MOVED_KEYS.items()))
def test_a_task_option_under_its_old_name_is_refused_naming_its_node(tmp_path, old, new):
    """``eval.topk`` & co. moved into the tasks' own nodes (``eval.classification.topk``): the old name is refused
    before Hydra composes (exit 2, no run directory) with the override to use instead."""
    value = {"eval.topk": "[1]", "eval.ece_bins": "10", "eval.iou_type": "segm", "eval.ignore_index": "0"}[old]
    proc = run_disteval(f"{old}={value}", run_dir=tmp_path / "run")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and f"configuration error {old}: moved to {new}" in text, text[-2000:]
    assert f"use {new}={value}" in text and not (tmp_path / "run").exists()
    assert moved_key(f"+{old}={value}") == moved_key(f"{old}={value}") and moved_key(f"{new}={value}") is None
    assert moved_key(f"~{old}").endswith(f"use ~{new}")


@pytest.mark.parametrize("key,said", [("topk", "eval.topk (in experiment/mine.yaml): moved to eval.classification.topk"),
                                       ("topq", "eval.topq (in experiment/mine.yaml): no such key; the keys of eval:")])
def test_an_old_or_unknown_key_inside_a_yaml_file_is_named_in_one_line(tmp_path, key, said):
    """The same inside a YAML file of the user's config directory: one line naming the key, the file and its new
    place (or the valid keys), exit 2, instead of Hydra's five-line ConfigKeyError."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(f"# @package _global_\neval:\n  {key}: [1]\n")
    proc = subprocess.run([sys.executable, "-m", "disteval", "--config-dir", str(tmp_path / "conf"), "+experiment=mine",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and f"configuration error {said}" in text, text[-2000:]
    assert "full_key" not in proc.stderr and "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def _console(stdout: str) -> list[str]:
    """The run's console without what differs from run to run or by launch path: times, throughput, the number
    of collectives (an external launcher's two broadcasts of the run directory), log lines and the results path."""
    out = []
    for line in stdout.splitlines():
        if line.startswith(("[20", "evaluating", "results:")) or not re.search(r"[\w]", line):
            continue  # log lines, the progress bar, the path, table borders (their width follows the values)
        if line.startswith("pipeline:"):  # its rates are timings: only that the line is there
            line = "pipeline:"
        elif any(k in line for k in ("throughput", "wall time", "collectives", "evaluation (s)")):
            line = line.split("│")[1].strip()  # the label only
        elif re.match(r"│\s+\d+ │", line):  # a per-rank row: rank, host, shard, samples (not images/s)
            line = "│".join(line.split("│")[:5])
        out.append(" ".join(line.split()))
    return [line for line in out if line]


def test_local_and_submitit_consoles_of_one_job_are_the_same(tmp_path):
    """Issue 29 point 3: the console comes from results.json on every launch path (``disteval.job.report.present``):
    the same job run by local ranks and submitted through submitit (its driver prints after the job ended) shows
    the same tables, task section and notes."""
    job = ("data.limit=64", "eval.progress=false")
    local = run_disteval(*job, run_dir=tmp_path / "local", env={"COLUMNS": "120"})
    submitted = run_disteval(*job, "hydra/launcher=submitit_local", run_dir=tmp_path / "submitit",
                             env={"COLUMNS": "120"})
    assert local.returncode == 0 and submitted.returncode == 0, submitted.stderr[-3000:]
    assert not (tmp_path / "submitit" / "launch.json").exists() and (tmp_path / "submitit" / ".submitit").is_dir()
    a, b = _console(local.stdout), _console(submitted.stdout)
    assert a == b and "│ top-1 accuracy │ 1.0000 │" in a and len(a) > 15, "\n".join(a + ["---"] + b)


@pytest.mark.parametrize("override,suggested", [("data.batchsize=32", "data.batch_size"),
                                                ("+data.batchsize=32", "data.batch_size"),
                                                ("dist.world_sizes=2", "dist.world_size"), ("seeds=1", "seed"),
                                                ("eval.classifcation.topk=[1]", "eval.classification.topk")])
def test_a_misspelt_key_is_one_line_with_the_closest_key(tmp_path, override, suggested):
    """A key the schema does not have (Hydra's 8-line error suggests ``+key=...``, which fails again): one line naming
    it and the closest valid key, exit 2, before Hydra composes (no run directory)."""
    from disteval.config import schema_keys, unknown_key

    proc = run_disteval(override, run_dir=tmp_path / "run")
    # beside the progress lines ("disteval: [T s] ..." or, in the test's process, "disteval: composing ...")
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower() or "override" in ln.lower()]
    key = override.lstrip("+").split("=")[0]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0] == f"disteval: configuration error {key}: no such key; did you mean {suggested}?", lines
    assert not (tmp_path / "run").exists()
    keys, _ = schema_keys()
    assert suggested in keys and key not in keys  # the schema's own keys, not a list kept by hand
    for fine in ("data.batch_size=32", "model.kwargs.image_size=32", "+model.kwargs.x=1", "data=imagefolder",
                 "+experiment=digits", "hydra.run.dir=x", "logger=csv", "~data.limit"):
        assert unknown_key(fine) is None, fine
