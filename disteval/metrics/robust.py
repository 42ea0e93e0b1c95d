"""Robust aggregation of repeated trials and outlier ranks (pure numpy; no torch.distributed).

Trials: ``eval.trials=K`` evaluates the whole dataset K times. ``summarize_trials`` reports, per scalar
metric, the mean and sample standard deviation (ddof=1), the median and the median absolute deviation (MAD),
and a sigma-clipped mean. The classic "drop values beyond 3 standard deviations of the mean" filter cannot
reject anything for K <= 10: a single point's z-score is bounded by (K-1)/sqrt(K) (Shiffler 1988, "Maximum
Z scores and outliers", The American Statistician 42(1)). So the clip here is centred on the median with the
MAD scale (1.4826 * MAD estimates the standard deviation of a normal sample), which one outlier cannot
inflate, and it states how many trials it dropped.

Outlier ranks: each rank's *local* top-1 accuracy on its own shard is compared with the others by the
modified z-score z = (x - median) / scale (Iglewicz and Hoaglin 1993, "How to Detect and Handle Outliers",
threshold |z| > 3.5), with scale = max(1.4826 * MAD, the standard error of the difference between rank r's
accuracy and the other ranks' under one common accuracy p, sqrt(p (1 - p) (1/n_r + 1/n_others)), p pooled over
all ranks) so that the sampling noise of a small shard is never called an outlier. Only *low* outliers may be
excluded, and only while they are fewer than half of the ranks and no rank stands out *above* the others
(which means most ranks are the broken ones).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD * 1.4826 estimates sigma for normal data
OUTLIER_Z = 3.5  # Iglewicz and Hoaglin's recommended cut-off for the modified z-score
AGGREGATES = ("mean", "median", "sigma_clip")


def robust_stats(values: Sequence[float], clip_sigma: float = 3.0) -> dict:
    """Summary of K repeated values (float64): k, mean, std (ddof=1; 0 for K=1), median, mad (raw),
    mean is math.fsum / K; sigma_clip_mean (mean of values within ``clip_sigma`` * 1.4826 * MAD of the median; with MAD = 0 the values
    equal to the median), dropped (trials the clip left out), spread (max - min) and agree (all bit-equal).
    Raises ValueError for an empty sequence or non-finite values (a trial's metric must be defined)."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        raise ValueError("robust_stats needs at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"robust_stats: non-finite trial values {x.tolist()}")
    agree = bool(np.all(x == x[0]))
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    keep = np.abs(x - med) <= clip_sigma * MAD_TO_SIGMA * mad
    if agree:  # identical trials: the exact value, not a sum's rounding (K * x / K need not be x)
        return {"k": int(x.size), "mean": float(x[0]), "std": 0.0, "median": float(x[0]), "mad": 0.0,
                "sigma_clip_mean": float(x[0]), "dropped": 0, "spread": 0.0, "agree": True}
    return {"k": int(x.size), "mean": math.fsum(x.tolist()) / x.size, "std": float(x.std(ddof=1)),
            "median": med, "mad": mad, "sigma_clip_mean": float(x[keep].mean()), "dropped": int((~keep).sum()),
            "spread": float(x.max() - x.min()), "agree": False}


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The finite float entries of a metrics dict (integer counts such as num_samples, and nested tables such as
    per-class values, are left out of trial statistics)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}


def summarize_trials(trials: list[dict], aggregate: str = "median", clip_sigma: float = 3.0) -> tuple[dict, dict]:
    """Combine the metrics dicts of K trials.

    Returns ``(metrics, summary)``: ``metrics`` is the last trial's dict when every scalar agrees bit for bit
    (a deterministic evaluation: nothing is estimated), else the same dict with each scalar replaced by the
    ``aggregate`` estimate (mean | median | sigma_clip); ``summary`` = {k, aggregate, agree, values {name:
    [K]}, stats {name: robust_stats}, disagreeing [names]}. Raises ValueError for an unknown aggregate."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"eval.trial_aggregate: {aggregate!r} is not one of {list(AGGREGATES)}")
    names = [k for k in scalar_metrics(trials[-1]) if all(k in scalar_metrics(t) for t in trials)]
    values = {k: [scalar_metrics(t)[k] for t in trials] for k in names}
    stats = {k: robust_stats(v, clip_sigma) for k, v in values.items()}
    disagreeing = sorted(k for k, s in stats.items() if not s["agree"])
    metrics = dict(trials[-1])
    if disagreeing:
        field = {"mean": "mean", "median": "median", "sigma_clip": "sigma_clip_mean"}[aggregate]
        metrics.update({k: s[field] for k, s in stats.items()})
    summary = {"k": len(trials), "aggregate": aggregate, "agree": not disagreeing, "values": values,
               "stats": stats, "disagreeing": disagreeing}
    return metrics, summary


def rank_outliers(accuracy: Sequence[float | None], samples: Sequence[int], threshold: float = OUTLIER_Z) -> dict:
    """Modified z-scores of per-rank local accuracies (see the module docstring).

    accuracy: per rank, the fraction of its samples classified correctly (None for an empty shard); samples:
    per rank, its sample count. Returns {median, mad, pooled, z [per rank, None where undefined], outliers
    (|z| > threshold), low, high, excludable (the low outliers when fewer than half the ranks and no high
    outlier, else []), threshold, skipped (reason, when fewer than 3 ranks have samples)}."""
    ok = [r for r, (a, n) in enumerate(zip(accuracy, samples)) if a is not None and n > 0 and math.isfinite(a)]
    out: dict = {"threshold": threshold, "z": [None] * len(accuracy), "outliers": [], "low": [], "high": [],
                 "excludable": [], "median": None, "mad": None, "pooled": None, "skipped": None}
    if len(ok) < 3:
        out["skipped"] = f"needs at least 3 ranks with samples, {len(ok)} had any"
        return out
    x = np.array([accuracy[r] for r in ok], dtype=np.float64)
    n = np.array([samples[r] for r in ok], dtype=np.float64)
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    total = float(n.sum())
    p = float((x * n).sum() / total)
    out.update(median=med, mad=mad, pooled=p)
    p = min(max(p, 0.5 / total), 1.0 - 0.5 / total)
    for r, xr, nr in zip(ok, x, n):
        se = math.sqrt(p * (1.0 - p) * (1.0 / nr + 1.0 / (total - nr)))
        z = float((xr - med) / max(MAD_TO_SIGMA * mad, se))
        out["z"][r] = z
        if z < -threshold:
            out["low"].append(r)
        elif z > threshold:
            out["high"].append(r)
    out["outliers"] = sorted(out["low"] + out["high"])
    if out["low"] and not out["high"] and len(out["low"]) < len(ok) / 2:
        out["excludable"] = list(out["low"])
    return out
