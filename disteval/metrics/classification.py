"""Classification metrics from sufficient statistics: top-k accuracy, confusion matrix (per-class accuracy,
macro precision / recall / F1), mean cross-entropy (NLL) and expected calibration error.

States (all sum-reduced): ``count`` int64 [], ``correct_topk`` int64 [K], ``confusion`` int64 [C, C]
(rows = true class, columns = predicted class, as scikit-learn's confusion_matrix), ``nll_sum`` float64 [],
``ece_count`` int64 [M], ``ece_correct`` int64 [M], ``ece_conf_sum`` float64 [M].

``confusion`` is sliceable: every result derived from it needs only, per class c, tp_c (the diagonal entry,
in row c), support_c (row sum) and predicted_c (column sum, i.e. the sum over every block of rows of that
block's column sums). A rank holding rows [a, b) of the summed matrix therefore finishes classes a..b-1 as
int64 counts ``[b - a, 3]`` = (tp, support, predicted) after one more reduce-scatter of its column sums.

Definitions:
- prediction = argmax of the logits, ties to the lowest class index (torch.argmax / numpy.argmax);
- top-k correct when the target is among the first k classes of a stable descending sort of the logits
  (``numpy.argsort(-logits, kind="stable")[:, :k]``), so ties also go to the lower class index;
- precision_c = tp/(tp+fp), recall_c = tp/(tp+fn), F1_c = 2tp/(2tp+fp+fn), each 0 when its denominator is 0,
  macro = unweighted mean over all C classes (scikit-learn's ``average="macro", zero_division=0`` with
  ``labels=range(C)``);
- NLL = mean over samples of -log softmax(logits)[target], computed in float64;
- ECE (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017, eq. 3) with M equal-width bins
  ((m-1)/M, m/M] of the confidence max softmax: sum_m |B_m|/n * |acc(B_m) - conf(B_m)|.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.meaning import Meaning

CONFUSION_IN_RESULTS = 50  # the most classes whose confusion matrix results.json holds (C x C ints)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num/den element-wise as float64, 0 where den == 0."""
    out = np.zeros(num.shape, dtype=np.float64)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _no_invalid(device: torch.device) -> torch.Tensor:
    """``ClassificationMetrics._invalid`` with nothing recorded: counts 0, first ids int64 max."""
    none = torch.iinfo(torch.int64).max
    return torch.tensor([0, none, 0, 0, none], dtype=torch.int64, device=device)


