"""Each task family's figures and tables for the HTML run report (``Task.report_figures``), drawn with matplotlib
from results.json ``metrics`` alone: what a figure needs and how it reads is task knowledge, so it lives here and
the report layer only embeds what it is handed (``disteval.common.figures``). A figure whose data the metrics do
not hold (an older record, a sliced confusion matrix) is left out."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from disteval.common.figures import ReportFigure, ReportTable, new_figure


def _bars(key: str, title: str, labels: list[str], values: list[Any], ylabel: str, caption: str = "") -> ReportFigure:
    """A bar per label (None drawn as no bar), values in [0, 1]."""
    fig, ax = new_figure(max(5.0, min(14.0, 0.35 * len(labels) + 2)), 3.4)
    ax.bar(range(len(labels)), [np.nan if v is None else v for v in values], color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=90 if len(labels) > 12 else 0, fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    return ReportFigure(key, title, fig, caption)


def confusion_figure(confusion: list[list[int]]) -> ReportFigure:
    """Heat map of the confusion matrix (rows: true class, columns: predicted), counts written in the cells of a
    small matrix."""
    cm = np.asarray(confusion, dtype=np.int64)
    fig, ax = new_figure(5.2, 4.4)
    image = ax.imshow(cm, cmap="Blues")
    fig.colorbar(image, ax=ax, label="samples")
    if len(cm) <= 12:
        for (i, j), v in np.ndenumerate(cm):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7,
                    color="white" if v > cm.max() / 2 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    return ReportFigure("confusion", "confusion matrix", fig, f"{int(cm.sum()):,} samples; the diagonal is correct")


def reliability_figure(rel: dict, ece: float | None) -> ReportFigure:
    """The ECE's reliability diagram: per equal-width confidence bin, accuracy against mean confidence, with the
    diagonal of perfect calibration and the bins' sample counts."""
    count = np.asarray(rel["count"], dtype=np.float64)
    edges = np.linspace(0.0, 1.0, len(count) + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.asarray(rel["correct"], dtype=np.float64) / count
        conf = np.asarray(rel["confidence_sum"], dtype=np.float64) / count
    fig, ax = new_figure(5.0, 4.0)
    ax.bar(edges[:-1], acc, width=np.diff(edges), align="edge", color="#4c72b0", edgecolor="white", label="accuracy")
    ax.plot(conf, acc, "o", color="#c44e52", markersize=4, label="bin (mean confidence, accuracy)")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    shown = "" if ece is None else f"ECE {ece:.4f}; "
    return ReportFigure("reliability", "reliability diagram", fig,
                        f"{shown}{len(count)} bins, {int(count.sum()):,} samples; empty bins have no bar")


def classification_figures(metrics: dict) -> list:
    """Confusion matrix (when results.json holds it), per-class accuracy bars and the reliability diagram."""
    out: list = []
    if metrics.get("confusion"):
        out.append(confusion_figure(metrics["confusion"]))
    per_class = metrics.get("per_class_accuracy")
    if isinstance(per_class, list) and 0 < len(per_class) <= 200:
        support = metrics.get("per_class_support") or [None] * len(per_class)
        out.append(_bars("per_class_accuracy", "per-class accuracy", [str(c) for c in range(len(per_class))],
                         per_class, "accuracy", f"{len(per_class)} classes; support "
                         f"{min(s for s in support if s is not None) if any(support) else '?'}"
                         f"-{max(s for s in support if s is not None) if any(support) else '?'} samples per class"))
    if isinstance(metrics.get("reliability"), dict):
        out.append(reliability_figure(metrics["reliability"], metrics.get("ece")))
    return out


def coco_figures(metrics: dict, prefix: str = "AP") -> list:
    """COCO AP (or keypoint OKS AP) by IoU threshold and object size, the precision-recall curves and per-category
    AP when results.json holds them. ``-1`` (pycocotools' undefined) is drawn as no bar."""
    out: list = []
    keys = [k for k in (prefix, f"{prefix}50", f"{prefix}75", f"{prefix}s", f"{prefix}m", f"{prefix}l") if k in metrics]
    if keys:
        values = [None if metrics[k] is None or metrics[k] < 0 else metrics[k] for k in keys]
        out.append(_bars("coco_ap", f"{prefix} by IoU threshold and object size", keys, values, prefix,
                         f"{prefix} = mean over IoU 0.50:0.95; {prefix}50/{prefix}75 at one IoU; s/m/l by object "
                         "area (missing bar: undefined, no such objects)"))
    pr = metrics.get("pr_curve")
    if isinstance(pr, dict) and pr.get("recall"):
        fig, ax = new_figure(5.0, 3.8)
        for label, values in pr.items():
            if label != "recall":
                ax.plot(pr["recall"], [np.nan if v is None else v for v in values], label=label)
        ax.set_xlabel("recall")
        ax.set_ylabel("precision")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        out.append(ReportFigure("pr_curve", "precision-recall curves", fig,
                                "area all, maxDets 100, averaged over the categories with ground truth"))
    per_cat = metrics.get("per_category_ap")
    if isinstance(per_cat, dict) and per_cat:
        out.append(_bars("per_category_ap", "per-category AP", list(per_cat), list(per_cat.values()), "AP",
                         "AP@[IoU=0.50:0.95], area all; no bar: no ground truth"))
    return out


def segmentation_figures(metrics: dict) -> list:
    """Per-class IoU bars (the mIoU's terms) and a per-class table with Dice and label pixels."""
    iou = metrics.get("per_class_IoU")
    if not isinstance(iou, list) or not iou:
        return []
    miou = metrics.get("mIoU")
    out: list = [_bars("per_class_iou", "IoU per class", [str(c) for c in range(len(iou))], iou, "IoU",
                       ("" if miou is None else f"mIoU {miou:.4f}; ") + "no bar: class absent from labels and "
                       "predictions")]
    dice = metrics.get("per_class_dice") or [None] * len(iou)
    support = metrics.get("per_class_support") or [None] * len(iou)
    out.append(ReportTable("per_class_iou_table", "per-class IoU, Dice and label pixels", ["class", "IoU", "Dice",
                           "label pixels"], [[c, iou[c], dice[c], support[c]] for c in range(len(iou))]))
    return out


_RECALL = re.compile(r"^(?P<search>.+)_recall@(?P<k>\d+)$")
_KNN = re.compile(r"^knn_(?P<vote>.+)_k(?P<k>\d+)_top(?P<top>\d+)$")


def embedding_figures(metrics: dict) -> list:
    """Retrieval recall@k against k (one line per search direction) and kNN top-1 / top-5 against k (one line
    per vote), from the metrics' ``<search>_recall@<k>`` and ``knn_<vote>_k<k>_top<t>`` keys."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for key, value in metrics.items():
        m = _RECALL.match(key)
        if m and value is not None:
            lines.setdefault(f"{m['search']} recall@k", []).append((int(m["k"]), value))
        m = _KNN.match(key)
        if m and value is not None:
            lines.setdefault(f"kNN {m['vote']} top-{m['top']}", []).append((int(m["k"]), value))
    if not lines:
        return []
    fig, ax = new_figure(5.4, 3.8)
    for label, points in sorted(lines.items()):
        points.sort()
        ax.plot([k for k, _ in points], [v for _, v in points], "o-", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("k")
    ax.set_ylabel("fraction of queries")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    return [ReportFigure("recall_at_k", "recall@k and kNN accuracy against k", fig,
                         "retrieval: a query counts when one of its k nearest is a match; kNN: the vote of the k "
                         "nearest gallery items")]
