"""Process-group set-up: rank environment, backend choice, timeouts. The only place that calls
``torch.distributed.init_process_group``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits: global rank, world size, local rank on its node."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> "RankEnv":
        """Read torchrun's / torch.distributed.elastic's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK)."""
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def external_launch_detected() -> bool:
    """True when this process was started by an external launcher (torchrun, srun) that set the
    env:// variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    return all(k in os.environ for k in ENV_KEYS)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    device = str(getattr(device, "value", device))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> nccl for CUDA devices, gloo otherwise. Raises ValueError for nccl on a CPU device."""
    backend = str(getattr(backend, "value", backend))
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("communication.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    return backend


def init_process_group(backend: str, timeout_s: float, env: RankEnv | None) -> RankEnv:
    """Initialise the default process group with ``timeout_s`` seconds as the timeout of every collective.

    ``env=None`` means a single process without a launcher: a world of size 1 over an in-memory store.
    With nccl the process is bound to ``cuda:LOCAL_RANK`` (modulo the visible devices) first and that device
    is passed as ``device_id``. Returns the RankEnv in force.
    """
    timeout = timedelta(seconds=float(timeout_s))
    if env is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return RankEnv(0, 1, 0)
    options = {}
    if backend == "nccl":  # bind the rank to its device before the group exists, and tell NCCL which it is
        device = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        options["device_id"] = device  # eager NCCL communicator on this device (no guessing from the rank)
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **options)
    return env


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
