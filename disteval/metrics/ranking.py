"""Threshold-free scores: macro one-vs-rest AUROC and average precision (multi-class and multi-label).

These need every score, not a sum: the states are *gather* states (scores float64 [n, C], targets int64),
concatenated across ranks once at the end. Both scores are invariant to the order of samples (ties are
grouped by distinct score value), so the gathered order does not matter.

Definitions (as scikit-learn's ``roc_auc_score`` and ``average_precision_score``):
- AUROC of one class = area under the ROC curve with ties handled as in the trapezoidal rule over distinct
  thresholds, computed here as the Mann-Whitney statistic with average ranks (identical value);
- AP of one class = sum over distinct thresholds of (R_n - R_{n-1}) * P_n (no interpolation);
- macro = unweighted mean over classes. A class without positives (AUROC, AP) or without negatives (AUROC)
  is undefined: reported as None and left out of the macro mean (scikit-learn raises for AUROC instead).
Multi-class scores are softmax probabilities (float64); multi-label scores are sigmoid probabilities.
"""
from __future__ import annotations

import numpy as np
import torch

from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.meaning import Meaning


def binary_auroc(y: np.ndarray, s: np.ndarray) -> float | None:
    """AUROC of scores ``s`` float [n] for binary labels ``y`` bool [n]; None without both classes."""
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average 1-based ranks over runs of equal scores
    starts = np.concatenate(([0], np.nonzero(np.diff(s_sorted))[0] + 1))
    ends = np.concatenate((starts[1:], [s.size]))
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def binary_average_precision(y: np.ndarray, s: np.ndarray) -> float | None:
    """Average precision (scikit-learn's step-wise definition) of scores ``s`` for labels ``y`` bool [n];
    None without positives."""
    n_pos = int(y.sum())
    if n_pos == 0:
        return None
    order = np.argsort(-s, kind="mergesort")
    s_sorted, y_sorted = s[order], y[order]
    last = np.concatenate((np.nonzero(np.diff(s_sorted))[0], [s.size - 1]))  # end of each tie group
    tps = np.cumsum(y_sorted)[last]
    precision = tps / (last + 1.0)
    recall = tps / n_pos
    return float(np.sum(np.diff(np.concatenate(([0.0], recall))) * precision))


_NONE = torch.iinfo(torch.int64).max


class RankingMetrics(Metric):
    """Macro one-vs-rest AUROC and AP.

    Args:
        num_classes: C.
        multilabel: False: targets int64 [B] in [0, C), scores = softmax(logits); True: targets {0, 1}
            [B, C], scores = sigmoid(logits).
    """

    meaning = Meaning(main=("auroc_macro", "ap_macro"), precedence=50)

    def __init__(self, num_classes: int, multilabel: bool = False):
        super().__init__()
        self.num_classes, self.multilabel = num_classes, multilabel
        # scores may travel as fp16/bf16 when the user opts in (communication.compression); targets are exact
        self.add_state("scores", torch.zeros((0, num_classes), dtype=torch.float64), "gather", compressible=True)
        shape = (0, num_classes) if multilabel else (0,)
        self.add_state("targets", torch.zeros(shape, dtype=torch.int64), "gather")
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bad = torch.tensor(_NONE)  # smallest sample id with a multi-label target other than 0/1

    device_resident = True

    def to(self, device):
        super().to(device)
        self._parts = [(s.to(self.device), t.to(self.device)) for s, t in self._parts]
        self._bad = self._bad.to(self.device)
        return self

    def reset(self) -> None:
        super().reset()
        self._bad = torch.tensor(_NONE, device=self.device)

    def raise_deferred(self) -> None:
        """DataError naming the smallest sample id whose multi-label targets were not all 0/1."""
        first = int(self._bad)
        if first != _NONE:
            raise DataError(f"sample id {first}: multi-label targets must be 0/1", sample_id=first)

    @torch.no_grad()
    def update(self, outputs: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """outputs: logits float [B, C]; targets: int64 [B] (multi-class) or {0,1} [B, C] (multi-label)."""
        if outputs.ndim != 2 or outputs.shape[1] != self.num_classes:
            raise DataError(f"ranking metrics expect logits [B, {self.num_classes}], got {tuple(outputs.shape)}")
        logits = outputs.detach().to(self.device, torch.float64, non_blocking=True)
        targets = targets.detach().to(self.device, non_blocking=True).long()
        if self.multilabel:
            if targets.shape != logits.shape:
                raise DataError(f"multi-label targets must be 0/1 of shape {tuple(logits.shape)}, "
                                f"got {tuple(targets.shape)}")
            bad = ((targets != 0) & (targets != 1)).any(dim=1)  # raised by raise_deferred: no host sync here
            first = torch.where(bad, sample_ids.to(self.device, non_blocking=True), _NONE).min()
            self._bad = torch.minimum(self._bad, first) if logits.shape[0] else self._bad
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=1)
        self._parts.append((scores, targets))

    def _flush(self) -> None:
        if self._parts:
            scores = torch.cat([self.state_tensors["scores"]] + [p[0] for p in self._parts])
            targets = torch.cat([self.state_tensors["targets"]] + [p[1] for p in self._parts])
            self.state_tensors["scores"], self.state_tensors["targets"] = scores, targets
            self._parts = []

    def compute(self) -> dict:
        """``auroc_macro``, ``ap_macro`` (None when no class is defined), per-class lists ``auroc``, ``ap``."""
        self._flush()
        self.raise_deferred()
        scores = self.state_tensors["scores"].cpu().numpy()
        targets = self.state_tensors["targets"].cpu().numpy()
        auroc, ap = [], []
        for c in range(self.num_classes):
            y = targets[:, c].astype(bool) if self.multilabel else targets == c
            auroc.append(binary_auroc(y, scores[:, c]))
            ap.append(binary_average_precision(y, scores[:, c]))

        def mean(vals):
            defined = [v for v in vals if v is not None]
            return float(np.mean(defined)) if defined else None

        return {"auroc_macro": mean(auroc), "ap_macro": mean(ap), "auroc": auroc, "ap": ap}
