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
from disteval.rank.loop import CallbackHook, GuardHook, ShardSpec, evaluate_shard
from disteval.metrics import ClassificationMetrics, MetricCollection, RankingMetrics, check_coverage
from disteval.metrics.evaluator import Evaluator
from disteval.rank.resume import PreemptionGuard, load_checkpoint, save_checkpoint


class Preempted(Exception):
    pass


def _metric():
    return MetricCollection({"classification": ClassificationMetrics(NUM_CLASSES, topk=(1, 3)),
                             "ranking": RankingMetrics(NUM_CLASSES)})


@pytest.mark.parametrize("where", ["between batches", "inside a batch"])
def test_signal_mid_shard_then_resume_equals_uninterrupted(tmp_path, monkeypatch, where):
    logits, labels = synthetic_logits(203, seed=3)
    data = IndexedDataset(TensorDataset(torch.from_numpy(logits), torch.from_numpy(labels)))
    whole = Evaluator(_metric())
    evaluate_shard(torch.nn.Identity(), data, whole, ShardSpec(1, 2, 7))
    want = whole.metric.compute()

    monkeypatch.setenv("DISTEVAL_PREEMPT_SIGNAL", "USR2")  # active only where the launcher requeues on a signal
    key = {"config": "x", "world_size": 2, "rank": 1, "shard": [105, 203]}
    path = tmp_path / "checkpoint.pt"
    ev = Evaluator(_metric())
    metric = ev.metric

    def previous_handler(signum, frame):  # stands for submitit's: requeue and exit
        raise Preempted()

    signal.signal(signal.SIGUSR2, previous_handler)
    guard = PreemptionGuard(lambda: save_checkpoint(path, ev.state_dict(), guard.progress.samples, key))

    def on_batch(progress):
        if progress.batches == 4 and where == "between batches":
            os.kill(os.getpid(), signal.SIGUSR2)

    update, calls = metric.update, []

    def update_then_signal(outputs, targets, ids):  # the signal lands after the metric, before the coverage
        update(outputs, targets, ids)
        calls.append(1)
        if len(calls) == 4 and where == "inside a batch":
            os.kill(os.getpid(), signal.SIGUSR2)

    metric.update = update_then_signal

    with pytest.raises(Preempted), guard:
        evaluate_shard(torch.nn.Identity(), data, ev, ShardSpec(1, 2, 7),
                       hooks=[GuardHook(guard), CallbackHook(on_batch)])
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    ckpt = load_checkpoint(path, key)
    assert ckpt is not None and ckpt["samples_done"] == 28 and guard.saved
    assert load_checkpoint(path, dict(key, world_size=4)) is None  # another job's checkpoint is ignored

    resumed = Evaluator(_metric())
    resumed.load_state_dict(ckpt["state"])
    out = evaluate_shard(torch.nn.Identity(), data, resumed, ShardSpec(1, 2, 7, skip=ckpt["samples_done"]))
    assert out.samples == 98  # batch-aligned: rank 1 of 2 holds global batches 15..29, samples [105, 203)
    assert resumed.metric.compute() == want  # bit for bit, float sums included
    runs = resumed.coverage.runs().numpy()
    assert check_coverage(np.concatenate([runs, [[0, 105]]]), 203).ok  # every id of the shard exactly once
