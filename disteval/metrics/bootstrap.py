"""Bootstrap confidence intervals over global sample ids (``eval.ci.*``), identical at every world size.

Each rank computes per-sample statistics from its outputs (``per_sample``: correct@k for each k of
``eval.topk``, and the negative log-likelihood in float64); rank 0 receives every rank's rows, orders them by
global sample id and resamples samples (``intervals``: ``scipy.stats.bootstrap``, percentile method, one
seeded generator per metric). The rows are functions of each sample's own outputs, which bitwise mode makes the
same bits at every world size, and the resampling sees them in sample-id order, so the intervals are ``==`` at
every world size and loader worker count. Source of the method: Efron & Tibshirani, *An Introduction to the
Bootstrap* (1993), ch. 13 (percentile intervals).
"""
from __future__ import annotations

import numpy as np
import torch


def per_sample(logits: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor, topk: list[int]) -> np.ndarray:
    """float64 rows [B, 2 + len(topk)]: sample id, correct@k for each k (0/1), NLL (log-sum-exp minus the
    target's logit, in float64). ``logits`` float [B, C], ``targets`` int64 [B], ``ids`` int64 [B]."""
    z = logits.detach().cpu().double()
    y = torch.as_tensor(targets).cpu().long()
    ranked = z.topk(max(topk), dim=1).indices
    cols = [ids.cpu().double()]
    cols += [(ranked[:, :k] == y[:, None]).any(1).double() for k in topk]
    cols.append(torch.logsumexp(z, dim=1) - z.gather(1, y[:, None]).squeeze(1))
    return torch.stack(cols, dim=1).numpy()


def names(topk: list[int]) -> list[str]:
    """The metrics of ``per_sample``'s columns after the id: top{k}..., nll."""
    return [f"top{k}" for k in topk] + ["nll"]


def interval(values: np.ndarray, resamples: int, level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (float64 [N]), ``resamples`` resamples drawn
    by ``numpy.random.default_rng(seed)``."""
    from scipy.stats import bootstrap

    if len(values) < 2 or np.all(values == values[0]):
        return float(values.mean()), float(values.mean())  # no spread to resample (scipy refuses degenerate data)
    res = bootstrap((values,), lambda v, axis: v.mean(axis), vectorized=True, n_resamples=resamples,
                    confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def intervals(rows: np.ndarray, topk: list[int], resamples: int, level: float, seed: int) -> dict:
    """{metric: {low, high}} plus {level, resamples, seed, method, samples} from every rank's ``per_sample`` rows
    (any order; sorted here by sample id). Raises ValueError when a sample id is missing or repeated."""
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    n = len(rows)
    if not np.array_equal(rows[:, 0], np.arange(n, dtype=np.float64)):
        raise ValueError(f"bootstrap: the per-sample rows do not hold each of the {n} sample ids once")
    out: dict = {"level": level, "resamples": resamples, "seed": seed, "method": "percentile bootstrap over samples",
                 "samples": n}
    for j, name in enumerate(names(topk), start=1):
        low, high = interval(rows[:, j], resamples, level, seed)
        out[name] = {"low": low, "high": high}
    return out
