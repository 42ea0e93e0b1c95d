"""Macro one-vs-rest AUROC and AP (pure) against scikit-learn, ties included; merged shards equal one pass."""
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import label_binarize

from disteval.metrics.ranking import RankingMetrics, binary_auroc, binary_average_precision


def _softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("n,c,quantise", [(40, 3, False), (500, 7, True), (997, 10, False), (64, 5, True)])
def test_multiclass_matches_sklearn(n, c, quantise):
    rng = np.random.default_rng(n)
    logits = rng.normal(size=(n, c))
    if quantise:
        logits = np.round(logits)  # many tied scores
    labels = np.concatenate([np.arange(c), rng.integers(0, c, size=n - c)])  # every class present
    m = RankingMetrics(c)
    for s in range(0, n, 37):
        m.update(torch.from_numpy(logits[s:s + 37]), torch.from_numpy(labels[s:s + 37]), torch.arange(s, min(n, s + 37)))
    out = m.compute()
    probs = torch.softmax(torch.from_numpy(logits), 1).numpy()
    want_auc = roc_auc_score(labels, probs, multi_class="ovr", average="macro", labels=list(range(c)))
    want_ap = average_precision_score(label_binarize(labels, classes=list(range(c))), probs, average="macro")
    assert out["auroc_macro"] == pytest.approx(want_auc, rel=1e-12)
    assert out["ap_macro"] == pytest.approx(want_ap, rel=1e-12)


def test_multilabel_matches_sklearn():
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(300, 6)) * 2) / 2
    targets = (rng.random((300, 6)) < 0.3).astype(np.int64)
    m = RankingMetrics(6, multilabel=True)
    m.update(torch.from_numpy(logits), torch.from_numpy(targets), torch.arange(300))
    probs = torch.sigmoid(torch.from_numpy(logits)).numpy()
    out = m.compute()
    assert out["auroc_macro"] == pytest.approx(roc_auc_score(targets, probs, average="macro"), rel=1e-12)
    assert out["ap_macro"] == pytest.approx(average_precision_score(targets, probs, average="macro"), rel=1e-12)


def test_shards_merged_equal_single_pass_in_any_order():
    rng = np.random.default_rng(5)
    logits, labels = np.round(rng.normal(size=(200, 4))), rng.integers(0, 4, size=200)
    whole = RankingMetrics(4)
    whole.update(torch.from_numpy(logits), torch.from_numpy(labels), torch.arange(200))
    parts = []
    for a, b in [(150, 200), (0, 0), (0, 150)]:  # uneven, empty, out of order
        p = RankingMetrics(4)
        p.update(torch.from_numpy(logits[a:b]), torch.from_numpy(labels[a:b]), torch.arange(a, b))
        parts.append(p)
    parts[0].merge_state(parts[1:])
    got, want = parts[0].compute(), whole.compute()
    assert got["auroc_macro"] == pytest.approx(want["auroc_macro"], rel=1e-14)
    assert got["ap_macro"] == pytest.approx(want["ap_macro"], rel=1e-14)


def test_undefined_classes_are_none_and_left_out():
    y = np.array([True, True])
    assert binary_auroc(y, np.array([0.1, 0.2])) is None
    assert binary_average_precision(~y, np.array([0.1, 0.2])) is None
    m = RankingMetrics(3)
    m.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), torch.tensor([0, 1]), torch.arange(2))
    out = m.compute()
    assert out["auroc"][2] is None and out["ap"][2] is None
    assert out["auroc_macro"] == pytest.approx(1.0)
