"""Classification metrics (pure, no processes) against numpy / scikit-learn."""
import numpy as np
import pytest
import torch

from disteval.errors import DataError
from disteval.metrics import ClassificationMetrics
from reference import assert_metrics_equal, reference_metrics


def _data(n, c, seed, quantise=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(n, c)).astype(np.float32)
    if quantise:  # many exact ties
        logits = np.round(logits)
    labels = rng.integers(0, c, size=n)
    return logits, labels


@pytest.mark.parametrize("n,c,quantise", [(1, 3, False), (50, 7, False), (997, 10, False), (400, 12, True)])
def test_matches_sklearn(n, c, quantise):
    logits, labels = _data(n, c, seed=n, quantise=quantise)
    m = ClassificationMetrics(c, topk=(1, 3), ece_bins=15)
    for s in range(0, n, 33):
        m.update(torch.from_numpy(logits[s:s + 33]), torch.from_numpy(labels[s:s + 33]),
                 torch.arange(s, min(n, s + 33)))
    assert_metrics_equal(m.compute(), reference_metrics(logits, labels, c, topk=(1, 3)))


def test_merge_state_equals_single_pass():
    logits, labels = _data(300, 6, seed=1)
    whole = ClassificationMetrics(6, topk=(1, 2))
    whole.update(torch.from_numpy(logits), torch.from_numpy(labels), torch.arange(300))
    parts = []
    for a, b in [(0, 0), (0, 100), (100, 101), (101, 300)]:
        p = ClassificationMetrics(6, topk=(1, 2))
        p.update(torch.from_numpy(logits[a:b]), torch.from_numpy(labels[a:b]), torch.arange(a, b))
        parts.append(p)
    parts[0].merge_state(parts[1:])
    got, want = parts[0].compute(), whole.compute()
    for k in want:
        if isinstance(want[k], float):
            assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15)
        elif isinstance(want[k], dict):  # the reliability bins: counts exact, float sums to rounding
            for sub in want[k]:
                assert got[k][sub] == pytest.approx(want[k][sub], rel=1e-12, abs=1e-15), (k, sub)
        else:
            assert got[k] == want[k]


def test_state_dtypes_are_int64_and_float64():
    m = ClassificationMetrics(5)
    for name, (t, red) in m.states().items():
        assert red == "sum"
        assert t.dtype in (torch.int64, torch.float64), name
    assert m.states()["count"][0].dtype == torch.int64
    assert m.states()["nll_sum"][0].dtype == torch.float64


def test_counts_beyond_float32_range():
    """2^24 + 1 samples: a float32 counter would stop at 16,777,216."""
    m = ClassificationMetrics(2, topk=(1,))
    m._states["count"] += 2 ** 24
    m.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), torch.tensor([0]))
    assert int(m.states()["count"][0]) == 2 ** 24 + 1


def test_label_out_of_range_names_sample_and_label():
    """update records a bad label on the device (no host sync per batch) and leaves its row uncounted;
    raise_deferred (the loop's end, a checkpoint, compute) names the smallest such sample id and its label."""
    m = ClassificationMetrics(10)
    m.update(torch.zeros(3, 10), torch.tensor([1, 12, 3]), torch.tensor([56, 57, 58]))
    m.update(torch.zeros(2, 10), torch.tensor([-1, 4]), torch.tensor([90, 91]))
    assert int(m.states()["count"][0]) == 3  # 57 and 90 not counted
    with pytest.raises(DataError, match=r"sample id 57: label 12 outside \[0, 10\) \(2 such label") as err:
        m.raise_deferred()
    assert err.value.sample_id == 57
    with pytest.raises(DataError, match=r"sample id 57"):
        m.compute()
    with pytest.raises(DataError, match=r"sample id 57"):  # a checkpoint never holds it
        m.snapshot()
    m2 = ClassificationMetrics(10)
    m2.update(torch.zeros(1, 10), torch.tensor([-1]), torch.tensor([9]))
    with pytest.raises(DataError, match=r"sample id 9: label -1"):
        m2.raise_deferred()
    m2.reset()
    m2.raise_deferred()  # reset forgets it


def test_non_finite_logits_name_sample():
    m = ClassificationMetrics(3, topk=(1,))
    logits = torch.zeros(4, 3)
    logits[2, 1] = float("nan")
    logits[3, 0] = float("inf")
    m.update(logits, torch.zeros(4, dtype=torch.long), torch.tensor([10, 11, 12, 13]))
    assert int(m.states()["count"][0]) == 2
    assert float(m.states()["ece_conf_sum"][0].sum()) == pytest.approx(2 / 3)  # nan rows add nothing
    with pytest.raises(DataError, match=r"non-finite logits \(nan or inf\) for sample id 12 \(2 such"):
        m.raise_deferred()


def test_evaluator_names_the_global_batch_of_a_deferred_error():
    from disteval.metrics.evaluator import Evaluator

    ev = Evaluator(ClassificationMetrics(10))
    ev.process(4, torch.zeros(3, 10), torch.tensor([1, 2, 3]), torch.tensor([12, 13, 14]))
    ev.process(5, torch.zeros(3, 10), torch.tensor([1, 20, 3]), torch.tensor([15, 16, 17]))
    with pytest.raises(DataError, match=r"sample id 16: label 20 outside \[0, 10\) .*in global batch 5"):
        ev.finish_local()


def test_classification_update_issues_no_host_sync():
    """On the meta device every value is unknown, so anything that needs one on the host (``.item()``,
    ``bool(t)``, ``if t``, ``nonzero``, boolean-mask indexing, ``bincount``, ``unique``) raises: an update
    that runs there issues no host synchronisation and creates no data-dependent shape (the CPU stand-in
    for ``torch.cuda.set_sync_debug_mode("error")``, which tests/test_gpu.py applies on a GPU)."""
    with pytest.raises(Exception):  # noqa: B017 - the stand-in can fail: a data-dependent op raises on meta
        torch.zeros(3, device="meta").nonzero()
    from disteval.metrics.collection import MetricCollection
    from disteval.metrics.ranking import RankingMetrics

    m = MetricCollection({"classification": ClassificationMetrics(10, topk=(1, 5), ece_bins=15),
                          "ranking": RankingMetrics(10)})
    assert m.device_resident
    m.to("meta")
    for _ in range(2):
        m.update(torch.empty(8, 10, device="meta"), torch.empty(8, dtype=torch.long, device="meta"),
                 torch.arange(8))
    assert all(v.device.type == "meta" for v, _ in m.states().values())
    ml = RankingMetrics(4, multilabel=True).to("meta")
    ml.update(torch.empty(8, 4, device="meta"), torch.empty(8, 4, dtype=torch.long, device="meta"), torch.arange(8))


def test_wrong_logit_width_is_clear():
    m = ClassificationMetrics(10)
    with pytest.raises(DataError, match=r"dataset has 10 classes"):
        m.update(torch.zeros(2, 1000), torch.tensor([0, 1]), torch.tensor([0, 1]))


def test_invalid_topk_refused():
    with pytest.raises(ValueError, match="topk"):
        ClassificationMetrics(3, topk=(1, 5))


def test_zero_samples_give_none_not_crash():
    out = ClassificationMetrics(3, topk=(1,)).compute()
    assert out["num_samples"] == 0 and np.isnan(out["top1"]) and out["per_class_accuracy"] == [None] * 3
