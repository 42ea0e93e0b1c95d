"""Exact plan of a streamed shard set: global sample positions ``[0, N)`` -> (dp rank, loader worker) -> ranges
of samples inside shards. Pure arithmetic over the index's per-shard counts; no I/O, no torch.distributed.

Positions follow the shard order, then the tar order inside a shard (the index's ``keys``): position p is
sample ``p - starts[s]`` of the shard s with ``starts[s] <= p < starts[s + 1]``; its id is ``(url, key)``.

A *consumer* is one (rank, worker) pair; ``num_workers=0`` (loading in the rank's main process) is one
consumer per rank. The rank's range comes from the same rule as map-style shards (``disteval.common.ranges``):

- batch-aligned (``batch_size`` given, ``eval.mode=bitwise``): the rank holds whole global batches
  (``batch_aligned_bounds``) and its batches are split among its workers in contiguous blocks
  (``shard_bounds`` over batches). Global batch b is positions ``[bB, min((b+1)B, N))`` at every W and
  worker count; consumers differ by at most one batch.
- sample-even (``batch_size=None``, ``fast``): the rank's samples are split among its workers in contiguous
  blocks; any two consumers of the run differ by at most one sample.

Each consumer reads one contiguous position range, so a shard is read by at most the consumers whose ranges
touch it, each reading only its own sample range (seeking to the index's byte offset where it has one): no
shard is read twice in full.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from disteval.common.ranges import batch_aligned_bounds, num_batches, shard_bounds

__all__ = ["ConsumerPlan", "ShardRange", "consumer_bounds", "locate", "plan_rank", "shard_ranges", "shard_starts"]


@dataclass(frozen=True)
class ShardRange:
    """Samples ``[first, stop)`` (local indices, tar order) of shard ``shard`` (index into the shard list);
    ``position`` is the global position of sample ``first``."""
    shard: int
    first: int
    stop: int
    position: int

    def __len__(self) -> int:
        return self.stop - self.first


@dataclass(frozen=True)
class ConsumerPlan:
    """What consumer (rank, worker) reads: positions ``[start, end)`` as ``ranges`` in position order.
    ``done`` positions at the front of the original range were already evaluated (resume) and are not in
    ``start..end``; ``first_batch`` is the global batch index of ``start`` when batch-aligned, else None."""
    rank: int
    worker: int
    start: int
    end: int
    done: int
    first_batch: int | None
    ranges: tuple[ShardRange, ...]

    def __len__(self) -> int:
        return self.end - self.start


def shard_starts(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0+c1, ..., N]``: the global position of each shard's first sample, then N.
    Raises ValueError for a negative count."""
    if any(c < 0 for c in counts):
        raise ValueError(f"negative shard sample count in {list(counts)}")
    return [0, *accumulate(counts)]


def locate(starts: Sequence[int], position: int) -> tuple[int, int]:
    """``(shard, local index)`` of a global position (empty shards are never returned).
    Raises IndexError outside ``[0, N)``."""
    if not 0 <= position < starts[-1]:
        raise IndexError(f"position {position} outside [0, {starts[-1]})")
    s = bisect.bisect_right(starts, position) - 1
    return s, position - starts[s]


def shard_ranges(starts: Sequence[int], start: int, end: int) -> tuple[ShardRange, ...]:
    """The non-empty per-shard pieces of positions ``[start, end)``, in order (empty shards never appear)."""
    out = []
    p = start
    while p < end:
        s, local = locate(starts, p)
        stop = min(starts[s + 1], end) - starts[s]
        out.append(ShardRange(s, local, stop, p))
        p = starts[s] + stop
    return tuple(out)


def consumer_bounds(num_samples: int, world_size: int, rank: int, num_workers: int, worker: int,
                    batch_size: int | None) -> tuple[int, int]:
    """``[start, end)`` positions of consumer (rank, worker) as described in the module docstring.
    ``num_workers`` 0 means one consumer (worker 0). Raises ValueError for bad W, rank, worker or B."""
    k = max(1, num_workers)
    if not 0 <= worker < k:
        raise ValueError(f"worker {worker} outside [0, {k})")
    if batch_size is None:
        start, end = shard_bounds(num_samples, world_size, rank)
        a, b = shard_bounds(end - start, k, worker)
        return start + a, start + b
    start, end = batch_aligned_bounds(num_samples, batch_size, world_size, rank)
    a, b = shard_bounds(num_batches(end - start, batch_size), k, worker)
    return min(start + a * batch_size, end), min(start + b * batch_size, end)


def plan_rank(counts: Sequence[int], world_size: int, rank: int, num_workers: int, batch_size: int | None,
              done: Sequence[int] | None = None) -> list[ConsumerPlan]:
    """The plans of every worker of ``rank`` (``max(1, num_workers)`` of them), from the index's per-shard
    sample counts. ``done[k]``: samples worker k already evaluated (resume; with ``batch_size`` a whole
    number of batches unless it reaches the end of the worker's range). dp rank and size come from the
    caller (the engine), never from environment variables. Raises ValueError for a bad ``done``."""
    starts = shard_starts(counts)
    n = starts[-1]
    k = max(1, num_workers)
    done = list(done) if done is not None else [0] * k
    if len(done) != k:
        raise ValueError(f"resume state has {len(done)} workers, the loader has {k} (data.num_workers must "
                         "not change across a resume)")
    plans = []
    for w in range(k):
        start, end = consumer_bounds(n, world_size, rank, num_workers, w, batch_size)
        skip = done[w]
        if not 0 <= skip <= end - start:
            raise ValueError(f"worker {w}: done={skip} outside its {end - start} samples")
        if batch_size is not None and skip % batch_size and start + skip != end:
            raise ValueError(f"worker {w}: done={skip} is not a whole number of batches of {batch_size}")
        first_batch = None if batch_size is None else (start + skip) // batch_size
        plans.append(ConsumerPlan(rank, w, start + skip, end, skip, first_batch,
                                  shard_ranges(starts, start + skip, end)))
    return plans
