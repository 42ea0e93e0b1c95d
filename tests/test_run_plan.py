"""The rank's run plan (disteval/rank/plan.py) without a process: every rank's shard and batch grid at every world
size, checked against plain Python (each sample owned once, in order, sizes within one sample or one batch), and the
rules that decide whether a preempted rank can resume."""
from __future__ import annotations

import itertools

import pytest
from omegaconf import OmegaConf

from disteval.rank.plan import RunPlan


@pytest.mark.parametrize("n,b", [(0, 4), (1, 4), (7, 3), (64, 8), (203, 16), (1000, 7)])
def test_the_shards_of_all_ranks_are_the_samples_once_in_order(n, b):
    for w, bitwise in itertools.product((1, 2, 3, 5, 8, 13), (False, True)):
        plans = RunPlan(n, b, 0, w, bitwise=bitwise).for_all_ranks()
        owned = [i for p in plans for i in range(*p.shard)]
        assert owned == list(range(n)), (w, bitwise)
        if bitwise:  # whole global batches: the batches are the same at every world size
            assert [bb for p in plans for bb in p.batches] == [(s, min(s + b, n)) for s in range(0, n, b)]
            counts = [len(p.batches) for p in plans]
        else:
            counts = [p.shard[1] - p.shard[0] for p in plans]
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True), (w, bitwise, counts)


def test_impossible_numbers_are_refused_at_construction():
    with pytest.raises(ValueError):
        RunPlan(10, 2, 3, 3)  # rank outside [0, W)
    with pytest.raises(ValueError):
        RunPlan(-1, 2, 0, 1)
    with pytest.raises(ValueError):
        RunPlan(10, 0, 0, 1, bitwise=True)


def test_which_runs_can_resume():
    base = RunPlan(100, 10, 1, 4)
    assert base.resumable
    assert not RunPlan(100, 10, 1, 4, trials=3).resumable  # a checkpoint holds one pass
    assert not RunPlan(100, 10, 1, 4, sampler="pad").resumable
    assert not RunPlan(100, 10, 1, 4, meshed=True).resumable  # FSDP/TP peers still run the batches
    assert not RunPlan(100, 10, 1, 4, streamed=True, num_workers=2).resumable  # fast stream, several workers
    assert RunPlan(100, 10, 1, 4, streamed=True, num_workers=2, bitwise=True).resumable
    assert RunPlan(100, 10, 1, 4, streamed=True, num_workers=1).resumable
    assert base.checkpoint_key("abc", 4, 1, "77") == {"config": "abc", "world_size": 4, "rank": 1,
                                                      "shard": [25, 50], "job": "77"}


def test_the_plan_of_a_job_config():
    cfg = OmegaConf.create({"data": {"batch_size": 16, "sampler": "exact", "num_workers": 0},
                            "eval": {"mode": "bitwise", "trials": 1}})
    plan = RunPlan.of(cfg, 203, 2, 3, streamed=False, meshed=False)
    assert (plan.bitwise, plan.shard, len(plan.batches)) == (True, (144, 203), 4)
