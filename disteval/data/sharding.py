"""Exact contiguous shards of [0, N): no padding, no dropped samples, uneven sizes, empty shards allowed."""
from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler, Sampler

SAMPLERS = ("exact", "padded", "drop_last")


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


def build_sampler(kind: str, num_samples: int, world_size: int, rank: int, skip: int = 0) -> Sampler[int]:
    """``exact`` -> ExactShardSampler; ``padded`` / ``drop_last`` -> torch's ``DistributedSampler(shuffle=False,
    drop_last=...)``, which repeats the first samples so that every rank gets ceil(N/W) of them, or drops the
    last N % W (kept only to reproduce other tools' biased numbers; the coverage check reports the damage).
    Raises ValueError for an unknown kind or a ``skip`` with a non-exact sampler (no resume there)."""
    if kind == "exact":
        return ExactShardSampler(num_samples, world_size, rank, skip=skip)
    if kind not in SAMPLERS:
        raise ValueError(f"data.sampler: {kind!r} is not one of {list(SAMPLERS)}")
    if skip:
        raise ValueError("resuming (skip > 0) needs data.sampler=exact")
    return DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=False,
                              drop_last=kind == "drop_last")


def sampler_span(sampler: Sampler[int]) -> tuple[int, int]:
    """``[start, end)`` of an exact shard; for other samplers the smallest range holding their indices."""
    if isinstance(sampler, ExactShardSampler):
        return sampler.start, sampler.end
    idx = list(iter(sampler))
    return (min(idx), max(idx) + 1) if idx else (0, 0)
