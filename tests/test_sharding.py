"""Exact shards (pure) and the padding bias of torch's DistributedSampler they avoid."""
import pytest
from torch.utils.data import DistributedSampler

from disteval.data import ExactShardSampler, shard_bounds


@pytest.mark.parametrize("n", [0, 1, 2, 7, 97, 1000, 1001])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 7, 64])
def test_shards_tile_range_exactly(n, w):
    ids = [i for r in range(w) for i in ExactShardSampler(n, w, r)]
    assert ids == list(range(n))
    sizes = [len(ExactShardSampler(n, w, r)) for r in range(w)]
    assert max(sizes) - min(sizes) <= (1 if n else 0)
    assert sum(sizes) == n


def test_more_ranks_than_samples_gives_empty_shards():
    assert [shard_bounds(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_bad_arguments():
    with pytest.raises(ValueError):
        shard_bounds(5, 0, 0)
    with pytest.raises(ValueError):
        shard_bounds(5, 2, 2)


def test_distributed_sampler_pads_but_exact_shards_do_not():
    """N=10, W=4, a model right only on items 0 and 1: padded sampling says 0.333, the truth is 0.2."""
    right = {0, 1}
    padded = [i for r in range(4) for i in DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)]
    assert len(padded) == 12
    assert sum(i in right for i in padded) / len(padded) == pytest.approx(1 / 3)
    exact = [i for r in range(4) for i in ExactShardSampler(10, 4, r)]
    assert sum(i in right for i in exact) / len(exact) == 0.2


@pytest.mark.parametrize("n", [0, 1, 2, 7, 63, 64, 65, 97, 1000, 1001])
@pytest.mark.parametrize("b", [1, 7, 64])
@pytest.mark.parametrize("w", [1, 2, 3, 5, 8, 64])
def test_batch_aligned_shards_hold_whole_global_batches(n, b, w):
    """Every rank's loader batches are global batches [kB, (k+1)B): the batch sequence is W-independent."""
    samplers = [ExactShardSampler(n, w, r, batch_size=b) for r in range(w)]
    assert [i for s in samplers for i in s] == list(range(n))
    batches = []
    for s in samplers:
        ids = list(s)
        assert s.start % b == 0 or s.start == n
        chunks = [ids[i:i + b] for i in range(0, len(ids), b)]
        assert all(c[0] // b == s.first_batch + k for k, c in enumerate(chunks))
        batches += chunks
    assert batches == [list(range(k, min(k + b, n))) for k in range(0, n, b)]
    counts = [len(range(s.start, s.end, b)) for s in samplers]  # batches per rank: imbalance at most one
    assert max(counts) - min(counts) <= 1


def test_batch_aligned_skip_must_be_whole_batches():
    assert list(ExactShardSampler(20, 1, 0, skip=14, batch_size=7)) == list(range(14, 20))
    assert list(ExactShardSampler(20, 1, 0, skip=20, batch_size=7)) == []
    with pytest.raises(ValueError, match="whole number of batches"):
        ExactShardSampler(20, 1, 0, skip=5, batch_size=7)
