"""The streamed-shard planner, exhaustively on small cases: every position exactly once, imbalance bounds,
no shard read twice in full, global batches independent of W and worker count, resume offsets."""
from __future__ import annotations

import itertools

import pytest

from disteval.data.stream_plan import locate, rank_bounds, worker_spans, plan_rank, shard_ranges, shard_starts

COUNT_SETS = [[], [0], [5], [0, 3, 0, 1], [3, 0, 7, 2, 1], [1] * 6, [11, 0, 0, 4], [2, 9, 0, 5, 3, 1]]


def all_plans(counts, world_size, num_workers, batch_size):
    return [p for r in range(world_size) for p in plan_rank(counts, world_size, r, num_workers, batch_size)]


def positions_read(counts, plans):
    """Positions recomputed from the shard ranges alone (shard starts summed by hand, not by the planner), in
    the order the consumers read them (rank by rank, worker by worker)."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [starts[r.shard] + i for p in plans for r in p.ranges for i in range(r.first, r.stop)]


def _delivery_order(plans, b: int) -> list[int]:
    """The global batch indices one rank receives, in order, from its workers' batch-aligned plans: torch's
    DataLoader asks workers 0, 1, .., K-1, 0, .. (skipping exhausted ones) and delivers in request order."""
    queues = [[a // b for a, _ in p.spans] for p in plans]
    delivered = []
    while any(queues):
        for q in queues:
            if q:
                delivered.append(q.pop(0))
    return delivered


@pytest.mark.parametrize("counts", COUNT_SETS)
def test_every_position_exactly_once_in_order(counts):
    n = sum(counts)
    for w, k, b in itertools.product(range(1, 6), range(0, 4), (None, 1, 2, 3, 4)):
        plans = all_plans(counts, w, k, b)
        assert len(plans) == w * max(1, k)
        assert sorted(positions_read(counts, plans)) == list(range(n)), (w, k, b)
        for p in plans:
            assert sum(len(r) for r in p.ranges) == len(p) == sum(e - a for a, e in p.spans)
            read = positions_read(counts, [p])
            assert read == sorted(read)
            assert all(counts[r.shard] > 0 and 0 <= r.first < r.stop <= counts[r.shard] for r in p.ranges)


@pytest.mark.parametrize("counts", COUNT_SETS)
def test_imbalance(counts):
    n = sum(counts)
    for w, k in itertools.product(range(1, 6), range(0, 4)):
        sizes = [len(p) for p in all_plans(counts, w, k, None)]
        assert max(sizes) - min(sizes) <= 1, (w, k, sizes)
        for b in (1, 2, 3):  # batch-aligned: at most one batch between any two workers of a rank
            for r in range(w):
                nb = [-(-len(p) // b) for p in plan_rank(counts, w, r, k, b)]
                assert max(nb) - min(nb) <= 1
        assert n == sum(sizes)


@pytest.mark.parametrize("counts", COUNT_SETS)
def test_no_shard_read_twice(counts):
    """Each (shard, sample) is in exactly one range of one consumer; sample-even plans, and batch-aligned ones
    with one worker per rank, split a shard only at consumer boundaries (one range per consumer and shard)."""
    for w, k, b in itertools.product(range(1, 6), range(0, 4), (None, 2)):
        seen = {}
        for p in all_plans(counts, w, k, b):
            shards = [r.shard for r in p.ranges]
            if b is None or k <= 1:  # one contiguous range per consumer: a shard at most once
                assert len(shards) == len(set(shards))
            for r in p.ranges:
                for i in range(r.first, r.stop):
                    assert (r.shard, i) not in seen
                    seen[(r.shard, i)] = p
        assert len(seen) == sum(counts)


@pytest.mark.parametrize("counts", COUNT_SETS)
def test_global_batches_do_not_depend_on_world_or_workers(counts):
    """Batch-aligned: every consumer starts on a global batch boundary and its range is a union of whole
    global batches [bB, min((b+1)B, N)), so chunking each consumer's stream by B gives the same batches."""
    n = sum(counts)
    for b in (1, 2, 3, 4):
        expected = {tuple(range(i, min(i + b, n))) for i in range(0, n, b)}
        for w, k in itertools.product(range(1, 6), range(0, 4)):
            got = set()
            for r in range(w):
                plans = plan_rank(counts, w, r, k, b)
                for p in plans:
                    assert all(a % b == 0 and (e - a == b or e == n) for a, e in p.spans)
                    got |= {tuple(range(a, e)) for a, e in p.spans}
                # the rank must see its batches in increasing global order
                delivered = _delivery_order(plans, b)
                assert delivered == sorted(delivered), (w, k, b, delivered)
            assert got == expected, (w, k, b)


def test_locate_and_ranges():
    starts = shard_starts([3, 0, 2])
    assert starts == [0, 3, 3, 5]
    assert [locate(starts, p) for p in range(5)] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    with pytest.raises(IndexError):
        locate(starts, 5)
    assert [(r.shard, r.first, r.stop, r.position) for r in shard_ranges(starts, 1, 4)] == [(0, 1, 3, 1), (2, 0, 1, 3)]


def test_resume_skips_done_batches():
    counts = [5, 0, 7, 3]
    full = plan_rank(counts, 2, 1, 2, 2)  # rank 1 holds batches 4..7: positions 8..15
    assert [p.spans for p in full] == [((8, 10), (12, 14)), ((10, 12), (14, 15))]
    resumed = plan_rank(counts, 2, 1, 2, 2, resume=2)  # batch 4 done: batches 5..7 dealt again from worker 0
    assert [p.spans for p in resumed] == [((10, 12), (14, 15)), ((12, 14),)] and resumed[0].done == 2
    assert sorted(positions_read(counts, resumed)) == list(range(10, 15))
    assert plan_rank(counts, 2, 1, 2, 2, resume=7)[0].spans == ()
    fast = plan_rank(counts, 2, 0, 0, None, resume=3)
    assert fast[0].spans == ((3, 8),) and plan_rank(counts, 2, 0, 0, None)[0].spans == ((0, 8),)
    with pytest.raises(ValueError, match="whole number of batches"):
        plan_rank(counts, 2, 1, 2, 2, resume=1)
    with pytest.raises(ValueError, match="several workers"):
        plan_rank(counts, 2, 0, 2, None, resume=2)
    with pytest.raises(ValueError, match="outside"):
        plan_rank(counts, 2, 1, 2, 2, resume=8)


def test_bad_arguments():
    with pytest.raises(ValueError):
        rank_bounds(10, 2, 2, None)
    with pytest.raises(ValueError):
        worker_spans(0, 5, 2, 2, None)
    with pytest.raises(ValueError):
        shard_starts([1, -1])


@pytest.mark.parametrize("counts", COUNT_SETS)
def test_resumed_plans_cover_the_rest_in_delivery_order(counts):
    """After m of the rank's batches (delivered in increasing order), the resumed plans hold exactly the
    rank's remaining positions and the DataLoader's worker cycle still delivers them in increasing order."""
    for w, k, b in itertools.product(range(1, 4), range(0, 4), (1, 3)):
        for r in range(w):
            full = sorted(positions_read(counts, plan_rank(counts, w, r, k, b)))
            for m in range(0, len(full) + 1, b):
                plans = plan_rank(counts, w, r, k, b, resume=m)
                assert sorted(positions_read(counts, plans)) == full[m:]
                delivered = _delivery_order(plans, b)
                assert delivered == sorted(delivered)
