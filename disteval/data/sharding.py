"""Exact contiguous shards of [0, N): no padding, no dropped samples, uneven sizes, empty shards allowed."""
from __future__ import annotations

from typing import Iterator

from torch.utils.data import Sampler


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """Half-open range ``[start, end)`` of sample indices owned by ``rank``.

    The first ``N % W`` ranks hold ``N // W + 1`` samples, the others ``N // W`` (so sizes differ by at most
    one and ranks hold nothing when W > N). Concatenating the ranges of ranks 0..W-1 gives [0, N) exactly.

    Raises ValueError for a negative N, W < 1 or a rank outside [0, W).
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ExactShardSampler(Sampler[int]):
    """Yields the indices of ``shard_bounds(num_samples, world_size, rank)`` in order.

    Unlike ``torch.utils.data.DistributedSampler`` it never pads by repeating samples and never drops
    any, so per-rank batch counts may differ; disteval therefore never issues a per-batch collective.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, skip: int = 0):
        self.start, self.end = shard_bounds(num_samples, world_size, rank)
        if not 0 <= skip <= self.end - self.start:
            raise ValueError(f"skip={skip} outside the shard of {self.end - self.start} samples")
        self.skip = skip  # samples of the shard already counted (resumed from a checkpoint)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start + self.skip, self.end))

    def __len__(self) -> int:
        return self.end - self.start - self.skip
