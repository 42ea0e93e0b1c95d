"""Exact plan of a streamed shard set: global sample positions ``[0, N)`` -> (dp rank, loader worker) -> ranges
of samples inside shards. Pure arithmetic over the index's per-shard counts; no I/O, no torch.distributed.

Positions follow the shard order, then the tar order inside a shard (the index's ``keys``): position p is
sample ``p - starts[s]`` of the shard s with ``starts[s] <= p < starts[s + 1]``; its id is ``(url, key)``.

A *consumer* is one (rank, worker) pair; ``num_workers=0`` (loading in the rank's main process) is one
consumer per rank. The rank's range comes from the same rule as map-style shards (``disteval.common.ranges``):

- batch-aligned (``batch_size`` given, ``eval.mode=bitwise``): the rank holds whole global batches
  (``batch_aligned_bounds``) and deals them to its workers round-robin: worker k reads the rank's batches
  k, k + K, k + 2K, ... torch's DataLoader asks its workers in the same cycle and delivers their batches in
  request order, so the rank sees its global batches in increasing order (what the order-independent float
  sums, ``disteval.metrics.ordered_sum``, require). Global batch b is positions ``[bB, min((b+1)B, N))`` at
  every W and worker count; a rank's workers differ by at most one batch.
- sample-even (``batch_size=None``, ``fast``): the rank's samples are split among its workers in contiguous
  blocks; any two consumers of the run differ by at most one sample.

A consumer reads its position spans (one contiguous span in fast mode, one per batch when batch-aligned), each
as per-shard sample ranges: a shard is split between consumers by sample range, each reading only its own
ranges and seeking to the index's byte offset of a range's first sample, so every sample's bytes are read
once (without offsets, e.g. remote URLs, a range start is reached by reading the shard's prefix).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from disteval.common.ranges import batch_aligned_bounds, num_batches, shard_bounds

__all__ = ["ConsumerPlan", "ShardRange", "consumer_spans", "locate", "plan_rank", "rank_bounds", "shard_ranges",
           "shard_starts"]


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
    """What consumer (rank, worker) reads: position ``spans`` (half-open, increasing) as ``ranges`` in
    position order. ``done`` positions at the front of the consumer's spans were already evaluated (resume)
    and are left out; ``batch_size`` is B when batch-aligned (batch of position p: ``p // B``), else None."""
    rank: int
    worker: int
    spans: tuple[tuple[int, int], ...]
    done: int
    batch_size: int | None
    ranges: tuple[ShardRange, ...]

    def __len__(self) -> int:
        return sum(b - a for a, b in self.spans)

    @property
    def start(self) -> int:
        """The first position to read (the end of the rank's range when there is none)."""
        return self.spans[0][0] if self.spans else -1


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


def consumer_spans(num_samples: int, world_size: int, rank: int, num_workers: int, worker: int,
                   batch_size: int | None) -> list[tuple[int, int]]:
    """Position spans of consumer (rank, worker) as described in the module docstring (non-empty, increasing).
    ``num_workers`` 0 means one consumer (worker 0). Raises ValueError for bad W, rank, worker or B."""
    k = max(1, num_workers)
    if not 0 <= worker < k:
        raise ValueError(f"worker {worker} outside [0, {k})")
    if batch_size is None:
        start, end = shard_bounds(num_samples, world_size, rank)
        a, b = shard_bounds(end - start, k, worker)
        return [(start + a, start + b)] if b > a else []
    start, end = batch_aligned_bounds(num_samples, batch_size, world_size, rank)
    return [(p, min(p + batch_size, end)) for p in range(start + worker * batch_size, end, k * batch_size)]


def rank_bounds(num_samples: int, world_size: int, rank: int, batch_size: int | None) -> tuple[int, int]:
    """``[start, end)`` of the rank: the union of its consumers' spans."""
    if batch_size is None:
        return shard_bounds(num_samples, world_size, rank)
    return batch_aligned_bounds(num_samples, batch_size, world_size, rank)


def _drop_front(spans: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        cut = min(done, b - a)
        done -= cut
        if a + cut < b:
            out.append((a + cut, b))
    return out


def plan_rank(counts: Sequence[int], world_size: int, rank: int, num_workers: int, batch_size: int | None,
              done: Sequence[int] | None = None) -> list[ConsumerPlan]:
    """The plans of every worker of ``rank`` (``max(1, num_workers)`` of them), from the index's per-shard
    sample counts. ``done[k]``: samples worker k already evaluated (resume; with ``batch_size`` a whole
    number of batches unless it reaches the end of the worker's spans). dp rank and size come from the
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
        spans = consumer_spans(n, world_size, rank, num_workers, w, batch_size)
        total, skip = sum(b - a for a, b in spans), done[w]
        if not 0 <= skip <= total:
            raise ValueError(f"worker {w}: done={skip} outside its {total} samples")
        if batch_size is not None and skip % batch_size and skip != total:
            raise ValueError(f"worker {w}: done={skip} is not a whole number of batches of {batch_size}")
        spans = _drop_front(spans, skip)
        ranges = tuple(r for a, b in spans for r in shard_ranges(starts, a, b))
        plans.append(ConsumerPlan(rank, w, tuple(spans), skip, batch_size, ranges))
    return plans
