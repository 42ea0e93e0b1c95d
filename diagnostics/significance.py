"""Is a difference between two runs real? ``python -m diagnostics compare RUN_A RUN_B --significance`` reads both
runs' prediction stores (``eval.save_predictions=true``), pairs the samples by global sample id and tests:

- top-1 accuracy: McNemar's exact test (McNemar 1947; the exact form: a two-sided binomial test of the
  discordant pairs, ``scipy.stats.binomtest(n_a, n_a + n_b, 0.5)``, where n_a samples only A classifies right and
  n_b only B), with a paired bootstrap interval of the accuracy difference (``scipy.stats.bootstrap``,
  ``paired=True``, percentile method);
- NLL, when both stores hold logits: the per-sample negative log-likelihoods, a paired permutation test of the
  mean difference (``scipy.stats.permutation_test``, ``permutation_type="samples"``: each sample's two values
  swapped at random) and a paired bootstrap interval.

The samples must be the same: the same set of ids with the same targets; otherwise DataError names how many
differ and which. Resamples, seed and level are arguments; the same seed gives the same numbers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from disteval.data.prediction_store import read_manifest
from disteval.errors import DataError

SHOW = 8  # sample ids named in a refusal


def _store(run: Path) -> dict:
    """A run's predictions by sample id: {ids, target, top1, nll (None without logits)}."""
    import pyarrow.parquet as pq

    store = Path(run) / "predictions"
    manifest = read_manifest(store)
    if manifest.get("task") not in ("classification",):
        raise DataError(f"{store}: a {manifest.get('task')} store; the paired tests compare classification stores "
                        "(top-1 and NLL per sample)")
    table = pq.read_table(store, columns=["sample_id", "target", "topk_ids"] +
                          (["logits"] if manifest["settings"].get("logits") else [])).sort_by("sample_id")
    target = table.column("target").to_numpy()
    top1 = table.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(len(target), -1)[:, 0]
    nll = None
    if "logits" in table.column_names:
        z = table.column("logits").combine_chunks().flatten().to_numpy().reshape(len(target), -1).astype(np.float64)
        m = z.max(1)
        nll = m + np.log(np.exp(z - m[:, None]).sum(1)) - z[np.arange(len(target)), target]
    return {"ids": table.column("sample_id").to_numpy(), "target": target, "top1": top1, "nll": nll}


def _same_samples(a: dict, b: dict, run_a: Path, run_b: Path) -> None:
    if len(a["ids"]) != len(b["ids"]) or not np.array_equal(a["ids"], b["ids"]):
        only_a = np.setdiff1d(a["ids"], b["ids"])
        only_b = np.setdiff1d(b["ids"], a["ids"])
        raise DataError(f"the runs scored different samples: {len(a['ids'])} in {run_a}, {len(b['ids'])} in {run_b}; "
                        f"{len(only_a)} only in A (ids {only_a[:SHOW].tolist()}), {len(only_b)} only in B (ids "
                        f"{only_b[:SHOW].tolist()}): a paired test needs the same samples")
    differ = np.flatnonzero(a["target"] != b["target"])
    if len(differ):
        ids = a["ids"][differ][:SHOW].tolist()
        raise DataError(f"{len(differ)} samples have other targets in the two runs (ids {ids}): not the same data")


def _interval(x: np.ndarray, y: np.ndarray, resamples: int, level: float, seed: int) -> list[float]:
    """Percentile bootstrap interval of mean(x) - mean(y) over paired samples."""
    from scipy.stats import bootstrap

    res = bootstrap((x, y), lambda u, v, axis: u.mean(axis) - v.mean(axis), paired=True, vectorized=True,
                    n_resamples=resamples, confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def paired_test(run_a: Path, run_b: Path, resamples: int = 1000, level: float = 0.95, seed: int = 0) -> dict:
    """The paired comparison of the module docstring: {samples, top1: {a, b, difference, interval, level,
    only_a, only_b, test, p_value}, nll: {a, b, difference, interval, level, test, p_value} or None}. Raises
    DataError when a store is missing or the samples differ."""
    from scipy.stats import binomtest, permutation_test

    a, b = _store(run_a), _store(run_b)
    _same_samples(a, b, run_a, run_b)
    ca, cb = (a["top1"] == a["target"]).astype(np.float64), (b["top1"] == b["target"]).astype(np.float64)
    only_a, only_b = int(((ca == 1) & (cb == 0)).sum()), int(((ca == 0) & (cb == 1)).sum())
    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    out = {"samples": int(len(ca)), "top1": {
        "a": float(ca.mean()), "b": float(cb.mean()), "difference": float(ca.mean() - cb.mean()),
        "interval": _interval(ca, cb, resamples, level, seed), "level": level, "only_a": only_a, "only_b": only_b,
        "test": "McNemar exact (two-sided binomial test of the discordant pairs)", "p_value": float(p)}, "nll": None}
    if a["nll"] is not None and b["nll"] is not None:
        perm = permutation_test((a["nll"], b["nll"]), lambda u, v, axis: u.mean(axis) - v.mean(axis),
                                permutation_type="samples", vectorized=True, n_resamples=resamples,
                                rng=np.random.default_rng(seed))
        out["nll"] = {"a": float(a["nll"].mean()), "b": float(b["nll"].mean()),
                      "difference": float(a["nll"].mean() - b["nll"].mean()),
                      "interval": _interval(a["nll"], b["nll"], resamples, level, seed), "level": level,
                      "test": "paired permutation test of the mean difference", "p_value": float(perm.pvalue)}
    return out


def significant(sig: dict) -> list[str]:
    """The tested metrics whose difference is significant at the level of their intervals (p < 1 - level)."""
    return [n for n in ("top1", "nll") if sig.get(n) and sig[n]["p_value"] < 1 - sig[n]["level"]]


def describe(sig: dict) -> list[str]:
    """One line per tested metric, for the console, and a last line saying which differences are significant."""
    lines = []
    for name in ("top1", "nll"):
        t = sig.get(name)
        if t:
            extra = f", {t['only_a']} samples right only in A, {t['only_b']} only in B" if name == "top1" else ""
            lines.append(f"{name}: A={t['a']:.6g} B={t['b']:.6g}, difference {t['difference']:+.4g} "
                         f"({t['level']:.0%} interval [{t['interval'][0]:+.4g}, {t['interval'][1]:+.4g}]), "
                         f"{t['test']}: p = {t['p_value']:.4g}{extra}")
    tested = [n for n in ("top1", "nll") if sig.get(n)]
    sig_names = significant(sig)
    level = sig[tested[0]]["level"] if tested else 0.95
    lines.append(f"significant at {1 - level:.2g}: {', '.join(sig_names)}" if sig_names else
                 f"no difference is significant at {1 - level:.2g} (p >= {1 - level:.2g} for {', '.join(tested)}): "
                 "the metrics differ, but by no more than noise on these samples would")
    return lines
