"""Sample-id coverage check (pure)."""
import numpy as np
import pytest
import torch

from disteval.errors import CoverageError
from disteval.metrics import SampleIdCoverage, check_coverage, raise_if_incomplete
from disteval.metrics.coverage import ids_to_runs


def _runs(*id_lists):
    runs = []
    for ids in id_lists:
        cov = SampleIdCoverage()
        for s in range(0, len(ids), 3):
            cov.update(torch.tensor(ids[s:s + 3], dtype=torch.int64))
        runs.append(cov.runs().numpy())
    return np.concatenate(runs) if runs else np.zeros((0, 2), np.int64)


def test_exact_cover_passes():
    rep = check_coverage(_runs(list(range(0, 5)), list(range(5, 12)), []), 12)
    assert rep.ok and rep.missing == rep.duplicated == 0


def test_contiguous_shard_is_one_run():
    assert _runs(list(range(100, 200))).tolist() == [[100, 200]]


def test_missing_and_duplicates_counted_and_named():
    # padded sampler of N=10, W=4: ids 0 and 1 appear twice
    rep = check_coverage(_runs([0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]), 10)
    assert rep.missing == 0 and rep.duplicated == 2 and rep.first_duplicated == [0, 1]
    rep = check_coverage(_runs([0, 1, 2], [5, 6]), 8)
    assert rep.missing == 3 and rep.first_missing == [3, 4, 7]
    with pytest.raises(CoverageError, match=r"3 sample id\(s\) missing \(first: \[3, 4, 7\]\)"):
        raise_if_incomplete(rep)


def test_duplicate_within_one_batch_and_out_of_range():
    rep = check_coverage(_runs([0, 1, 1, 2, 3, 3, 3], [4, 12]), 5)
    assert rep.duplicated == 2 and rep.extra_counts == 3
    assert rep.out_of_range == 1 and rep.first_out_of_range == [12]


@pytest.mark.parametrize("seed", range(5))
def test_random_multisets_against_bincount(seed):
    rng = np.random.default_rng(seed)
    n = 200
    ids = rng.integers(0, n, size=180)
    counts = np.bincount(ids, minlength=n)
    rep = check_coverage(ids_to_runs(ids), n)
    assert rep.missing == int((counts == 0).sum())
    assert rep.duplicated == int((counts > 1).sum())
    assert rep.extra_counts == int((counts[counts > 1] - 1).sum())
    assert rep.first_missing == np.nonzero(counts == 0)[0][:5].tolist()
