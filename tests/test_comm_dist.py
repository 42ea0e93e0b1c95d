"""Communication layer with real processes (gloo, W=3, one group for all cases): variable-size gathers with
uneven and empty shards, mismatches raising the same clear error on every rank, metadata broadcast, and a
larger timeout for the final synchronisation."""
import json

import pytest
import torch

from comm_workers import comm_worker
from launchers.local import launch

W = 3


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    launch(comm_worker, (str(out),), W, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(W)]


def _rows(r):
    return [[10 * r + i, -i] for i in range(2 - r)]  # rank 0: 2 rows, rank 1: 1 row, rank 2: none


def test_gather_variable_uneven_and_empty(outcome):
    want = [_rows(r) for r in range(W)]
    for r, res in enumerate(outcome):
        assert res["all_gather"] == want
        assert res["gather_to_1"] == (want if r == 1 else None)
        assert res["float_rows"] == [[0.5] * 3 * (r + 1) for r in range(W)]


def test_mismatches_raise_the_same_error_on_every_rank(outcome):
    for case in ("dtype_mismatch", "shape_mismatch"):
        messages = {res[case] for res in outcome}
        assert len(messages) == 1, messages
        msg = messages.pop()
        assert msg.startswith("all_gather_variable: ranks disagree on dtype or trailing shape")
        assert "rank 1" in msg


def test_metadata_broadcast_identical(outcome):
    metas = [res["meta"] for res in outcome]
    assert all(m == metas[0] for m in metas) and metas[0]["seed"] == 1234 and metas[0]["run_id"] == "run-from-rank0"


def test_slow_but_alive_rank_survives_with_larger_sync_timeout(outcome):
    # group timeout 2 s; rank 2 arrives 4 s late: with set_timeout(30) the all_reduce succeeds on every rank,
    assert [res["slow_with_sync_timeout"] for res in outcome] == [W] * W
    # while with the 2 s timeout the waiting ranks fail with a gloo timeout
    assert any("timed out" in str(res["slow_without"]).lower() or "timeout" in str(res["slow_without"]).lower()
               for res in outcome[:2])
