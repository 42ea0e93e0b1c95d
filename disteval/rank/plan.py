"""A rank's run plan, pure and process-free: which samples a data-parallel rank evaluates, in which batches,
and whether its progress can be checkpointed and resumed. Computed from numbers alone (no process group, no
dataset), so the plan of every rank of any world size can be read and tested without starting one
(``RunPlan.for_all_ranks``); the engine builds its own with ``RunPlan.of``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from disteval.common.ranges import batch_aligned_bounds, shard_bounds


@dataclass(frozen=True)
class RunPlan:
    """The plan of data-parallel rank ``dp_rank`` of ``dp_size`` over ``num_samples`` samples (a map-style
    dataset's length, or a streamed one's planned count).

    ``bitwise``: ``eval.mode=bitwise``; ranks then receive whole global batches of ``batch_size`` (every sample
    in the same batch at every world size, ``batch_aligned_bounds``), else contiguous shards whose sizes differ
    by at most one (``shard_bounds``). ``sampler``: ``data.sampler`` (``exact`` or a sampler that pads or drops).
    ``trials``: ``eval.trials``. ``streamed``: tar shards planned per rank (``Task.streamed``). ``num_workers``:
    ``data.num_workers``. ``meshed``: the rank is part of a ``dist.parallel`` device mesh.
    Raises ValueError (from the range functions) for a negative count, a batch size < 1 or a rank outside
    [0, dp_size)."""
    num_samples: int
    batch_size: int
    dp_rank: int
    dp_size: int
    bitwise: bool = False
    sampler: str = "exact"
    trials: int = 1
    streamed: bool = False
    num_workers: int = 0
    meshed: bool = False

    def __post_init__(self) -> None:
        self.shard  # noqa: B018 - the ranges raise ValueError on impossible numbers, at construction

    @classmethod
    def of(cls, cfg: Any, num_samples: int, dp_rank: int, dp_size: int, streamed: bool, meshed: bool) -> "RunPlan":
        """The plan of a job config (``data.batch_size``, ``data.sampler``, ``data.num_workers``, ``eval.mode``,
        ``eval.trials``) for one data-parallel rank."""
        return cls(int(num_samples), int(cfg.data.batch_size), int(dp_rank), int(dp_size),
                   bitwise=str(cfg.eval.mode) == "bitwise", sampler=str(cfg.data.sampler),
                   trials=int(cfg.eval.trials), streamed=bool(streamed), num_workers=int(cfg.data.num_workers),
                   meshed=bool(meshed))

    def for_all_ranks(self) -> list["RunPlan"]:
        """The plans of data-parallel ranks 0..dp_size-1 of the same job."""
        return [replace(self, dp_rank=r) for r in range(self.dp_size)]

    @property
    def shard(self) -> tuple[int, int]:
        """``[start, end)`` of this rank's samples; the shards of ranks 0..dp_size-1 concatenate to
        [0, num_samples)."""
        if self.bitwise:
            return batch_aligned_bounds(self.num_samples, self.batch_size, self.dp_size, self.dp_rank)
        return shard_bounds(self.num_samples, self.dp_size, self.dp_rank)

    @property
    def batches(self) -> list[tuple[int, int]]:
        """The batch grid of this rank's shard: ``[start, end)`` of each batch, in order (the last may be short;
        in bitwise mode they are the global batches, so the grid is the same at every world size)."""
        start, end = self.shard
        return [(s, min(s + self.batch_size, end)) for s in range(start, end, self.batch_size)]

    @property
    def resumable(self) -> bool:
        """Whether a preempted rank can resume from a checkpoint of its progress: one trial over one exact shard
        (a checkpoint holds one pass), not a streamed shard read by several loader workers in fast mode (their
        positions are not one count per rank), not under a device mesh (a resumed rank would skip batches its
        FSDP/TP peers still run)."""
        fast_multi_worker_stream = self.streamed and not self.bitwise and self.num_workers > 1
        return self.trials == 1 and self.sampler == "exact" and not fast_multi_worker_stream and not self.meshed

    def checkpoint_key(self, config_digest: str, world_size: int, rank: int, job_id: str | None) -> dict:
        """What a checkpoint must match to be resumed from (``disteval.rank.resume.load_checkpoint``): the
        config's digest, world size, rank, shard and the scheduler's job id (a requeued job keeps it)."""
        return {"config": config_digest, "world_size": int(world_size), "rank": int(rank), "shard": list(self.shard),
                "job": job_id}
