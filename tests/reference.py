"""Independent single-process reference metrics (numpy / scikit-learn), written without disteval code."""
from __future__ import annotations

import numpy as np
from sklearn.metrics import accuracy_score, confusion_matrix, log_loss, precision_recall_fscore_support


def softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def reference_metrics(logits: np.ndarray, labels: np.ndarray, num_classes: int, topk=(1, 5), bins: int = 15) -> dict:
    """Metrics of a single process over the whole dataset: logits float [N, C], labels int [N]."""
    n = len(labels)
    labels = labels.astype(np.int64)
    pred = logits.argmax(axis=1)
    order = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")
    out = {"num_samples": n}
    for k in topk:
        out[f"top{k}"] = float(np.mean([labels[i] in order[i, :k] for i in range(n)]))
    out["accuracy"] = accuracy_score(labels, pred)
    p, r, f, _ = precision_recall_fscore_support(labels, pred, labels=list(range(num_classes)),
                                                 average="macro", zero_division=0)
    out.update(macro_precision=p, macro_recall=r, macro_f1=f)
    probs = softmax64(logits)
    out["nll"] = log_loss(labels, probs, labels=list(range(num_classes)))
    conf = probs.max(axis=1)
    correct = pred == labels
    edges = np.linspace(0.0, 1.0, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (conf > lo) & (conf <= hi)
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - conf[in_bin].mean())
    out["ece"] = ece
    cm = confusion_matrix(labels, pred, labels=list(range(num_classes)))
    support = cm.sum(axis=1)
    out["per_class_accuracy"] = [cm[c, c] / support[c] if support[c] else None for c in range(num_classes)]
    out["confusion"] = cm.tolist()  # rows = true class (scikit-learn's convention and results.json's)
    return out


def assert_metrics_equal(got: dict, want: dict, rel: float = 1e-12) -> None:
    """Counts exactly, floats within ``rel`` relative (absolute 1e-15 near zero)."""
    assert got["num_samples"] == want["num_samples"]
    for key, value in want.items():
        if key == "confusion" and key not in got:  # results.json leaves it out above 50 classes or when no rank
            continue                              # holds it whole (ClassificationMetrics.compute)
        g = got[key]
        if isinstance(value, list) and value and isinstance(value[0], list):  # a matrix of counts: exact
            assert g == value, key
        elif isinstance(value, list):
            assert len(g) == len(value), key
            for a, b in zip(g, value):
                assert (a is None) == (b is None), (key, a, b)
                if b is not None:
                    assert abs(a - b) <= rel * abs(b) + 1e-15, (key, a, b)
        else:
            assert abs(g - value) <= rel * abs(value) + 1e-15, (key, g, value)


def reference_ranking(logits: np.ndarray, labels: np.ndarray, num_classes: int) -> dict:
    """Macro one-vs-rest AUROC / AP with scikit-learn per class over softmax probabilities, averaged over
    the classes where each is defined (AUROC: positives and negatives; AP: positives)."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    probs = softmax64(logits)
    aucs, aps = [], []
    for c in range(num_classes):
        y = labels == c
        if 0 < y.sum() < len(y):
            aucs.append(roc_auc_score(y, probs[:, c]))
        if y.sum() > 0:
            aps.append(average_precision_score(y, probs[:, c]))
    return {"auroc_macro": float(np.mean(aucs)) if aucs else None, "ap_macro": float(np.mean(aps)) if aps else None}


def reference_multilabel(logits: np.ndarray, targets: np.ndarray) -> dict:
    """Multi-label macro AUROC / AP with scikit-learn per class over sigmoid probabilities, averaged over the
    classes where each is defined."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    aucs, aps = [], []
    for c in range(targets.shape[1]):
        y = targets[:, c].astype(bool)
        if 0 < y.sum() < len(y):
            aucs.append(roc_auc_score(y, probs[:, c]))
        if y.sum() > 0:
            aps.append(average_precision_score(y, probs[:, c]))
    return {"auroc_macro": float(np.mean(aucs)) if aucs else None, "ap_macro": float(np.mean(aps)) if aps else None}
