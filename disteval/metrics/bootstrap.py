"""Bootstrap confidence intervals over global sample ids (``eval.ci.*``), identical at every world size.

Each rank computes per-sample statistics from its outputs (``per_sample``: correct@k for each k of
``eval.classification.topk``, the negative log-likelihood in float64, the target, the predicted class and its
confidence, and for AUROC the softmax probabilities); rank 0 receives every rank's rows, orders them by
global sample id and resamples samples (``intervals``: ``scipy.stats.bootstrap``, percentile method, one
seeded generator per metric, the same resamples for all). Means of one column (top-k, NLL) resample the
column; macro F1, ECE and AUROC are recomputed from the resampled samples' rows (``interval_of``). The rows are
functions of each sample's own outputs, which bitwise mode makes the
same bits at every world size, and the resampling sees them in sample-id order, so the intervals are ``==`` at
every world size and loader worker count. Source of the method: Efron & Tibshirani, *An Introduction to the
Bootstrap* (1993), ch. 13 (percentile intervals).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


CI_PROBS_MAX_CLASSES = 100  # the AUROC interval gathers N x C probabilities to rank 0: done up to this C


@dataclass(frozen=True)
class SampleColumns:
    """What ``per_sample`` keeps of each sample, float64 columns in this order: the sample id; correct@k (0/1)
    for each k of ``topk``; the NLL; the target, the predicted class (arg-max) and the confidence (the largest
    softmax probability, as ``ClassificationMetrics`` bins it for the ECE); with ``probs`` the C softmax
    probabilities (the AUROC's scores, as ``RankingMetrics`` computes them). ``num_classes`` C, ``ece_bins`` M."""

    topk: tuple[int, ...]
    num_classes: int
    ece_bins: int = 15
    probs: bool = False

    @property
    def width(self) -> int:
        return 5 + len(self.topk) + (self.num_classes if self.probs else 0)

    def mean_names(self) -> list[str]:
        """The metrics that are means of one column (after the id): top{k}..., nll."""
        return [f"top{k}" for k in self.topk] + ["nll"]


def per_sample(logits: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor, cols: SampleColumns) -> np.ndarray:
    """float64 rows [B, ``cols.width``] (``SampleColumns``) of one batch: ``logits`` float [B, C], ``targets``
    int64 [B], ``ids`` int64 [B]. Everything in float64 from the logits promoted to float64, as the metrics do."""
    z = logits.detach().cpu().double()
    y = torch.as_tensor(targets).cpu().long()
    ranked = z.topk(max(cols.topk), dim=1).indices
    out = [ids.cpu().double()]
    out += [(ranked[:, :k] == y[:, None]).any(1).double() for k in cols.topk]
    out.append(torch.logsumexp(z, dim=1) - z.gather(1, y[:, None]).squeeze(1))
    logp = torch.log_softmax(z, dim=1)
    out += [y.double(), z.argmax(dim=1).double(), logp.max(dim=1).values.exp()]
    rows = torch.stack(out, dim=1)
    if cols.probs:
        rows = torch.cat([rows, torch.softmax(z, dim=1)], dim=1)
    return rows.numpy()


def macro_f1(target: np.ndarray, pred: np.ndarray, num_classes: int) -> float:
    """Macro F1 over all C classes (2 tp / (2 tp + fp + fn) per class, 0 where undefined; scikit-learn's
    ``f1_score(average="macro", labels=range(C), zero_division=0)``). ``target``, ``pred`` int [n]."""
    tp = np.bincount(target[target == pred], minlength=num_classes).astype(np.float64)
    den = np.bincount(target, minlength=num_classes) + np.bincount(pred, minlength=num_classes)
    f1 = np.zeros(num_classes)
    np.divide(2 * tp, den, out=f1, where=den != 0)
    return float(f1.mean())


def expected_calibration_error(correct: np.ndarray, conf: np.ndarray, bins: int) -> float:
    """ECE with ``bins`` equal-width confidence bins ((i/M, (i+1)/M], the lowest closed at 0): sum over bins of
    |correct - confidence| summed in the bin, divided by n (Guo et al. 2017, eq. 3)."""
    b = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    gap = np.bincount(b, weights=correct, minlength=bins) - np.bincount(b, weights=conf, minlength=bins)
    return float(np.abs(gap).sum() / len(conf))


class MacroAuroc:
    """Mean one-vs-rest AUROC over the classes with both positives and negatives, of any resample of the samples
    (Mann-Whitney U with average ranks for ties, as ``RankingMetrics``): each class's scores are sorted once
    (``target`` int [n], ``probs`` float [n, C]); a resample is the multiplicity of each sample (its weight),
    so ``self(idx)`` costs O(n C) without sorting: AUROC = sum over positives of weight x (negative weight
    scored strictly lower + half the negative weight scored equal) / (positive weight x negative weight)."""

    def __init__(self, target: np.ndarray, probs: np.ndarray):
        self.n, self.c = probs.shape
        self.order = np.argsort(probs, axis=0, kind="stable")
        ranked = np.take_along_axis(probs, self.order, axis=0)
        # tie group of each sorted position, per class
        self.group = np.vstack([np.zeros((1, self.c), np.int64), np.cumsum(np.diff(ranked, axis=0) != 0, axis=0)])
        self.positive = target[self.order] == np.arange(self.c)[None, :]

    def __call__(self, idx: np.ndarray) -> float:
        w = np.bincount(idx, minlength=self.n).astype(np.float64)[self.order]
        aucs = []
        for c in range(self.c):
            wp, wn = np.where(self.positive[:, c], w[:, c], 0.0), np.where(self.positive[:, c], 0.0, w[:, c])
            total_p, total_n = wp.sum(), wn.sum()
            if total_p == 0 or total_n == 0:
                continue
            g = self.group[:, c]
            gp, gn = np.bincount(g, weights=wp), np.bincount(g, weights=wn)
            below = np.cumsum(gn) - gn
            aucs.append(float((gp * (below + 0.5 * gn)).sum() / (total_p * total_n)))
        return float(np.mean(aucs)) if aucs else float("nan")


def interval(values: np.ndarray, resamples: int, level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (float64 [N]), ``resamples`` resamples drawn
    by ``numpy.random.default_rng(seed)``."""
    from scipy.stats import bootstrap

    if len(values) < 2 or np.all(values == values[0]):
        return float(values.mean()), float(values.mean())  # no spread to resample (scipy refuses degenerate data)
    res = bootstrap((values,), lambda v, axis: v.mean(axis), vectorized=True, n_resamples=resamples,
                    confidence_level=level, method="percentile", rng=np.random.default_rng(seed),
                    batch=max(1, (1 << 22) // len(values)))  # at most 4M resampled values (32 MB) at a time
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def interval_of(statistic, n: int, resamples: int, level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap interval of ``statistic(idx)`` (idx: int [n] resampled sample positions, drawn by
    ``numpy.random.default_rng(seed)`` as for ``interval``: the same resamples), for statistics that are not a
    mean of one per-sample value (macro F1, ECE, AUROC); ``scipy.stats.bootstrap`` on the positions."""
    from scipy.stats import bootstrap

    point = statistic(np.arange(n))
    if n < 2:
        return point, point
    res = bootstrap((np.arange(n),), statistic, vectorized=False, n_resamples=resamples, confidence_level=level,
                    method="percentile", rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return (point, point) if np.isnan(low) else (low, high)


def intervals(rows: np.ndarray, cols: SampleColumns, resamples: int, level: float, seed: int) -> dict:
    """{metric: {low, high}} plus {level, resamples, seed, method, samples} from every rank's ``per_sample`` rows
    (any order; sorted here by sample id): top-k and NLL (means), macro F1, ECE and, with ``cols.probs``, the
    macro AUROC. Raises ValueError when a sample id is missing or repeated."""
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    n = len(rows)
    if not np.array_equal(rows[:, 0], np.arange(n, dtype=np.float64)):
        raise ValueError(f"bootstrap: the per-sample rows do not hold each of the {n} sample ids once")
    out: dict = {"level": level, "resamples": resamples, "seed": seed, "method": "percentile bootstrap over samples",
                 "samples": n}
    names = cols.mean_names()
    for j, name in enumerate(names, start=1):
        low, high = interval(rows[:, j], resamples, level, seed)
        out[name] = {"low": low, "high": high}
    k = 1 + len(names)
    target, pred, conf = rows[:, k].astype(np.int64), rows[:, k + 1].astype(np.int64), rows[:, k + 2]
    correct = (target == pred).astype(np.float64)
    stats = {"macro_f1": lambda i: macro_f1(target[i], pred[i], cols.num_classes),
             "ece": lambda i: expected_calibration_error(correct[i], conf[i], cols.ece_bins)}
    if cols.probs:
        probs = rows[:, k + 3:]
        stats["auroc_macro"] = MacroAuroc(target, probs)
    for name, statistic in stats.items():
        low, high = interval_of(statistic, n, resamples, level, seed)
        out[name] = {"low": low, "high": high}
    return out


def vector_intervals(statistic, names: list[str], n: int, plan: tuple[int, float, int], unit: str) -> dict:
    """{name: {low, high}} for each entry of ``statistic(idx)`` (float64 [len(names)] of the resampled positions
    ``idx`` int [n]) plus {level, resamples, seed, method, samples, unit}; ``plan`` = (resamples, level, seed).
    ``scipy.stats.bootstrap`` (percentile) over the positions with ``numpy.random.default_rng(seed)``. A value
    undefined on the whole set (-1 or nan: COCO's -1 where nothing is defined) keeps it as both ends."""
    from scipy.stats import bootstrap

    resamples, level, seed = plan
    point = np.asarray(statistic(np.arange(n)), dtype=np.float64)
    out: dict = {"level": level, "resamples": resamples, "seed": seed, "method": f"percentile bootstrap over {unit}",
                 "samples": n, "unit": unit}
    low = high = point
    if n >= 2:
        res = bootstrap((np.arange(n),), statistic, vectorized=False, n_resamples=resamples, confidence_level=level,
                        method="percentile", rng=np.random.default_rng(seed))
        low, high = np.atleast_1d(res.confidence_interval.low), np.atleast_1d(res.confidence_interval.high)
    for j, name in enumerate(names):
        defined = point[j] != -1 and np.isfinite(point[j]) and np.isfinite(low[j]) and np.isfinite(high[j])
        out[name] = {"low": float(low[j] if defined else point[j]), "high": float(high[j] if defined else point[j])}
    return out


class SegmentationResampler:
    """``self(idx)``: [mIoU, mean_dice, mIoU_per_image] (float64 [3]) of the image multiset ``idx`` from the
    per-image rows of ``SegmentationMetrics`` (``rows`` int64 [I, 1 + 2C]: sample id, intersection [C], union
    [C], sorted by sample id). A resample's class counts are the drawn images' counts summed (each image as often
    as drawn): tp_c = sum intersection, union_c = sum union, so IoU_c = tp_c / union_c and Dice_c = 2 tp_c /
    (union_c + tp_c) over the classes present (union_c > 0), as the metric defines them; pixel accuracy and
    fwIoU need each image's label counts, which the rows do not keep."""

    names = ["mIoU", "mean_dice", "mIoU_per_image"]

    def __init__(self, rows: np.ndarray, num_classes: int):
        c = num_classes
        self.inter, self.union = rows[:, 1:1 + c].astype(np.float64), rows[:, 1 + c:].astype(np.float64)
        valid = self.union > 0
        iou = np.zeros_like(self.inter)
        np.divide(self.inter, self.union, out=iou, where=valid)
        self.image_iou_sum, self.image_pairs = iou.sum(1), valid.sum(1).astype(np.float64)

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        w = np.bincount(idx, minlength=len(self.inter)).astype(np.float64)
        tp, union = w @ self.inter, w @ self.union
        present = union > 0
        pairs = w @ self.image_pairs
        return np.array([np.mean(tp[present] / union[present]) if present.any() else np.nan,
                         np.mean(2 * tp[present] / (union[present] + tp[present])) if present.any() else np.nan,
                         (w @ self.image_iou_sum) / pairs if pairs else np.nan])
