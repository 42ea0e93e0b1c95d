"""Order-independent float sums (pure, no processes): BatchTreeSum gives the same bits for every split of
the batches among ranks and every order in which the ranks' nodes arrive; the Evaluator folds float
partials per batch; the Metric protocol's reset/snapshot/restore."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from disteval.common.ranges import shard_bounds
from disteval.metrics import ClassificationMetrics
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.ordered_sum import BatchTreeSum


def _leaves(n: int, k: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)  # magnitudes over 12 orders, so rounding depends on the order
    return [torch.from_numpy(rng.normal(size=k) * 10.0 ** rng.integers(-6, 6, size=k)) for _ in range(n)]


def _split_total(leaves, cuts) -> torch.Tensor:
    parts, nodes = [], []
    bounds = [0, *cuts, len(leaves)]
    for a, b in zip(bounds, bounds[1:]):
        t = BatchTreeSum(leaves[0].numel())
        for i in range(a, b):
            t.add(i, leaves[i])
        parts.append(t)
        nodes += t.nodes()
    random.Random(len(cuts)).shuffle(nodes)  # arrival order does not matter
    return BatchTreeSum.combine(nodes, leaves[0].numel())


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 97, 1000])
def test_total_is_identical_for_every_split(n):
    leaves = _leaves(n, 4, seed=n)
    want = _split_total(leaves, [])
    rng = random.Random(n)
    for w in (2, 3, 5, 8, 64):
        cuts = sorted(shard_bounds(n, w, r)[0] for r in range(1, w))
        assert torch.equal(_split_total(leaves, cuts), want), w
        cuts = sorted(rng.sample(range(n + 1), min(w, n + 1)))  # arbitrary contiguous splits, empty ones too
        assert torch.equal(_split_total(leaves, cuts), want), cuts
    # and it is the sum: within the pairwise-summation error bound of the exactly rounded sum
    exact = [math.fsum(float(x[j]) for x in leaves) for j in range(4)]
    scale = [sum(abs(float(x[j])) for x in leaves) for j in range(4)]
    for got, e, s in zip(want.tolist(), exact, scale):
        assert abs(got - e) <= 2 * math.log2(n + 1) * 2 ** -52 * s + 1e-300


def test_a_running_sum_would_differ():
    """The rounding is real: summing the same leaves left to right per rank, then across ranks, gives other
    bits for some split (so the test above can fail)."""
    leaves = _leaves(1000, 4, seed=1)
    one = sum(leaves[1:], leaves[0].clone())
    half = sum(leaves[501:], leaves[500].clone()) + sum(leaves[1:500], leaves[0].clone())
    assert not torch.equal(one, half)


def test_nodes_stay_logarithmic_and_bad_input_is_refused():
    t = BatchTreeSum(1)
    for i in range(5, 1000):
        t.add(i, torch.ones(1, dtype=torch.float64))
    assert len(t.nodes()) <= 2 * math.ceil(math.log2(1000))
    with pytest.raises(ValueError, match="increasing"):
        t.add(3, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        t.add(2000, torch.ones(2, dtype=torch.float64))
    copy = BatchTreeSum(1)
    copy.load(t.nodes())
    copy.add(1000, torch.ones(1, dtype=torch.float64))
    assert float(copy.total()) == 996.0


def _batches(n=50, b=7, seed=0):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(size=(n, 5)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 5, size=n))
    return [(logits[i:i + b], labels[i:i + b], torch.arange(i, min(i + b, n))) for i in range(0, n, b)]


def test_evaluator_folds_per_batch_and_restores_local_totals():
    batches = _batches()
    ev = Evaluator(ClassificationMetrics(5, topk=(1,)), record_batches=True)
    plain = ClassificationMetrics(5, topk=(1,))
    for k, (x, y, ids) in enumerate(batches):
        ev.process(k, x, y, ids)
        plain.update(x, y, ids)
        assert float(ev.metric.float_sum_states()["nll_sum"]) == 0.0  # moved into the tree
    ev.finish_local()
    got, want = ev.metric.compute(), plain.compute()
    assert got["top1"] == want["top1"] and got["nll"] == pytest.approx(want["nll"], rel=1e-12)
    log = ev.batch_log()
    assert [b[0] for b in log["batches"]] == list(range(len(batches))) and len(log["digests"]) == 50
    assert len(log["partials"]) == len(batches) and log["float_states"][0] == ["nll_sum", []]
    with pytest.raises(ValueError, match="before the first update"):
        Evaluator(plain)


def test_metric_reset_snapshot_restore():
    m = ClassificationMetrics(5, topk=(1, 2))
    x, y, ids = _batches()[0]
    m.update(x, y, ids)
    snap = m.snapshot()
    before = m.compute()
    m.update(x, y, ids)
    assert m.compute()["num_samples"] == 14
    m.restore(snap)
    assert m.compute() == before
    m.reset()
    assert m.compute()["num_samples"] == 0
    with pytest.raises(KeyError, match="lacks"):
        m.restore({"count": snap["count"]})
