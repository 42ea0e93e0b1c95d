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

from disteval.common.ranges import batch_aligned_bounds, shard_bounds

__all__ = ["ConsumerPlan", "ShardRange", "worker_spans", "locate", "plan_rank", "rank_bounds", "shard_ranges",
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
    position order. ``done``: samples of the rank evaluated before a resume (left out of every consumer's
    spans); ``batch_size`` is B when batch-aligned (batch of position p: ``p // B``), else None; ``given``: the
    spans are the batches a resume evaluates (``plan_rank``'s ``batches``), each read as one batch."""
    rank: int
    worker: int
    spans: tuple[tuple[int, int], ...]
    done: int
    batch_size: int | None
    ranges: tuple[ShardRange, ...]
    given: bool = False  # spans given as whole batches (a resume around recorded windows): each span one batch

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


def worker_spans(start: int, end: int, num_workers: int, worker: int, batch_size: int | None,
                 done: int = 0) -> list[tuple[int, int]]:
    """Position spans (non-empty, increasing) of loader worker ``worker`` of a rank holding ``[start, end)``
    (``rank_bounds``), as described in the module docstring, after the rank's first ``done`` samples
    (resume: batch-aligned, the remaining batches are dealt round-robin from worker 0 again, so that they
    still arrive in increasing order; sample-even, only with one worker). ``num_workers`` 0 means one
    consumer (worker 0). Raises ValueError for a bad worker, B or ``done``."""
    k = max(1, num_workers)
    if not 0 <= worker < k:
        raise ValueError(f"worker {worker} outside [0, {k})")
    if not 0 <= done <= end - start:
        raise ValueError(f"done={done} outside the rank's {end - start} samples")
    if batch_size is None:
        if done and k > 1:
            raise ValueError("a sample-even plan with several workers cannot resume from one count per rank")
        a, b = shard_bounds(end - start, k, worker)
        a, b = start + max(a, done), start + b
        return [(a, b)] if b > a else []
    if done % batch_size and start + done != end:
        raise ValueError(f"done={done} is not a whole number of batches of {batch_size}")
    first = start + done
    return [(p, min(p + batch_size, end)) for p in range(first + worker * batch_size, end, k * batch_size)]


def rank_bounds(num_samples: int, world_size: int, rank: int, batch_size: int | None) -> tuple[int, int]:
    """``[start, end)`` of the rank: the union of its consumers' spans. Raises ValueError for a bad W, rank
    or B."""
    if batch_size is None:
        return shard_bounds(num_samples, world_size, rank)
    return batch_aligned_bounds(num_samples, batch_size, world_size, rank)


def _merge(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans joined (one worker's consecutive batches are read as one range: one open, one seek)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def plan_rank(counts: Sequence[int], world_size: int, rank: int, num_workers: int, batch_size: int | None,
              resume: int | Sequence[tuple[int, int]] = 0) -> list[ConsumerPlan]:
    """The plans of every worker of ``rank`` (``max(1, num_workers)`` of them), from the index's per-shard
    sample counts. ``resume``, an int: samples of the rank already evaluated, a prefix in delivery order (the
    checkpoint's one count per rank; see ``worker_spans``); a list: only these position spans, increasing,
    inside the rank's range, each one batch (a resume around recorded windows, ``disteval.rank.journal``), dealt
    to the workers round-robin from worker 0 (so they arrive in increasing order). dp rank and size come from
    the caller (the engine), never from environment variables. Raises ValueError for a bad count or a span
    outside the rank's range."""
    done, batches = (int(resume), None) if isinstance(resume, int) else (0, list(resume))
    starts = shard_starts(counts)
    start, end = rank_bounds(starts[-1], world_size, rank, batch_size)
    k = max(1, num_workers)
    if batches is not None:
        bad = [(a, b) for a, b in batches if not start <= a < b <= end]
        if bad:
            raise ValueError(f"batches {bad[:3]} are not inside the rank's positions [{start}, {end})")
    plans = []
    for w in range(k):
        spans = worker_spans(start, end, num_workers, w, batch_size, done) if batches is None else \
            [tuple(x) for x in batches[w::k]]
        ranges = tuple(r for a, b in _merge(spans) for r in shard_ranges(starts, a, b))
        plans.append(ConsumerPlan(rank, w, tuple(spans), done, batch_size, ranges, given=batches is not None))
    return plans