class ClassificationMetrics(Metric):
    """Accumulates classification statistics over batches of logits, on the logits' device with no host
    synchronisation per batch (``device_resident``).

    Args:
        num_classes: C, the number of classes (targets must lie in [0, C)).
        topk: the k of top-k accuracy, each in [1, C].
        ece_bins: M, number of equal-width confidence bins of the ECE.

    Raises ValueError for an invalid k or bin count.
    """

    meaning = Meaning(main=("top1", "accuracy"), lower=("nll", "ece"), precedence=0)

    def __init__(self, num_classes: int, topk: Sequence[int] = (1, 5), ece_bins: int = 15):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        bad = [k for k in topk if not 1 <= k <= num_classes]
        if bad:
            raise ValueError(f"eval.classification.topk values {bad} outside [1, num_classes={num_classes}]")
        if ece_bins < 1:
            raise ValueError(f"eval.classification.ece_bins must be >= 1, got {ece_bins}")
        self.num_classes = num_classes
        self.topk = tuple(int(k) for k in topk)
        self.ece_bins = ece_bins
        self.add_state("count", torch.zeros((), dtype=torch.int64))
        self.add_state("correct_topk", torch.zeros(len(self.topk), dtype=torch.int64))
        self.add_state("confusion", torch.zeros(num_classes, num_classes, dtype=torch.int64), sliceable=True)
        self._class_counts: torch.Tensor | None = None  # [C, 3] (tp, support, predicted) when sliced
        self.add_state("nll_sum", torch.zeros((), dtype=torch.float64))
        self.add_state("ece_count", torch.zeros(ece_bins, dtype=torch.int64))
        self.add_state("ece_correct", torch.zeros(ece_bins, dtype=torch.int64))
        self.add_state("ece_conf_sum", torch.zeros(ece_bins, dtype=torch.float64))
        self._invalid = _no_invalid(self.device)

    device_resident = True

    def check_batch(self, logits: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Validate one batch's shapes (host metadata, no device access). Raises DataError for a shape
        mismatch. Label range and finiteness are checked on the device by ``update`` and raised by
        ``raise_deferred``."""
        if logits.ndim != 2 or logits.shape[1] != self.num_classes:
            raise DataError(f"model outputs logits of shape {tuple(logits.shape)} but the dataset has "
                            f"{self.num_classes} classes (expected [batch, {self.num_classes}]; check "
                            f"model.num_classes and data.root)")
        if targets.shape != (logits.shape[0],) or sample_ids.shape != (logits.shape[0],):
            raise DataError(f"batch of {logits.shape[0]} logits with targets {tuple(targets.shape)} and "
                            f"sample ids {tuple(sample_ids.shape)}")

    def to(self, device):
        super().to(device)
        self._invalid = self._invalid.to(self.device)
        return self

    def reset(self) -> None:
        super().reset()
        self._invalid = _no_invalid(self.device)

    @torch.no_grad()
    def update(self, outputs: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Add a batch on the states' device (``to``) with no host synchronisation: no ``.item()``, no Python
        branch on a device value, no data-dependent shape. outputs: logits float [B, C] (any float dtype;
        promoted to float64); targets: int64 [B] in [0, C); sample_ids: int64 [B]. A shape mismatch raises
        DataError at once; a label outside [0, C) or a non-finite logit leaves its row uncounted and is
        recorded on the device, raised by ``raise_deferred`` (DataError naming the first such sample id)."""
        dev = self.device
        self.check_batch(outputs, targets, sample_ids)
        lg = outputs.detach().to(dev, torch.float64, non_blocking=True)
        targets = targets.to(dev, non_blocking=True).long()
        n = lg.shape[0]
        if n == 0:
            return
        c = self.num_classes
        in_range = (targets >= 0) & (targets < c)
        finite = torch.isfinite(lg).all(dim=1)
        valid = in_range & finite
        self._record_invalid(in_range, finite, targets, sample_ids.to(dev, non_blocking=True))
        t = targets.clamp(0, c - 1)  # rows with a bad label are masked out below
        logp = torch.log_softmax(lg, dim=1)
        target_logit = lg.gather(1, t[:, None])
        # rank of the target in a stable descending sort: strictly larger + equal with a lower index
        lower = torch.arange(c, device=dev).unsqueeze(0) < t.unsqueeze(1)
        rank = (lg > target_logit).sum(1) + ((lg == target_logit) & lower).sum(1)
        pred = lg.argmax(dim=1)
        correct = (pred == t) & valid
        ones = valid.long()
        s = self.state_tensors
        s["count"] += ones.sum()
        s["correct_topk"] += torch.stack([((rank < k) & valid).sum() for k in self.topk])
        s["confusion"].view(-1).index_add_(0, t * c + pred, ones)
        s["nll_sum"] += -torch.where(valid, logp.gather(1, t[:, None])[:, 0], 0.0).sum()
        conf = logp.max(dim=1).values.exp()
        m = self.ece_bins
        bins = (torch.ceil(torch.nan_to_num(conf) * m).long() - 1).clamp_(0, m - 1)
        s["ece_count"].index_add_(0, bins, ones)
        s["ece_correct"].index_add_(0, bins, correct.long())
        s["ece_conf_sum"].index_add_(0, bins, torch.where(valid, conf, 0.0))

    def _record_invalid(self, in_range: torch.Tensor, finite: torch.Tensor, targets: torch.Tensor,
                        ids: torch.Tensor) -> None:
        """Fold this batch's bad rows into ``_invalid`` int64 [5] = (labels out of range, first such sample
        id, its label, rows with non-finite logits, first such sample id); device ops only."""
        none = torch.iinfo(torch.int64).max
        bad_label, bad_value = ~in_range, ~finite
        first_label = torch.where(bad_label, ids, none).min()
        label_of_first = torch.where(bad_label & (ids == first_label), targets, 0).sum()
        inv = self._invalid
        take = first_label < inv[1]
        inv[2] = torch.where(take, label_of_first, inv[2])
        inv[1] = torch.minimum(inv[1], first_label)
        inv[0] += bad_label.sum()
        inv[3] += bad_value.sum()
        inv[4] = torch.minimum(inv[4], torch.where(bad_value, ids, none).min())

    def raise_deferred(self) -> None:
        """Raise DataError for the first sample id (smallest) whose label lay outside [0, C) or whose logits
        held nan/inf, with how many such rows this metric saw; one host transfer."""
        n_label, first_label, label, n_value, first_value = self._invalid.tolist()
        if n_label:
            raise DataError(f"sample id {first_label}: label {label} outside [0, {self.num_classes}) "
                            f"({n_label} such label(s) on this rank)", sample_id=first_label)
        if n_value:
            raise DataError(f"non-finite logits (nan or inf) for sample id {first_value} "
                            f"({n_value} such sample(s) on this rank)", sample_id=first_value)

    def slice_partials(self, name, block, start, stop):
        """Column sums ``[C]`` int64 of the confusion rows ``[start, stop)``."""
        return block.sum(0)

    def finish_slice(self, name, block, start, stop, partial):
        """``[stop - start, 3]`` int64: (tp, support, predicted) of classes start..stop-1."""
        idx = torch.arange(stop - start)
        return torch.stack([block[idx, start + idx], block.sum(1), partial], dim=1).to(torch.int64)

    def load_finished(self, name, rows):
        """The gathered (tp, support, predicted) rows int64 [C, 3] of every slice, in class order. Raises
        ValueError for another shape."""
        if rows.shape != (self.num_classes, 3):
            raise ValueError(f"finished confusion rows of shape {tuple(rows.shape)}, want ({self.num_classes}, 3)")
        self._class_counts = rows.to(torch.int64)

    def load_synced(self, states):
        """As ``Metric.load_synced``; a full confusion matrix replaces earlier per-slice results."""
        if "confusion" in states:  # a full confusion matrix replaces earlier per-slice results
            self._class_counts = None
        super().load_synced(states)

    def _tp_support_predicted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._class_counts is not None:
            c = self._class_counts.numpy()
            return c[:, 0], c[:, 1], c[:, 2]
        cm = self.state_tensors["confusion"].cpu().numpy()
        return np.diag(cm).astype(np.int64), cm.sum(axis=1), cm.sum(axis=0)

    def compute(self) -> dict:
        """Metric values (floats; None where undefined, e.g. with zero samples):
        ``num_samples``, ``top{k}``, ``accuracy``, ``macro_precision``, ``macro_recall``, ``macro_f1``,
        ``nll``, ``ece``, ``classes_with_samples`` (classes whose support is > 0; the macro averages still run
        over all C classes, as scikit-learn with ``labels=range(C)``), ``per_class_accuracy`` (list of C,
        None for classes without samples),
        ``per_class_support`` (list of C ints), ``reliability`` ({count, correct, confidence_sum}: lists of M,
        the ECE's bins), ``confusion`` (C x C ints, rows = true class; only for C <= CONFUSION_IN_RESULTS and a
        whole matrix)."""
        self.raise_deferred()
        s = {k: v.cpu().numpy() for k, v in self.state_tensors.items()}
        n = int(s["count"])
        tp, support, predicted = self._tp_support_predicted()
        fp, fn = predicted - tp, support - tp
        nan = float("nan")
        out: dict = {"num_samples": n}
        for k, corr in zip(self.topk, s["correct_topk"].tolist()):
            out[f"top{k}"] = corr / n if n else nan
        out["accuracy"] = int(tp.sum()) / n if n else nan
        out["macro_precision"] = float(_ratio(tp, tp + fp).mean())
        out["macro_recall"] = float(_ratio(tp, tp + fn).mean())
        out["macro_f1"] = float(_ratio(2 * tp, 2 * tp + fp + fn).mean())
        out["nll"] = float(s["nll_sum"]) / n if n else nan
        out["ece_bins"] = self.ece_bins
        out["ece"] = float(np.abs(s["ece_correct"] - s["ece_conf_sum"]).sum()) / n if n else nan
        per_class = np.full(self.num_classes, np.nan)
        np.divide(tp, support, out=per_class, where=support != 0)
        out["classes_with_samples"] = int((support > 0).sum())
        out["per_class_accuracy"] = [None if np.isnan(v) else float(v) for v in per_class]
        out["per_class_support"] = support.tolist()
        # the reliability diagram's bins (the ECE's own states) and, for a few classes, the confusion matrix:
        # small, exact, identical at every world size (the HTML run report draws them)
        out["reliability"] = {"count": s["ece_count"].tolist(), "correct": s["ece_correct"].tolist(),
                              "confidence_sum": s["ece_conf_sum"].tolist()}
        if self._class_counts is None and self.num_classes <= CONFUSION_IN_RESULTS:
            out["confusion"] = s["confusion"].tolist()
        return out

    def local_summary(self) -> dict:
        """Small per-rank view of the *local* states (before sync): top-1 accuracy and NLL (None without
        samples)."""
        n = int(self.state_tensors["count"])
        top1 = int(self.state_tensors["confusion"].diagonal().sum())
        return {"accuracy": top1 / n if n else None,
                "nll": float(self.state_tensors["nll_sum"]) / n if n else None}
