"""Preemption-safe evaluation, in one process: SLURM's checkpoint signal (USR2) arriving in the middle of a
shard writes a checkpoint of whole batches; an evaluation resumed from it gives exactly the metrics of an
uninterrupted one. (The requeue round trip through real SLURM is in tests/test_slurm.py.)"""
import os
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from dist_workers import NUM_CLASSES, synthetic_logits
from disteval.data import IndexedDataset
from disteval.engine import evaluate_shard
from disteval.metrics import (ClassificationMetrics, MetricCollection, RankingMetrics, SampleIdCoverage,
                              check_coverage)
from disteval.resume import PreemptionGuard, load_checkpoint, save_checkpoint


class Preempted(Exception):
    pass


def _metric():
    return MetricCollection({"classification": ClassificationMetrics(NUM_CLASSES, topk=(1, 3)),
                             "ranking": RankingMetrics(NUM_CLASSES)})


@pytest.mark.parametrize("where", ["between batches", "inside a batch"])
def test_signal_mid_shard_then_resume_equals_uninterrupted(tmp_path, monkeypatch, where):
    logits, labels = synthetic_logits(203, seed=3)
    data = IndexedDataset(TensorDataset(torch.from_numpy(logits), torch.from_numpy(labels)))
    whole, cov = _metric(), SampleIdCoverage()
    evaluate_shard(torch.nn.Identity(), data, whole, cov, rank=1, world_size=2, batch_size=7)
    want = whole.compute()

    monkeypatch.setenv("SLURM_JOB_ID", "1")  # the guard is active inside SLURM jobs only
    key = {"config": "x", "world_size": 2, "rank": 1, "shard": [102, 203]}
    path = tmp_path / "checkpoint.pt"
    metric, coverage = _metric(), SampleIdCoverage()

    def previous_handler(signum, frame):  # stands for submitit's: requeue and exit
        raise Preempted()

    signal.signal(signal.SIGUSR2, previous_handler)
    guard = PreemptionGuard(lambda: save_checkpoint(path, {k: v for k, (v, _) in metric.states().items()},
                                                    coverage.runs(), guard.samples_done, key))

    def on_batch(batches, samples):
        if batches == 4 and where == "between batches":
            os.kill(os.getpid(), signal.SIGUSR2)

    update, calls = metric.update, []

    def update_then_signal(outputs, targets, ids):  # the signal lands after the metric, before the coverage
        update(outputs, targets, ids)
        calls.append(1)
        if len(calls) == 4 and where == "inside a batch":
            os.kill(os.getpid(), signal.SIGUSR2)

    metric.update = update_then_signal

    with pytest.raises(Preempted), guard:
        evaluate_shard(torch.nn.Identity(), data, metric, coverage, rank=1, world_size=2, batch_size=7,
                       on_batch=on_batch, guard=guard)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    ckpt = load_checkpoint(path, key)
    assert ckpt is not None and ckpt["samples_done"] == 28 and guard.saved
    assert load_checkpoint(path, dict(key, world_size=4)) is None  # another job's checkpoint is ignored

    resumed, cov2 = _metric(), SampleIdCoverage()
    resumed.load_synced(ckpt["states"])
    cov2.update_runs(ckpt["runs"])
    out = evaluate_shard(torch.nn.Identity(), data, resumed, cov2, rank=1, world_size=2, batch_size=7,
                         skip=ckpt["samples_done"])
    assert out.samples == 101
    assert resumed.compute() == want
    runs = cov2.runs().numpy()
    assert check_coverage(np.concatenate([runs, [[0, 102]]]), 203).ok  # every id of the shard exactly once
