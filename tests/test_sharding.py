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
