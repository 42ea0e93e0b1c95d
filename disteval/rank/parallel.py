"""A rank's part in a model-parallel evaluation (``dist.parallel``): the device mesh and its communicators,
the model split by its architecture's plan, the lockstep plan (dummy steps) and the record for results.json.

The rules (docs/model-parallel.md):
- the data is split over the data-parallel ranks only (``dp = dp_replicate x dp_shard``); the ``tp`` ranks of
  one TP group receive the same exact shard, batch for batch;
- a rank whose shard has fewer batches than the others of its ``dp_shard`` group runs the planned number of
  dummy steps (``disteval.data.sharding.lockstep_plan``), forwards whose outputs are discarded, so that every
  FSDP collective has all its ranks; tensor-parallel peers hold equal batch counts by construction;
- each TP rank synchronises the metric states of its own data-parallel group, once; before that the TP peers'
  sample-id and state digests are compared (``disteval.rank.sync.check_tp_peers``): all TP ranks hold the same
  numbers, and global rank 0 (dp rank 0, tp rank 0) reports them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import default_collate

from disteval.comm import Communicator
from disteval.comm.mesh import MeshGroups, ParallelDims, apply_parallelism, build_mesh, load_full_state_dict
from disteval.config import ParallelConfig
from disteval.data.sharding import lockstep_dummy_steps, lockstep_plan
from disteval.errors import ConfigError, DistevalError
from disteval.models.parallel_plans import plan_for, tp_problems

__all__ = ["MeshRun", "dims_from_config", "first_inputs", "parallel_model"]


def dims_from_config(cfg: Any, world_size: int) -> ParallelDims | None:
    """``dist.parallel`` as ParallelDims for ``world_size`` ranks (``ParallelConfig.degrees``: both data-parallel
    degrees null -> dp_replicate = world_size / tp), or None when no degree is set (no mesh: plain data
    parallelism)."""
    node: ParallelConfig = cfg.dist.parallel
    return ParallelDims(*node.degrees(world_size)) if node.enabled else None


def parallel_model(model: nn.Module, groups: MeshGroups) -> nn.Module:
    """Split ``model`` (built in full, weights loaded, on every rank) by its architecture's plan over
    ``groups``: the plan's ``prepare`` when tp > 1, tensor parallelism over ``tp``, FSDP2 over ``dp_shard``,
    then rank 0's full state dict loaded into the shards (``load_full_state_dict``, broadcast from rank 0), so
    that every rank holds rank 0's weights. A model without a plan can still be FSDP-sharded (as one unit).
    Returns the model. Raises DistevalError naming the architecture when it cannot be split ``tp`` ways."""
    dims = groups.dims
    if dims.tp == 1 and dims.dp_shard == 1:
        return model
    plan = plan_for(model)
    if dims.tp > 1:
        problems = tp_problems(model, dims.tp)
        if problems:
            raise DistevalError(f"dist.parallel.tp={dims.tp}: {'; '.join(problems)}")
        if plan.prepare is not None:
            plan.prepare(model)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()} if groups.rank == 0 else None
    apply_parallelism(model, groups, plan.tp_layers if plan else {}, plan.fsdp_units if plan else ())
    load_full_state_dict(model, full)
    return model


def first_inputs(dataset: Any, collate: Callable | None) -> Callable[[], Any]:
    """``() -> inputs`` of a batch of one sample (the dataset's item 0, collated): the input of a dummy step."""
    def make():
        batch = (collate or default_collate)([dataset[0]])
        return batch[0]
    return make


class MeshRun:
    """This rank's mesh: ``groups`` (coordinates and process groups), ``dp_comm`` (the metric sync's
    Communicator over the data-parallel group) and ``tp_comm`` (the TP peers' check).

    Args: ctx: the RankContext (config, rank, device, the default Communicator's settings). Raises
    ConfigError naming ``dist.parallel`` when the degrees do not multiply to the world size."""

    def __init__(self, ctx: Any):
        self.dims = dims_from_config(ctx.cfg, ctx.world_size)
        try:
            self.dims.validate(ctx.world_size)
        except ValueError as exc:
            raise ConfigError("dist.parallel", str(exc)) from None
        self.groups = build_mesh(self.dims, ctx.device.type)
        base = ctx.comm
        settings = dict(async_threshold_bytes=base.async_threshold_bytes, chunk_bytes=base.chunk_bytes,
                        max_in_flight=base.max_in_flight, on_collective=base.on_collective)
        self.dp_comm = Communicator(base.device, group=self.groups.dp_group, **settings)
        self.tp_comm = Communicator(base.device, group=self.groups.tp_group, **settings)
        for sub in (self.dp_comm, self.tp_comm):  # the same status records as the default group's
            sub.on_complete, sub.on_progress, sub.timeout_s = base.on_complete, base.on_progress, base.timeout_s
            sub.progress_bytes = base.progress_bytes
        self.plan: dict | None = None
        self.tp_check: dict | None = None

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        return self.groups.dp_size

    def lockstep(self, num_samples: int, batch_size: int, aligned: bool) -> int:
        """Compute the lockstep plan of every dp rank (kept in ``self.plan``); returns this rank's dummy steps."""
        self.plan = lockstep_plan(num_samples, batch_size, self.dims.dp_replicate, self.dims.dp_shard, aligned)
        return self.plan["dummy_steps"][self.dp_rank]

    def relockstep(self, batches: int) -> int:
        """A resumed run (``eval.resume``): this dp rank evaluates ``batches`` batches (those no record covers);
        gathers every dp rank's count over the data-parallel group (a collective under the communication
        timeout), keeps the new plan and returns this rank's dummy steps."""
        counts = self.dp_comm.all_gather_sized(torch.tensor([int(batches)], dtype=torch.int64), [1] * self.dp_size)
        got = [int(c[0]) for c in counts]
        self.plan = {"batches": got, "dummy_steps": lockstep_dummy_steps(got, self.dims.dp_shard)}
        return self.plan["dummy_steps"][self.dp_rank]

    def row(self, progress: Any) -> dict:
        """This rank's mesh fields of its per-rank row: dp/tp rank, dummy steps planned and run."""
        return {"dp_rank": self.dp_rank, "tp_rank": self.groups.tp_rank, "dummy_steps": progress.dummy_steps,
                "dummy_steps_planned": progress.dummy_planned}

    def record(self) -> dict:
        """results.json ``parallel``: the degrees, the mesh's dim names, the lockstep plan per dp rank, how the
        metrics were synchronised, and rank 0's TP check (digests)."""
        d = self.dims
        return {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "dp_size": d.dp_size,
                "mesh_dim_names": list(self.groups.mesh.mesh_dim_names),
                "batches_per_dp_rank": self.plan["batches"] if self.plan else None,
                "dummy_steps_per_dp_rank": self.plan["dummy_steps"] if self.plan else None,
                "metric_sync": "once per tensor-parallel rank over its data-parallel group; TP peers' sample-id and "
                               "metric-state digests checked equal first; rank 0's group reported",
                "tp_check": self.tp_check, "comm": {"dp": self.dp_comm.stats(), "tp": self.tp_comm.stats()}}

    def comm_stats(self, base: Communicator) -> dict:
        """results.json ``comm``: the default group's Communicator ``base`` plus the dp and tp ones, summed
        (collectives, bytes, by_op, chunked; compression records of all three)."""
        parts = [c.stats() for c in (base, self.dp_comm, self.tp_comm)]
        by_op: dict[str, int] = {}
        for p in parts:
            for op, k in p["by_op"].items():
                by_op[op] = by_op.get(op, 0) + k
        return {"collectives": sum(p["collectives"] for p in parts), "bytes": sum(p["bytes"] for p in parts),
                "by_op": by_op, "chunked": sum(p["chunked"] for p in parts),
                "compression": {k: v for p in parts for k, v in p["compression"].items()}}

    def status_record(self) -> dict:
        """status.json ``parallel`` (written before the loop, read by the doctor): degrees, this rank's
        coordinates and TP peers, and the lockstep plan."""
        return {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard, "tp": self.dims.tp,
                "dp_rank": self.dp_rank, "tp_rank": self.groups.tp_rank, "tp_peers": self.groups.tp_peers,
                "batches_planned": self.plan["batches"][self.dp_rank] if self.plan else None,
                "dummy_steps_planned": self.plan["dummy_steps"][self.dp_rank] if self.plan else None,
                "model_collectives": self.dims.tp > 1 or self.dims.dp_shard > 1}
