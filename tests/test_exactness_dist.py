"""Exactness with real processes (gloo): for N in {1, 2, 7, 97, 1000}, W in {1, 2, 3, 4} and batch size in
{1, 7, 64}, every metric (classification sums and AUROC/AP from gathered scores, ties included, multi-class
and multi-label) equals a
single-process numpy/scikit-learn reference; the collectives issued do not depend on the number of batches;
the reduce_scatter / lossless / chunked synchronisation gives the very same values. One group of W ranks runs all 15 cases of its W."""
import json

import pytest

from dist_workers import (NUM_CLASSES, TOPK, exactness_worker, multilabel_targets, padding_worker,
                          synthetic_logits)
from launchers.local import launch
from reference import assert_metrics_equal, reference_metrics, reference_multilabel, reference_ranking

SIZES = [1, 2, 7, 97, 1000]
BATCHES = [1, 7, 64]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_metrics_equal_single_process_reference(world_size, tmp_path):
    cases = [(n, b) for n in SIZES for b in BATCHES]
    launch(exactness_worker, (str(tmp_path), cases), world_size, str(tmp_path))
    collectives = set()
    for n, b in cases:
        out = json.loads((tmp_path / f"case_{n}_{b}.json").read_text())
        logits, labels = synthetic_logits(n, seed=n)
        assert_metrics_equal(out["metrics"], reference_metrics(logits, labels, NUM_CLASSES, topk=TOPK))
        for key, want in reference_ranking(logits, labels, NUM_CLASSES).items():  # gathered scores
            assert (out["metrics"][key] is None) == (want is None), key
            if want is not None:
                assert abs(out["metrics"][key] - want) <= 1e-12 * abs(want), (key, out["metrics"][key], want)
        for key, want in reference_multilabel(logits, multilabel_targets(n, seed=n)).items():  # multi-label
            got = out["multilabel"][key]
            assert (got is None) == (want is None), key
            if want is not None:
                assert abs(got - want) <= 1e-12 * abs(want), (key, got, want)
        # ``synchronised`` blocks: the local states come back after the block (also after an error in it); with
        # restore=False the global states stay; rank 0's local metrics are those of its own shard
        assert out["restored"] and out["kept"]
        shard = slice(0, out["rank_samples"][0])
        for key, want in reference_multilabel(logits[shard], multilabel_targets(n, seed=n)[shard]).items():
            got = out["ml_local"][key]
            assert (got is None) == (want is None), key
            if want is not None:
                assert abs(got - want) <= 1e-12 * abs(want), (key, got, want)
        # reduce_scatter + per-slice finish, lossless gathers, async chunks: the very same values; the confusion
        # matrix (for the HTML report) is left out when it was reduce-scattered (no rank holds it whole)
        assert "confusion" in out["metrics"] and "confusion" not in out["metrics_alt"]
        assert out["metrics_alt"] == {k: v for k, v in out["metrics"].items() if k != "confusion"}
        assert out["alt_ops"]["reduce_scatter"] >= 2 and out["alt_wire"]["ranking.targets"] == "offset:uint8"
        assert out["coverage_ok"]
        assert sum(out["rank_samples"]) == n and len(out["rank_samples"]) == world_size
        collectives.add(out["collectives"])
    # same number of collectives for 1 batch or 1000 batches per rank: O(1), not O(batches)
    assert len(collectives) == 1, collectives


def test_padding_case_reports_true_accuracy(tmp_path):
    launch(padding_worker, (str(tmp_path),), 4, str(tmp_path))
    out = json.loads((tmp_path / "padding.json").read_text())
    assert out["top1"] == 0.2 and out["coverage_ok"]
