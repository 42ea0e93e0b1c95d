"""Tasks are plug-ins: a task family defined in this file (a toy regression with its own metric) is
registered and runs end to end through the real engine, in-process (W = 1, by registered name) and with
real ranks through ``python -m disteval`` (W = 2, by import path); its MAE equals numpy's."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import REPO, load_results
from disteval.rank.engine import run_rank
from disteval.errors import ConfigError
from disteval.metrics.base import Metric
from disteval.tasks import Task, register_task, registered_tasks, resolve_task
from bitwise_workers import job

N = 53


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    return x, (x.sum(1) + rng.normal(scale=0.1, size=N)).astype(np.float32)


class MeanAbsoluteError(Metric):
    """MAE of scalar predictions: states ``abs_sum`` float64 [], ``count`` int64 []."""

    def __init__(self):
        super().__init__()
        self.add_state("abs_sum", torch.zeros((), dtype=torch.float64))
        self.add_state("count", torch.zeros((), dtype=torch.int64))

    def update(self, outputs, targets, sample_ids):
        self._states["abs_sum"] += (outputs.reshape(-1).double() - targets.double()).abs().sum()
        self._states["count"] += targets.numel()

    def compute(self):
        n = int(self._states["count"])
        return {"mae": float(self._states["abs_sum"]) / n, "num_samples": n}


@register_task
class ToyRegressionTask(Task):
    """y = sum(x) + noise, model = Linear(4, 1) with unit weights."""

    name = "toy_regression"
    data_names = ("toy",)

    def dataset(self):
        x, y = _data()
        return [(torch.from_numpy(x[i]), torch.tensor(y[i]), i) for i in range(N)]  # (input, float target, id)

    def model(self, device):
        net = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.ones_(net.weight)
        return net.eval().to(device)

    def metric(self):
        return MeanAbsoluteError()

    def console_section(self, metrics):
        return [("MAE", f"{metrics['mae']:.6f}")], [], []


def _want() -> float:
    x, y = _data()
    return float(np.abs(x.sum(1, dtype=np.float32).astype(np.float64) - y.astype(np.float64)).mean())


def test_registered_task_runs_in_process(tmp_path):
    assert registered_tasks()["toy_regression"] is ToyRegressionTask
    cfg = job({"data": {"name": "toy", "batch_size": 8}})  # eval.task=auto finds it by data.name
    assert resolve_task(cfg) is ToyRegressionTask
    res = run_rank(cfg, str(tmp_path), None)
    assert res["metrics"]["num_samples"] == N and res["coverage"]["ok"]
    assert res["metrics"]["mae"] == pytest.approx(_want(), rel=1e-6)  # float32 forward vs numpy's float32 sum


def test_task_by_import_path_with_real_ranks(cli):
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc, run_dir = cli("data.name=toy", "data.batch_size=8", "eval.task=test_tasks:ToyRegressionTask",
                        "dist.world_size=2", env=env)
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    assert res["world_size"] == 2 and res["metrics"]["num_samples"] == N
    assert res["metrics"]["mae"] == pytest.approx(_want(), rel=1e-6)
    assert "MAE" in proc.stdout


def test_unknown_tasks_are_named():
    with pytest.raises(ConfigError, match="eval.task"):
        resolve_task(job({"eval": {"task": "nope"}}))
    with pytest.raises(ConfigError, match="eval.task"):
        resolve_task(job({"eval": {"task": "os:path"}}))
    with pytest.raises(ConfigError, match="data.name"):
        resolve_task(job({"data": {"name": "unheard_of"}}))


def test_engine_knows_no_task_names():
    """The rank's hub and its parts (engine, loop, sync, bootstrap, peers, plan, results, intervals, canary) hold no
    task or dataset names (the task registry does)."""
    names = ("engine", "loop", "sync", "bootstrap", "peers", "plan", "results", "intervals", "canary")
    for path in (REPO / "disteval" / "rank" / f"{name}.py" for name in names):
        text = path.read_text()
        for word in ("coco", "detection", "classification", "digits", "fashion", "imagefolder", "is_detection"):
            assert word not in text.lower(), (path.name, word)


def test_per_rank_metric_comes_from_the_task(tmp_path):
    """Outlier ranks and the per-rank console column use ``Task.rank_metric`` (results.json ``task.rank_metric``),
    not a classification key in the engine: a task without one refuses eval.exclude_outlier_ranks before any rank
    starts, and its console has no per-rank metric column; classification's is "accuracy"."""
    import io

    from rich.console import Console

    from disteval.data.coco_keypoints_synthetic import make_synthetic_keypoints
    from disteval.job.preflight import preflight
    from disteval.job.report import present

    gt, dt = make_synthetic_keypoints(tmp_path / "kp", num_images=4, seed=1)
    cfg = job({"model": {"name": "replay"}, "eval": {"metrics": ["keypoints"], "exclude_outlier_ranks": True},
               "data": {"name": "coco_keypoints_replay", "annotations": str(gt), "predictions": str(dt)}})
    task = resolve_task(cfg)(cfg)
    assert task.rank_metric is None and resolve_task(job({}))(job({})).rank_metric == "accuracy"
    with pytest.raises(ConfigError, match="no per-rank metric to find outlier ranks from") as info:
        preflight(cfg)
    assert info.value.key == "eval.exclude_outlier_ranks"
    results = {"metrics": {"AP": 0.5}, "model": {"name": "replay"}, "dataset": {"name": "kp", "num_samples": 4},
               "world_size": 2, "throughput": {"images_per_s": None}, "timings": {"total": 1.0, "load": 0.1, "sync": 0.01},
               "comm": {"collectives": 2, "bytes": 10}, "run_dir": str(tmp_path), "task": task.identity(),
               "per_rank": [{"rank": r, "host": "h", "shard": [2 * r, 2 * r + 2], "samples": 2, "images_per_s": None,
                             "metrics": {}} for r in range(2)]}
    out = io.StringIO()
    present(results, task.console_section, Console(file=out, width=160))
    assert "per rank" in out.getvalue() and "local" not in out.getvalue()
    results["task"] = dict(results["task"], rank_metric="accuracy")
    out = io.StringIO()
    present(results, task.console_section, Console(file=out, width=160))
    assert "local accuracy" in out.getvalue()


def test_streamed_data_is_the_task_s_knowledge():
    """``Task.streamed`` (classification: webdataset), not a data name in the driver, refuses a device mesh."""
    from disteval.job.preflight import check_parallel

    cfg = job({"data": {"name": "webdataset", "urls": "shards-{0..1}.tar"},
               "dist": {"world_size": 2, "parallel": {"tp": 2}}})
    assert resolve_task(cfg)(cfg).streamed and not resolve_task(job({}))(job({})).streamed
    with pytest.raises(ConfigError, match="streamed from tar shards") as info:
        check_parallel(cfg, [])
    assert info.value.key == "dist.parallel"
