"""Contiguous splits of ``[0, n)`` among ``parts``: the one rule used for sample shards, batch shards and
row slices of reduce-scattered states, so that every layer splits the same way."""
from __future__ import annotations


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """Half-open range ``[start, end)`` of the items of ``[0, num_samples)`` owned by ``rank``.

    The first ``N % W`` ranks hold ``N // W + 1`` items, the others ``N // W`` (so sizes differ by at most
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


def num_batches(num_samples: int, batch_size: int) -> int:
    """Global batches of ``[0, N)`` at batch size B: ``ceil(N / B)`` (the last one may be short).
    Raises ValueError for B < 1 or N < 0."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return -(-num_samples // batch_size)


def batch_aligned_bounds(num_samples: int, batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the samples of ``rank`` when ranks receive whole *global* batches.

    The global batch sequence depends on N and B alone: batch b holds samples ``[bB, min((b+1)B, N))``.
    The ``ceil(N/B)`` batches are split among ranks by ``shard_bounds`` (contiguous blocks, at most one
    batch of imbalance, ranks without a batch when W > ceil(N/B)); a rank's samples are the union of its
    batches. So every sample is forwarded in the same batch, with the same neighbours, at every world size.
    Raises ValueError as ``shard_bounds`` and ``num_batches``.
    """
    first, last = shard_bounds(num_batches(num_samples, batch_size), world_size, rank)
    return min(first * batch_size, num_samples), min(last * batch_size, num_samples)
