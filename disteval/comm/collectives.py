"""Pickle-free collectives with accounting: every collective of disteval goes through ``Communicator``,
runs under the process group's timeout, and is counted (number and bytes sent by this rank).

- ``all_reduce_coalesced``: all sum-states of one dtype flattened into one buffer, one all_reduce per dtype.
- ``all_gather_variable``: tensors whose first dimension differs between ranks: exchange metadata
  (rows, dtype, trailing shape) in one all_gather, pad, one all_gather, trim. A dtype or trailing-shape
  mismatch raises the same ValueError on every rank (all see the same metadata) instead of hanging.
- ``all_gather_sized``: the same without the metadata round when the sizes are already known.
- ``gather_variable(dst=r)``: the same to one rank only (``gather``).
- ``broadcast_bytes`` / ``broadcast_json``: bytes or a JSON dict from one rank to all (length, then
  payload), e.g. the run directory and run metadata.
- ``set_timeout``: a different timeout for later collectives (the final synchronisation).
"""
from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

_DTYPES = [torch.int64, torch.float64, torch.float32, torch.int32, torch.uint8, torch.bool,
           torch.float16, torch.bfloat16, torch.int8, torch.int16]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_MAX_DIMS = 6


class Communicator:
    """Wraps the default process group.

    Args:
        device: where collective buffers live (CPU for gloo, the rank's CUDA device for nccl).
        on_collective: called as ``on_collective(op, nbytes)`` before each collective (status records).

    Attributes: ``collectives`` (int, number issued), ``bytes`` (int, payload bytes this rank sent),
    ``by_op`` (Counter of op names).
    """

    def __init__(self, device: torch.device | str = "cpu",
                 on_collective: Callable[[str, int], None] | None = None):
        self.device = torch.device(device)
        self.on_collective = on_collective
        self.collectives = 0
        self.bytes = 0
        self.by_op: Counter = Counter()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def _count(self, op: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.collectives += 1
        self.bytes += nbytes
        self.by_op[op] += 1
        if self.on_collective is not None:
            self.on_collective(op, nbytes)

    def stats(self) -> dict:
        """``{"collectives": int, "bytes": int, "by_op": {op: count}}`` for results.json."""
        return {"collectives": self.collectives, "bytes": self.bytes, "by_op": dict(self.by_op)}

    def all_reduce_coalesced(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum each tensor across ranks with one all_reduce per dtype (names sorted for a fixed layout).

        Input tensors are not modified; returns new CPU tensors with the same names, shapes and dtypes.
        """
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in sorted(tensors):
            by_dtype.setdefault(tensors[name].dtype, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for dtype in sorted(by_dtype, key=lambda d: _CODE.get(d, 99)):
            names = by_dtype[dtype]
            flat = torch.cat([tensors[n].detach().reshape(-1).to(self.device) for n in names])
            self._count("all_reduce", flat)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat = flat.cpu()
            offset = 0
            for n in names:
                numel = tensors[n].numel()
                out[n] = flat[offset:offset + numel].reshape(tensors[n].shape).clone()
                offset += numel
        return out

    def all_gather_variable(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather ``tensor`` (shape [rows_r, *trailing], rows may differ and be 0) from every rank to every rank.

        Returns the list of W CPU tensors in rank order. Raises ValueError on every rank when ranks disagree
        on dtype, trailing shape, or use an unsupported dtype/rank count of dimensions.
        """
        return self.gather_variable(tensor, dst=None)

    def gather_variable(self, tensor: torch.Tensor, dst: int | None = None) -> list[torch.Tensor] | None:
        """Like ``all_gather_variable``, but with ``dst`` set only that rank receives the W tensors (one
        ``gather`` instead of an ``all_gather``: W times less memory elsewhere); other ranks get None.
        The metadata round still reaches every rank, so a mismatch raises the same error everywhere."""
        if tensor.dtype not in _CODE or tensor.ndim < 1 or tensor.ndim > _MAX_DIMS:
            code, ndim = -1, tensor.ndim
        else:
            code, ndim = _CODE[tensor.dtype], tensor.ndim
        meta = torch.full((3 + _MAX_DIMS,), -1, dtype=torch.int64)
        meta[0] = tensor.shape[0] if tensor.ndim else -1
        meta[1], meta[2] = code, ndim
        trailing = list(tensor.shape[1:])[: _MAX_DIMS]
        meta[3:3 + len(trailing)] = torch.tensor(trailing, dtype=torch.int64)
        metas = self._all_gather_fixed(meta, "all_gather_meta")
        codes = {int(m[1]) for m in metas}
        shapes = {tuple(int(x) for x in m[2:]) for m in metas}
        if -1 in codes:
            bad = [r for r, m in enumerate(metas) if int(m[1]) == -1]
            raise ValueError(f"all_gather_variable: unsupported dtype or dimensions on rank(s) {bad}")
        if len(codes) > 1 or len(shapes) > 1:
            desc = ", ".join(f"rank {r}: {_DTYPES[int(m[1])]} [{int(m[0])}, "
                             f"{', '.join(str(int(x)) for x in m[3:3 + int(m[2]) - 1])}]"
                             for r, m in enumerate(metas))
            raise ValueError(f"all_gather_variable: ranks disagree on dtype or trailing shape ({desc})")
        rows = [int(m[0]) for m in metas]
        if dst is None:
            return self.all_gather_sized(tensor, rows)
        padded = self._padded(tensor, max(rows))
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == dst else None
        self._count("gather", padded)
        dist.gather(padded, gather_list=parts, dst=dst)
        return [p[:r].cpu() for p, r in zip(parts, rows)] if parts is not None else None

    def all_gather_sized(self, tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """Gather when every rank already knows the first-dimension size of every rank (``rows``, e.g. summed
        into an earlier all_reduce): pad to the largest, one all_gather, trim. Dtype and trailing shape must
        agree across ranks (the caller guarantees it). Returns W CPU tensors in rank order."""
        if len(rows) != self.world_size or rows[self.rank] != tensor.shape[0]:
            raise ValueError(f"rows {rows} do not match world size {self.world_size} / local rows {tensor.shape[0]}")
        parts = self._all_gather_fixed(self._padded(tensor, max(rows)), "all_gather")
        return [p[:r] for p, r in zip(parts, rows)]  # views: no second copy of the payload

    def _padded(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` zero-padded along dim 0 to ``rows`` rows, on the communication device."""
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device)
        padded[: tensor.shape[0]] = tensor.to(self.device)
        return padded

    def _all_gather_fixed(self, tensor: torch.Tensor, op: str) -> list[torch.Tensor]:
        tensor = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._count(op, tensor)
        dist.all_gather(parts, tensor)
        return [p.cpu() for p in parts]

    def set_timeout(self, seconds: float) -> None:
        """Change the default process group's timeout for every later collective (``dist.set_timeout``),
        e.g. a larger one for the final synchronisation so that a slow but alive rank does not fail the run."""
        dist.set_timeout(timedelta(seconds=float(seconds)))

    def broadcast_json(self, obj: dict | None, src: int = 0) -> dict:
        """Broadcast a JSON-serialisable dict from ``src`` (run metadata: run id, output dir, seed, start
        time), pickle-free; every rank returns the same dict."""
        data = json.dumps(obj, sort_keys=True).encode() if self.rank == src else None
        return json.loads(self.broadcast_bytes(data, src).decode())

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Send ``data`` (given on ``src``; ignored elsewhere) to every rank; returns it on all ranks."""
        length = torch.tensor([len(data) if self.rank == src and data is not None else 0], dtype=torch.int64,
                              device=self.device)
        self._count("broadcast", length)
        dist.broadcast(length, src)
        n = int(length.item())
        if self.rank == src:
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                   torch.empty(0, dtype=torch.uint8)).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._count("broadcast", buf)
            dist.broadcast(buf, src)
        return bytes(buf.cpu().numpy().tobytes())
