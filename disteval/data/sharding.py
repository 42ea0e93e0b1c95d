"""Exact contiguous shards of [0, N): no padding, no dropped samples, uneven sizes, empty shards allowed.

Two splits, both exact (every sample once):

- *batch-aligned* (``batch_size`` given; the default ``eval.mode=bitwise``): ranks receive whole global
  batches (``disteval.common.ranges.batch_aligned_bounds``), so each sample is forwarded in the same batch
  at every world size and a model whose outputs depend on batch composition gives the same bits;
- *sample-even* (``batch_size=None``; ``eval.mode=fast``): shard sizes differ by at most one sample.
"""
from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler, Sampler

from disteval.common.ranges import batch_aligned_bounds, num_batches, shard_bounds

SAMPLERS = ("exact", "padded", "drop_last")

__all__ = ["SAMPLERS", "ExactShardSampler", "batch_aligned_bounds", "build_sampler", "lockstep_plan", "num_batches",
           "sampler_span", "shard_batches", "shard_bounds"]


class ExactShardSampler(Sampler[int]):
    """Yields the indices of this rank's exact shard in order.

    Args:
        num_samples: N, the dataset length.
        world_size, rank: W and this rank (a data-parallel rank under a mesh).
        skip: samples of the shard already counted (resumed from a checkpoint); with ``batch_size`` it must
            be a multiple of it or reach the end of the shard, so that batches stay global batches.
        batch_size: B for batch-aligned shards (``batch_aligned_bounds``), None for sample-even ones
            (``shard_bounds``).

    Unlike ``torch.utils.data.DistributedSampler`` it never pads by repeating samples and never drops
    any, so per-rank batch counts may differ; disteval therefore never issues a per-batch collective.
    ``first_batch`` is the global index of the first batch this sampler yields (batch-aligned only, else
    None). Raises ValueError for a bad skip.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, skip: int = 0, batch_size: int | None = None):
        if batch_size is None:
            self.start, self.end = shard_bounds(num_samples, world_size, rank)
        else:
            self.start, self.end = batch_aligned_bounds(num_samples, batch_size, world_size, rank)
        if not 0 <= skip <= self.end - self.start:
            raise ValueError(f"skip={skip} outside the shard of {self.end - self.start} samples")
        if batch_size is not None and skip % batch_size and self.start + skip != self.end:
            raise ValueError(f"skip={skip} is not a whole number of batches of {batch_size}")
        self.skip = skip
        self.batch_size = batch_size
        self.first_batch = None if batch_size is None else (self.start + skip) // batch_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start + self.skip, self.end))

    def __len__(self) -> int:
        return self.end - self.start - self.skip


def build_sampler(kind: str, num_samples: int, world_size: int, rank: int, skip: int = 0,
                  batch_size: int | None = None) -> Sampler[int]:
    """``exact`` -> ExactShardSampler (batch-aligned when ``batch_size`` is given); ``padded`` / ``drop_last``
    -> torch's ``DistributedSampler(shuffle=False, drop_last=...)``, which repeats the first samples so that
    every rank gets ceil(N/W) of them, or drops the last N % W (kept only to reproduce other tools' biased
    numbers; the coverage check reports the damage).
    Raises ValueError for an unknown kind or a ``skip`` with a non-exact sampler (no resume there)."""
    if kind == "exact":
        return ExactShardSampler(num_samples, world_size, rank, skip=skip, batch_size=batch_size)
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


def shard_batches(num_samples: int, batch_size: int, world_size: int, rank: int, aligned: bool = True) -> int:
    """Loader batches of ``rank``'s exact shard: whole global batches (``aligned``) or ``ceil(shard / B)`` of a
    sample-even shard."""
    if aligned:
        first, last = shard_bounds(num_batches(num_samples, batch_size), world_size, rank)
        return last - first
    start, end = shard_bounds(num_samples, world_size, rank)
    return num_batches(end - start, batch_size)


def lockstep_plan(num_samples: int, batch_size: int, dp_replicate: int, dp_shard: int,
                  aligned: bool = True) -> dict[str, list[int]]:
    """Batches and planned dummy steps of every data-parallel rank under a ``dp_replicate x dp_shard`` mesh.

    The data is split among the ``dp = dp_replicate x dp_shard`` ranks only (exact shards, so counts differ by
    up to one batch). A model sharded over ``dp_shard`` (FSDP) issues collectives in every forward among the
    ``dp_shard`` ranks of one replica group (dp ranks ``r * dp_shard .. (r + 1) * dp_shard - 1``), so a rank
    with fewer batches runs ``max(batches in its group) - batches`` dummy steps (forwards whose outputs are
    discarded) to keep them in lockstep; with ``dp_shard == 1`` no forward has a peer and no dummy step is
    planned. Returns ``{"batches": [dp], "dummy_steps": [dp]}`` indexed by dp rank."""
    dp = dp_replicate * dp_shard
    batches = [shard_batches(num_samples, batch_size, dp, r, aligned) for r in range(dp)]
    return {"batches": batches, "dummy_steps": lockstep_dummy_steps(batches, dp_shard)}


def lockstep_dummy_steps(batches: list[int], dp_shard: int) -> list[int]:
    """The dummy steps of every data-parallel rank (``lockstep_plan``) when dp rank r evaluates ``batches[r]``
    batches (a resumed run: the batches no record covers): ``max(batches in its replica group) - batches[r]``
    with ``dp_shard > 1``, else 0."""
    dummy = []
    for r in range(len(batches)):
        group = batches[(r // dp_shard) * dp_shard:(r // dp_shard + 1) * dp_shard]
        dummy.append(max(group) - batches[r] if dp_shard > 1 else 0)
    return dummy
