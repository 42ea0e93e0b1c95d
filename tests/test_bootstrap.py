"""Bootstrap confidence intervals (``eval.ci.resamples``): ``==`` at W = 1, 2, 3 with real ranks, equal to
scipy's bootstrap on the per-sample values numpy computes from the stored logits (top-k, NLL) and on scikit-learn's
statistics over the same resamples (macro F1, AUROC; ECE from its definition), and covering the true accuracy
of a synthetic classifier at the nominal rate."""
import os

import numpy as np
import pytest

from conftest import load_results, run_disteval
from disteval.metrics.bootstrap import interval

FASHION_ROOT = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION_ROOT), reason="Debian package dataset-fashion-mnist not installed "
                    "(.ci/run installs it)")
def test_intervals_identical_at_every_world_size_and_equal_to_scipy(tmp_path):
    import pyarrow.parquet as pq
    from scipy.stats import bootstrap

    job = ("+experiment=fashion_mnist", "eval.metrics=[classification,ranking]", "eval.ci.resamples=300",
           "eval.ci.seed=11", "eval.progress=false", "data.limit=3000")  # 3,000 of the test images: CI's time
    got = {}
    for w in (1, 2, 3):
        extra = (("eval.save_predictions=true", "eval.predictions.logits=true") if w == 1 else
                 ("data.num_workers=2",) if w == 3 else ())  # and with loader workers
        proc = run_disteval(*job, *extra, f"dist.world_size={w}", run_dir=tmp_path / f"w{w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[w] = load_results(tmp_path / f"w{w}")["confidence_intervals"]
    seconds = [got[w].pop("seconds") for w in (1, 2, 3)]  # rank 0's time for them, the one field that varies
    assert got[1] == got[2] == got[3] and all(s > 0 for s in seconds)
    ci = got[1]
    assert (ci["samples"], ci["resamples"], ci["seed"], ci["level"]) == (3000, 300, 11, 0.95)
    assert "bootstrap intervals over the 3,000 samples" in " ".join(proc.stdout.split())
    table = pq.read_table(tmp_path / "w1" / "predictions").sort_by("sample_id")
    z = np.stack(table.column("logits").to_numpy(zero_copy_only=False)).astype(np.float64)
    y = table.column("target").to_numpy()
    order = np.argsort(-z, axis=1, kind="stable")
    m = z.max(1)
    values = {"top1": (order[:, 0] == y).astype(np.float64), "top5": (order[:, :5] == y[:, None]).any(1).astype(np.float64),
              "nll": m + np.log(np.exp(z - m[:, None]).sum(1)) - z[np.arange(len(y)), y]}
    for name, v in values.items():
        res = bootstrap((v,), np.mean, n_resamples=300, method="percentile", rng=np.random.default_rng(11))
        want = (res.confidence_interval.low, res.confidence_interval.high)
        if name == "nll":  # float64 log-sum-exp in numpy vs torch: the last bits may differ
            assert (ci[name]["low"], ci[name]["high"]) == pytest.approx(want, rel=1e-12)
        else:
            assert (ci[name]["low"], ci[name]["high"]) == want
        assert ci[name]["low"] <= v.mean() <= ci[name]["high"]
    _check_non_mean_intervals(ci, z, y, load_results(tmp_path / "w1")["metrics"])


def _check_non_mean_intervals(ci: dict, z: np.ndarray, y: np.ndarray, metrics: dict) -> None:
    """Macro F1, ECE and macro AUROC: scipy's bootstrap over the same resamples of the sample positions with
    the statistics computed by scikit-learn (F1, AUROC) and by numpy from the ECE's definition, on the stored
    logits; each interval holds the run's own value."""
    from scipy.stats import bootstrap
    from sklearn.metrics import f1_score, roc_auc_score

    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    pred, conf = z.argmax(1), p.max(1)
    edges = np.linspace(0, 1, 16)

    def ece(i):
        total = 0.0
        for lo, hi in zip(edges[:-1], edges[1:]):
            inside = (conf[i] > lo) & (conf[i] <= hi) if lo > 0 else conf[i] <= hi
            total += abs(float((pred[i][inside] == y[i][inside]).sum()) - float(conf[i][inside].sum()))
        return total / len(i)

    stats = {"macro_f1": lambda i: f1_score(y[i], pred[i], average="macro", labels=range(10), zero_division=0),
             "ece": ece, "auroc_macro": lambda i: roc_auc_score(y[i], p[i], multi_class="ovr", labels=range(10))}
    for name, statistic in stats.items():
        res = bootstrap((np.arange(len(y)),), statistic, vectorized=False, n_resamples=300, method="percentile",
                        rng=np.random.default_rng(11))
        want = (res.confidence_interval.low, res.confidence_interval.high)
        assert (ci[name]["low"], ci[name]["high"]) == pytest.approx(want, rel=1e-9, abs=1e-12), name
        assert ci[name]["low"] <= metrics[name] <= ci[name]["high"], name


def test_intervals_cover_the_true_accuracy_at_the_nominal_rate():
    """A synthetic classifier right with probability 0.8 on 400 samples, 400 repetitions: the 95 % intervals
    cover 0.8 in 93-97 % of them."""
    rng = np.random.default_rng(2026)
    covered = 0
    for rep in range(400):
        correct = (rng.random(400) < 0.8).astype(np.float64)
        low, high = interval(correct, 1000, 0.95, seed=rep)
        covered += low <= 0.8 <= high
    assert 0.93 <= covered / 400 <= 0.97, covered / 400


def test_resampled_auroc_equals_scikit_learn_with_ties():
    """``MacroAuroc`` weights each sample by its multiplicity instead of re-sorting: on resamples of scores with
    many ties it equals scikit-learn's roc_auc_score of the resampled rows (one-vs-rest, macro)."""
    from sklearn.metrics import roc_auc_score

    from disteval.metrics.bootstrap import MacroAuroc

    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(6), size=800).round(2)  # rounded: ties within and across classes
    probs /= probs.sum(1, keepdims=True)
    target = rng.integers(0, 6, 800)
    auroc = MacroAuroc(target, probs)
    for _ in range(5):
        i = rng.integers(0, 800, 800)
        assert auroc(i) == pytest.approx(roc_auc_score(target[i], probs[i], multi_class="ovr", labels=range(6)),
                                         rel=1e-12)


def test_an_interrupted_bootstrap_keeps_the_finished_metrics(tmp_path):
    """results.json holds the metrics before the bootstrap starts: Ctrl-C (SIGINT to the run's process group) in
    a long bootstrap (100,000 resamples of 540 digits at W = 2) exits 130 and leaves results.json with metrics
    == a run without intervals (W = 1) and ``confidence_intervals`` null (they were computed first, and lost)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    run_dir = tmp_path / "ci"
    proc = subprocess.Popen([sys.executable, "-m", "disteval", "eval.metrics=[classification,ranking]",
                             "eval.ci.resamples=100000", "dist.world_size=2", "eval.progress=false",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (run_dir / "results.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it was interrupted (the bootstrap took under a poll)"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    kept = load_results(run_dir)
    assert kept["confidence_intervals"] is None
    ref = run_disteval("eval.metrics=[classification,ranking]", "dist.world_size=1", run_dir=tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert kept["metrics"] == load_results(tmp_path / "ref")["metrics"]
