"""The device mesh of a model-parallel evaluation: ``dp_replicate x dp_shard x tp`` ranks with named
dimensions (``torch.distributed.device_mesh.init_device_mesh``), its data-parallel and tensor-parallel process
groups, and the application of a parallel plan to a model (FSDP2 ``fully_shard`` over ``dp_shard``,
``parallelize_module`` over ``tp``) and of a full state dict to the sharded model
(``torch.distributed.checkpoint.state_dict.set_model_state_dict``).

Rank layout (row-major, ``tp`` innermost, as torchtitan's ``ParallelDims``): global rank
``g = (r_rep * dp_shard + r_shard) * tp + r_tp``; the data-parallel rank is ``r_rep * dp_shard + r_shard``
(``dp`` = the flattened ``dp_replicate x dp_shard`` dimensions), so TP peers are consecutive ranks and global
rank 0 is data-parallel rank 0 and TP rank 0. Knows nothing of data or metrics: plans arrive as plain dicts.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DIM_NAMES", "MeshGroups", "ParallelDims", "apply_parallelism", "build_mesh", "load_full_state_dict"]

DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh dimensions (each >= 1); their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ``dp_replicate x dp_shard`` (the data is split among these only)."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} = {self.world_size}"

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of global ``rank`` (see the module's rank layout)."""
        return rank // self.tp, rank % self.tp

    def tp_peers(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s tensor-parallel group (itself included), ascending."""
        first = rank - rank % self.tp
        return list(range(first, first + self.tp))

    def validate(self, world_size: int) -> None:
        """Raises ValueError naming the values when a degree is < 1 or the product is not ``world_size``."""
        for name in DIM_NAMES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size != world_size:
            raise ValueError(f"{self.describe()} ranks, but the world size is {world_size}: the product of the "
                             "degrees must equal the number of ranks")


@dataclass
class MeshGroups:
    """A built mesh as this rank sees it: the DeviceMesh (dims ``DIM_NAMES``), its coordinates, and the
    process groups of its data-parallel dimension (all ranks with this TP rank) and of its TP group."""

    dims: ParallelDims
    mesh: object
    rank: int
    dp_rank: int
    tp_rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def tp_peers(self) -> list[int]:
        return self.dims.tp_peers(self.rank)


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> MeshGroups:
    """``init_device_mesh(device_type, (dp_replicate, dp_shard, tp))`` with dims ``DIM_NAMES`` plus the
    flattened data-parallel dim ``dp``. Every rank of the default group must call it (it creates sub-groups).
    Raises ValueError (``ParallelDims.validate``) when the degrees do not multiply to the world size."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    dims.validate(dist.get_world_size())
    mesh = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=DIM_NAMES)
    # the flattened data-parallel dim: DeviceMesh._flatten is private but the way torchtitan builds its "dp" mesh
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    dp_rank, tp_rank = dims.coordinates(rank)
    if (dp_mesh.get_local_rank(), mesh["tp"].get_local_rank()) != (dp_rank, tp_rank):
        raise RuntimeError(f"rank {rank}: device mesh coordinates {(dp_mesh.get_local_rank(), mesh['tp'].get_local_rank())}"
                           f" differ from the documented layout {(dp_rank, tp_rank)}")
    return MeshGroups(dims, mesh, rank, dp_rank, tp_rank, dp_mesh.get_group(), mesh["tp"].get_group())


def _matching(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)
            and name.count(".") == pattern.count(".")]


def apply_parallelism(model: nn.Module, groups: MeshGroups, tp_layers: dict[str, str],
                      fsdp_units: tuple[str, ...]) -> nn.Module:
    """Split ``model`` in place over ``groups.mesh``: with tp > 1, ``parallelize_module`` over the ``tp`` dim
    with ``tp_layers`` ({module name pattern: "colwise" | "rowwise"}; outputs of row-wise layers are replicated
    plain tensors); with dp_shard > 1, ``fully_shard`` over the ``dp_shard`` dim on each module matching
    ``fsdp_units`` and then on the root. Returns the model. Raises ValueError for an unknown style or a
    pattern that matches no module."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    dims = groups.dims
    if dims.tp > 1:
        plan = {}
        for pattern, style in tp_layers.items():
            if style not in styles:
                raise ValueError(f"tensor-parallel style {style!r} of {pattern!r} is not one of {sorted(styles)}")
            if not _matching(model, pattern):
                raise ValueError(f"tensor-parallel plan: {pattern!r} matches no module of {type(model).__name__}")
            plan[pattern] = styles[style]()
        parallelize_module(model, groups.mesh["tp"], plan)
    if dims.dp_shard > 1:
        for pattern in fsdp_units:
            names = _matching(model, pattern)
            if not names:
                raise ValueError(f"FSDP units: {pattern!r} matches no module of {type(model).__name__}")
            for name in names:
                fully_shard(model.get_submodule(name), mesh=groups.mesh["dp_shard"])
        fully_shard(model, mesh=groups.mesh["dp_shard"])
    return model


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Load a full (unsharded) state dict into a sharded ``model``: ``set_model_state_dict`` with
    ``full_state_dict=True, broadcast_from_rank0=True`` (rank 0 passes the dict, read with weights_only by the
    caller; other ranks pass None and receive each tensor by broadcast, then keep their shard). Every rank of
    the default group calls it. Raises RuntimeError for missing or unexpected keys (strict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, state if dist.get_rank() == 0 else {}, options=options)
