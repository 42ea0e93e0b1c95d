"""Pickle-free collectives with accounting: every collective of disteval goes through ``Communicator``,
runs under the process group's timeout, and is counted (number and bytes sent by this rank).

- ``all_reduce_coalesced``: all sum-states of one dtype flattened into one buffer, one all_reduce per dtype.
- ``reduce_scatter_rows``: sum a large state across ranks but hand each rank only its block of rows
  (the split of ``shard_bounds``): half the bytes of a ring all_reduce, for states whose rows each rank can
  finish on its own (a confusion matrix over thousands of classes).
- ``all_gather_variable``: tensors whose first dimension differs between ranks: exchange metadata
  (rows, dtype, trailing shape, value range, compression error) in one all_gather, pad, one all_gather, trim.
  A dtype or trailing-shape mismatch raises the same ValueError on every rank (all see the same metadata)
  instead of hanging. Optional compression (``disteval.comm.compression``) with measured error.
- ``all_gather_sized``: the same without the metadata round when the sizes are already known.
- ``gather_variable(dst=r)``: the same to one rank only (``gather``).
- ``broadcast_bytes`` / ``broadcast_json``: bytes or a JSON dict from one rank to all (length, then
  payload), e.g. the run directory and run metadata.
- ``set_timeout``: a different timeout for later collectives (the final synchronisation).

Progress: a payload larger than ``progress_bytes`` (and not chunked already) goes in ``PROGRESS_PIECES``
asynchronous pieces, and ``on_progress(op, bytes_done, bytes_total)`` is called as each finishes: a rank's records
then say how many bytes a collective had moved when it hung, and at what rate the link carried them.

Adaptive mode: a payload larger than ``async_threshold_bytes`` goes in chunks of ``chunk_bytes`` with
asynchronous collectives, at most ``max_in_flight`` outstanding, written straight into the result buffer:
the backend's temporary buffers then hold chunk_bytes x max_in_flight (x W for gathers) instead of the whole
payload. Chunks are element ranges of the same flat buffer, so the result is bit-identical to one call.
Reductions of *floating-point* payloads are the exception and always go in one call: the backend's
summation order depends on how the buffer is split (gloo's ring reduces each segment starting from a
different rank), so chunking would change the last bits of a float64 sum. Integer sums are exact in any
order and are chunked like gathers.
"""
from __future__ import annotations

import json
import math
import re
import struct
import time
from collections import Counter, deque
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from disteval.comm import compression as cz
from disteval.comm import topk as _topk
from disteval.common.ranges import shard_bounds
from disteval.errors import CollectiveTimeout

_DTYPES = [torch.int64, torch.float64, torch.float32, torch.int32, torch.uint8, torch.bool,
           torch.float16, torch.bfloat16, torch.int8, torch.int16]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
# the backends' words for a collective that ran out of time (group 1: gloo's milliseconds)
_BACKEND_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms|Watchdog caught collective operation timeout")
PROGRESS_PIECES = 8
_MAX_DIMS = 6
_META = 3 + _MAX_DIMS + 5  # rows, dtype code, ndim, trailing dims, min, max, exact-f32, abs err, rel err


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


# all_gather_into_tensor was renamed all_gather_single (the old name warns in torch 2.14)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wire_bytes(op: str, nbytes: int, world_size: int, root: bool = True) -> int:
    """Bytes a collective moves through one rank's link (sent or received, the larger) for a payload of
    ``nbytes`` per rank, by the standard cost of the algorithm (ring all_gather / all_reduce; direct gather and
    broadcast; ``root``: this rank is the one that receives a gather or sends a broadcast). The throughput the
    doctor reports is these bytes over the collective's seconds. Ops not listed count ``nbytes``."""
    w = max(int(world_size), 1)
    if op.startswith("all_gather") or (op == "gather" and root):
        return (w - 1) * nbytes
    if op == "all_reduce":
        return 2 * (w - 1) * nbytes // w
    if op == "reduce_scatter":
        return (w - 1) * nbytes // w
    return nbytes


class _RankOrderSum:
    """Completes an all_to_all of row blocks: after the exchange, ``dest = recv[0] + recv[1] + ...`` in
    rank order (``wait()`` does both; a finished synchronous exchange passes ``work=None``)."""

    def __init__(self, work, recv: torch.Tensor, dest: torch.Tensor):
        self.work, self.recv, self.dest = work, recv, dest

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.recv.shape[0] and self.dest.numel():
            self.dest.copy_(self.recv[0])
            for part in self.recv[1:]:
                self.dest.add_(part)


class Communicator:
    """Wraps the default process group.

    Args:
        device: where collective buffers live (CPU for gloo, the rank's CUDA device for nccl).
        on_collective: called as ``on_collective(op, nbytes, info)`` before each collective (status records);
            ``info``: ``wire_bytes`` (``wire_bytes()``), ``peers`` (the other members' global ranks) and, for a
            metric state's gather, ``payload`` ({name, dtype, compressible, compression, wire}).
        async_threshold_bytes: payloads above this size (bytes) go in asynchronous chunks; None = never.
        chunk_bytes: bytes per chunk in that mode (>= 1).
        max_in_flight: chunks outstanding at once (>= 1).
        group: the process group its collectives run over (None = the default group, all ranks); under a
            device mesh, e.g. the data-parallel group (``disteval.comm.mesh``). ``rank``, ``world_size``,
            ``src`` and ``dst`` are then ranks *within* the group.

    Set after construction: ``progress_bytes`` (payloads above it that are not chunked go in ``PROGRESS_PIECES``
    asynchronous pieces, each reported to ``on_progress(op, bytes_done, bytes_total)``; None = one call),
    ``timeout_s`` (bounds a pieced collective as a whole), ``on_complete``.

    Attributes: ``collectives`` (int, number issued), ``bytes`` (int, payload bytes this rank sent),
    ``by_op`` (Counter of op names), ``chunked`` (payloads sent in chunks), ``compression`` (per named
    payload: mode, wire form, bytes before/after over all ranks, max abs/rel error).
    """

    def __init__(self, device: torch.device | str = "cpu",
                 on_collective: Callable[[str, int, dict], None] | None = None,
                 async_threshold_bytes: int | None = 64 * 1024 * 1024, chunk_bytes: int = 16 * 1024 * 1024,
                 max_in_flight: int = 2, group: dist.ProcessGroup | None = None):
        if chunk_bytes < 1 or max_in_flight < 1:
            raise ValueError(f"chunk_bytes and max_in_flight must be >= 1, got {chunk_bytes}, {max_in_flight}")
        self.device = torch.device(device)
        self.group = group
        self.on_collective = on_collective
        self.async_threshold_bytes = async_threshold_bytes
        self.chunk_bytes, self.max_in_flight = int(chunk_bytes), int(max_in_flight)
        self.progress_bytes: int | None = None  # payloads above it (bytes) that are not chunked go in pieces
        self.timeout_s: float | None = None  # the process group's timeout, when known: bounds a collective's pieces
        self.timeout_key: str | None = None  # the config key that set ``timeout_s`` (named by CollectiveTimeout)
        self.on_progress: Callable[[str, int, int], None] | None = None
        self.payload: dict | None = None  # what the collective under way carries: {name, dtype, compressible}
        self.collectives = 0
        self.bytes = 0
        self.by_op: Counter = Counter()
        self.bytes_by_op: Counter = Counter()
        self.seconds_by_op: Counter = Counter()
        self.chunked = 0
        self.history: deque = deque(maxlen=32)  # the last finished collectives: {op, bytes, seconds, t_end}
        self.on_complete: Callable[[dict], None] | None = None
        self._open: list[tuple[str, int, float]] = []  # noted, not yet finished: (op, bytes, perf_counter at start)
        self.compression: dict[str, dict] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _note(self, op: str, nbytes: int, announce: bool = True) -> None:
        """A collective of ``nbytes`` (this rank's payload) starts: counted, and (``announce``) announced to
        ``on_collective`` (the rank's status record: what it waits in, should it never return)."""
        self.collectives += 1
        self.bytes += nbytes
        self.by_op[op] += 1
        self.bytes_by_op[op] += nbytes
        self._open.append((op, nbytes, time.perf_counter()))
        if announce:
            self._announce(op, nbytes)

    def _announce(self, op: str, nbytes: int, root: bool = True) -> None:
        if self.on_collective is None:
            return
        members = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        me = members[self.rank]
        info = {"wire_bytes": wire_bytes(op, nbytes, len(members), root), "peers": [r for r in members if r != me]}
        if self.payload is not None:
            info["payload"] = dict(self.payload)
        self.on_collective(op, nbytes, info)

    def _close(self) -> None:
        """The collectives noted since the last call have finished: their seconds (wall time from the start of
        the first to now, on this rank) go to ``seconds_by_op``, ``history`` and ``on_complete``."""
        if not self._open:
            return
        now = time.perf_counter()
        merged: dict[str, list] = {}
        for op, nbytes, t0 in self._open:
            entry = merged.setdefault(op, [0, t0])
            entry[0] += nbytes
            entry[1] = min(entry[1], t0)
        self._open.clear()
        for op, (nbytes, t0) in merged.items():
            record = {"op": op, "bytes": int(nbytes), "seconds": round(now - t0, 6), "t_end": time.time()}
            self.seconds_by_op[op] += now - t0
            self.history.append(record)
            if self.on_complete is not None:
                self.on_complete(record)

    def _count(self, op: str, t: torch.Tensor) -> None:
        self._note(op, t.numel() * t.element_size())

    def stats(self) -> dict:
        """``{"collectives", "bytes", "by_op", "bytes_by_op", "chunked", "compression"}`` for results.json (bytes:
        what this rank handed to the collectives, per op in ``bytes_by_op``)."""
        return {"collectives": self.collectives, "bytes": self.bytes, "by_op": dict(self.by_op),
                "bytes_by_op": dict(self.bytes_by_op),
                "seconds_by_op": {k: round(v, 6) for k, v in self.seconds_by_op.items()},
                "chunked": self.chunked, "compression": dict(self.compression)}

    def _run(self, op: str, numel: int, itemsize: int, launch: Callable[[int, int, bool], object],
             chunkable: bool = True, root: bool = True) -> None:
        """Issue ``launch(lo, hi, async_op)`` over element range [0, numel): once synchronously when the
        payload is small (``_step``) or not ``chunkable``, else piece by piece with at most ``max_in_flight``
        asynchronous works outstanding. ``numel`` must be equal on every rank (it decides the pieces). With
        ``timeout_s`` known, the pieces share it: CollectiveTimeout once it has passed with pieces left (the
        backend bounds each piece by it too)."""
        nbytes = numel * itemsize
        step = self._step(nbytes, itemsize) if chunkable and numel else None
        if step is None:
            self._note(op, nbytes, announce=False)
            self._announce(op, nbytes, root)
            launch(0, numel, False)
            self._close()
            return
        self._announce(op, nbytes, root)  # the whole payload, once: what the rank waits in
        pending: deque = deque()
        done, t0 = 0, time.perf_counter()

        def finish_one():
            nonlocal done
            work, size = pending.popleft()
            work.wait()
            done += size
            if self.on_progress is not None:
                self.on_progress(op, done, nbytes)
            elapsed = time.perf_counter() - t0
            if self.timeout_s is not None and done < nbytes and elapsed > self.timeout_s:
                raise CollectiveTimeout(op, nbytes, done, elapsed, self.timeout_s, self.timeout_key)

        for lo in range(0, numel, step):
            hi = min(numel, lo + step)
            if len(pending) >= self.max_in_flight:
                finish_one()
            self._note(op, (hi - lo) * itemsize, announce=False)
            pending.append((launch(lo, hi, True), (hi - lo) * itemsize))
        while pending:
            finish_one()
        self._close()
        self.chunked += 1

    def _step(self, nbytes: int, itemsize: int) -> int | None:
        """Elements per piece of an ``nbytes`` payload, or None for one synchronous call: ``chunk_bytes`` above
        ``async_threshold_bytes``, else 1/``PROGRESS_PIECES`` of it above ``progress_bytes``."""
        if self.async_threshold_bytes is not None and nbytes > self.async_threshold_bytes:
            return max(1, self.chunk_bytes // itemsize)
        if self.progress_bytes is not None and nbytes > self.progress_bytes:
            return max(1, -(-nbytes // (PROGRESS_PIECES * itemsize)))
        return None

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
            self.all_reduce_(flat)
            flat = flat.cpu()
            offset = 0
            for n in names:
                numel = tensors[n].numel()
                out[n] = flat[offset:offset + numel].reshape(tensors[n].shape).clone()
                offset += numel
        return out

    def all_reduce_(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum the contiguous tensor ``flat`` across ranks in place (integers chunked above the threshold;
        floats in one call so that the summation order, and so every bit, is that of the one-call path)."""
        flat = flat.reshape(-1)

        def launch(lo, hi, async_op):
            return dist.all_reduce(flat[lo:hi], op=dist.ReduceOp.SUM, async_op=async_op, group=self.group)

        self._run("all_reduce", flat.numel(), flat.element_size(), launch, not flat.dtype.is_floating_point)
        return flat

    def row_bounds(self, num_rows: int) -> list[tuple[int, int]]:
        """Each rank's block ``[start, stop)`` of ``num_rows`` rows in ``reduce_scatter_rows``
        (``shard_bounds``: contiguous, sizes differ by at most one, empty when rows < world size)."""
        return [shard_bounds(num_rows, self.world_size, r) for r in range(self.world_size)]

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Sum ``tensor`` [R, ...] (same shape and dtype on every rank) across ranks and return only this
        rank's rows: ``(block [stop - start, ...], start, stop)`` with ``row_bounds(R)``. Returns a CPU tensor.

        Each rank sends (W-1)/W of the payload, half of what a ring all_reduce moves. With nccl this is
        ``reduce_scatter``. gloo's reduce_scatter moves as many bytes as its all_reduce (measured on the
        loopback interface by benchmarks/gather.py), so on gloo every rank sends each peer that peer's rows
        (one ``all_to_all_single``) and sums the W received blocks itself, in rank order: deterministic
        bits, so this path is chunked above the threshold for floats as well.
        """
        rows = tensor.shape[0]
        row_numel = math.prod(tensor.shape[1:])
        flat = tensor.detach().to(self.device).contiguous().reshape(-1)
        bounds = self.row_bounds(rows)
        pieces = [flat[a * row_numel:b * row_numel] for a, b in bounds]
        start, stop = bounds[self.rank]
        own = (stop - start) * row_numel
        out = torch.empty(own, dtype=tensor.dtype, device=self.device)
        longest = max(p.numel() for p in pieces)
        direct = dist.get_backend(self.group) == "gloo"
        w = self.world_size

        def launch(lo, hi, async_op):
            inputs = [p[min(lo, p.numel()):min(hi, p.numel())] for p in pieces]
            dest = out[min(lo, own):min(hi, own)]
            if not direct:
                return dist.reduce_scatter(dest, inputs, op=dist.ReduceOp.SUM, async_op=async_op,
                                           group=self.group)
            recv = torch.empty(dest.numel() * w, dtype=tensor.dtype, device=self.device)
            work = dist.all_to_all_single(recv, torch.cat(inputs), output_split_sizes=[dest.numel()] * w,
                                          input_split_sizes=[i.numel() for i in inputs], async_op=async_op,
                                          group=self.group)
            finish = _RankOrderSum(work, recv.reshape(w, -1), dest)
            return finish if async_op else finish.wait()

        # element ranges run over the longest block; one step moves W such ranges (itemsize x W bytes)
        self._run("reduce_scatter", longest, tensor.element_size() * w, launch,
                  direct or not tensor.dtype.is_floating_point)
        return out.reshape((stop - start, *tensor.shape[1:])).cpu(), start, stop

    def all_gather_variable(self, tensor: torch.Tensor, *, compression: str = "none", compressible: bool = False,
                            name: str | None = None) -> list[torch.Tensor]:
        """Gather ``tensor`` (shape [rows_r, *trailing], rows may differ and be 0) from every rank to every rank.

        Returns the list of W CPU tensors in rank order. Raises ValueError on every rank when ranks disagree
        on dtype, trailing shape, or use an unsupported dtype/rank count of dimensions. ``compression``,
        ``compressible``, ``name``: see ``gather_variable``.
        """
        return self.gather_variable(tensor, dst=None, compression=compression, compressible=compressible,
                                    name=name)

    def gather_variable(self, tensor: torch.Tensor, dst: int | None = None, *, compression: str = "none",
                        compressible: bool = False, name: str | None = None) -> list[torch.Tensor] | None:
        """Like ``all_gather_variable``, but with ``dst`` set only that rank receives the W tensors (one
        ``gather`` instead of an ``all_gather``: W times less memory elsewhere); other ranks get None.
        The metadata round still reaches every rank, so a mismatch raises the same error everywhere.

        ``compression`` (none | lossless | fp16 | bf16, see ``disteval.comm.compression``): lossy modes apply
        only when ``compressible`` (the caller's metric declared the float payload compressible). With a
        ``name`` and a mode other than none, ``self.compression[name]`` records the wire form, the bytes
        before and after over all ranks, and the max abs / rel error over all ranks (measured, not bounded).
        """
        if compression not in cz.MODES:
            raise ValueError(f"unknown compression {compression!r}; one of {cz.MODES}")
        supported = tensor.dtype in _CODE and 1 <= tensor.ndim <= _MAX_DIMS
        code, ndim = (_CODE[tensor.dtype], tensor.ndim) if supported else (-1, tensor.ndim)
        lossy = cz.plan(compression, tensor.dtype, compressible) if supported else cz.WirePlan("raw", tensor.dtype)
        lo, hi = cz.local_range(tensor) if compression == "lossless" else (0, 0)
        early = cz.encode(tensor, lossy) if lossy.kind == "lossy" else None  # lossy plans need no global facts
        err_abs, err_rel = cz.lossy_error(tensor, lossy, early)
        meta = torch.full((_META,), -1, dtype=torch.int64)
        meta[0] = tensor.shape[0] if tensor.ndim else -1
        meta[1], meta[2] = code, ndim
        trailing = list(tensor.shape[1:])[: _MAX_DIMS]
        meta[3:3 + len(trailing)] = torch.tensor(trailing, dtype=torch.int64)
        tail = [lo, hi, int(compression == "lossless" and cz.exact_in_float32(tensor)), _f2i(err_abs), _f2i(err_rel)]
        meta[3 + _MAX_DIMS:] = torch.tensor(tail, dtype=torch.int64)
        metas = self._all_gather_fixed(meta, "all_gather_meta")
        codes = {int(m[1]) for m in metas}
        shapes = {tuple(int(x) for x in m[2:3 + _MAX_DIMS]) for m in metas}
        if -1 in codes:
            bad = [r for r, m in enumerate(metas) if int(m[1]) == -1]
            raise ValueError(f"all_gather_variable: unsupported dtype or dimensions on rank(s) {bad}")
        if len(codes) > 1 or len(shapes) > 1:
            desc = ", ".join(f"rank {r}: {_DTYPES[int(m[1])]} [{int(m[0])}, "
                             f"{', '.join(str(int(x)) for x in m[3:3 + int(m[2]) - 1])}]"
                             for r, m in enumerate(metas))
            raise ValueError(f"all_gather_variable: ranks disagree on dtype or trailing shape ({desc})")
        rows = [int(m[0]) for m in metas]
        t = 3 + _MAX_DIMS
        nonempty = [m for m in metas if int(m[0]) > 0] or metas[:1]
        p = cz.plan(compression, tensor.dtype, compressible, min(int(m[t]) for m in nonempty),
                    max(int(m[t + 1]) for m in nonempty), all(int(m[t + 2]) == 1 for m in nonempty))
        row_numel = math.prod(tensor.shape[1:])
        # the wire form travels as raw bytes (gloo has no int16, for one), [wire rows, bytes per wire row]
        wire_rows = [cz.encoded_rows(p, r, row_numel) for r in rows]
        row_bytes = p.wire_dtype.itemsize * (1 if p.kind == "bits" else row_numel)
        wire = (early if early is not None else cz.encode(tensor, p)).contiguous().reshape(-1).view(torch.uint8).reshape(wire_rows[self.rank], row_bytes)  # noqa: E501
        parts = self._gather_payload(wire, wire_rows, dst, dict(name=name, dtype=str(tensor.dtype).removeprefix(
            "torch."), compressible=compressible, compression=compression, wire=p.kind))
        if name is not None and compression != "none":
            wire_row_numel = 1 if p.kind == "bits" else row_numel
            self.compression[name] = {
                "mode": compression, "wire": f"{p.kind}:{str(p.wire_dtype).replace('torch.', '')}",
                "bytes_before": sum(rows) * row_numel * tensor.element_size(),
                "bytes_after": sum(wire_rows) * wire_row_numel * p.wire_dtype.itemsize,
                "max_abs_error": max(_i2f(int(m[t + 3])) for m in metas),
                "max_rel_error": max(_i2f(int(m[t + 4])) for m in metas)}
        if parts is None:
            return None
        trailing = () if p.kind == "bits" else tuple(tensor.shape[1:])
        return [cz.decode(w.reshape(-1).view(p.wire_dtype).reshape(wr, *trailing), p, tensor.dtype,
                          (r, *tensor.shape[1:])) for w, r, wr in zip(parts, rows, wire_rows)]

    def _gather_payload(self, wire: torch.Tensor, rows: list[int], dst: int | None, payload: dict):
        """``_gather_sized`` with ``payload`` (what it carries) announced to ``on_collective`` meanwhile."""
        self.payload = payload
        try:
            return self._gather_sized(wire, rows, dst)
        finally:
            self.payload = None

    def all_gather_sized(self, tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """Gather when every rank already knows the first-dimension size of every rank (``rows``, e.g. summed
        into an earlier all_reduce): pad to the largest, one all_gather, trim. Dtype and trailing shape must
        agree across ranks (the caller guarantees it). Returns W CPU tensors in rank order."""
        return self._gather_sized(tensor, rows, None)

    def gather_sized(self, tensor: torch.Tensor, rows: list[int], dst: int) -> list[torch.Tensor] | None:
        """``all_gather_sized`` to ``dst`` only (one gather): W CPU tensors in rank order on ``dst``, None
        elsewhere."""
        return self._gather_sized(tensor, rows, dst)

    def all_gather_uneven(self, tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """``all_gather_sized`` without the padding when the sizes differ: one broadcast from each rank that holds
        rows (exact size; ranks with none send nothing), else one all_gather. ``rows`` (every rank's first-dimension
        size, known everywhere) decides the path, so all ranks take the same one. Bytes counted: this rank's own
        payload only (what it sends). Returns W CPU tensors in rank order. Raises ValueError as
        ``all_gather_sized``."""
        self._check_rows(tensor, rows)
        if len(set(rows)) == 1:
            return self.all_gather_sized(tensor, rows)
        parts = []
        for src, n in enumerate(rows):
            if n == 0:
                parts.append(tensor.new_empty((0, *tensor.shape[1:]), device="cpu"))
                continue
            buf = (tensor.to(self.device).contiguous() if src == self.rank else
                   torch.empty((n, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device))
            self._note("broadcast", buf.numel() * buf.element_size() if src == self.rank else 0)
            dist.broadcast(buf, group_src=src, group=self.group)
            self._close()
            parts.append(buf.cpu())
        return parts

    def _check_rows(self, tensor: torch.Tensor, rows: list[int]) -> None:
        """ValueError unless ``rows`` has one size per rank and this rank's is ``tensor``'s first dimension."""
        if len(rows) != self.world_size or rows[self.rank] != tensor.shape[0]:
            raise ValueError(f"rows {rows} do not match world size {self.world_size} / local rows {tensor.shape[0]}")

    def _gather_sized(self, tensor: torch.Tensor, rows: list[int], dst: int | None) -> list[torch.Tensor] | None:
        self._check_rows(tensor, rows)
        padded = self._padded(tensor, max(rows))
        flat = padded.reshape(-1)
        receive = dst is None or self.rank == dst
        out = torch.empty((self.world_size, flat.numel()), dtype=tensor.dtype, device=self.device) if receive else None

        def launch(lo, hi, async_op):
            if dst is None and not async_op:  # one call straight into the [W, n] result, no list to flatten
                return _all_gather_single(out.reshape(-1), flat, group=self.group)
            outs = [out[r, lo:hi] for r in range(self.world_size)] if receive else None
            if dst is None:
                return dist.all_gather(outs, flat[lo:hi], async_op=async_op, group=self.group)
            return dist.gather(flat[lo:hi], gather_list=outs, group_dst=dst, async_op=async_op, group=self.group)

        self._run("all_gather" if dst is None else "gather", flat.numel(), flat.element_size(), launch, root=receive)
        if out is None:
            return None
        out = out.cpu().reshape((self.world_size, *padded.shape))
        return [out[i, :r] for i, r in enumerate(rows)]  # views: no second copy of the payload

    def _padded(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` zero-padded along dim 0 to ``rows`` rows, on the communication device (the tensor
        itself when it already has ``rows`` rows and lives there)."""
        if tensor.shape[0] == rows and tensor.device == self.device and tensor.is_contiguous():
            return tensor
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device)
        padded[: tensor.shape[0]] = tensor.to(self.device)
        return padded

    def _all_gather_fixed(self, tensor: torch.Tensor, op: str) -> list[torch.Tensor]:
        tensor = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._count(op, tensor)
        dist.all_gather(parts, tensor, group=self.group)
        self._close()
        return [p.cpu() for p in parts]

    def sharded_topk(self, gallery_rows, query_rows, num_queries: int, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k search over a gallery sharded across the ranks (``disteval.comm.topk.sharded_topk``;
        rows are ``disteval.common.topk.Rows``, ``spec`` a ``SearchSpec``): this rank's queries' (scores,
        gallery positions)."""
        return _topk.sharded_topk(self, gallery_rows, query_rows, num_queries, spec)

    def set_timeout(self, seconds: float, key: str | None = None) -> None:
        """Change the default process group's timeout for every later collective (``dist.set_timeout``),
        e.g. a larger one for the final synchronisation so that a slow but alive rank does not fail the run;
        ``key``: the config key it comes from (named when it fires)."""
        dist.set_timeout(timedelta(seconds=float(seconds)), group=self.group)
        self.timeout_s, self.timeout_key = float(seconds), key

    def timeout_error(self, exc: BaseException) -> CollectiveTimeout | None:
        """The CollectiveTimeout that ``exc`` stands for, or None: the backend's own timeout of a collective this
        communicator issued and that has not finished (gloo: "Timed out waiting 5000ms for recv operation to
        complete"; NCCL's watchdog: "Watchdog caught collective operation timeout"), named by op, payload,
        elapsed seconds and the timeout with its config key. A peer's death (connection closed) is not a timeout."""
        if not self._open or isinstance(exc, CollectiveTimeout) or not isinstance(exc, RuntimeError):
            return None
        found = _BACKEND_TIMEOUT.search(str(exc)[:2000])
        if found is None:
            return None
        op, _, t0 = self._open[0]
        nbytes = sum(n for o, n, _ in self._open if o == op)
        timeout = float(found.group(1)) / 1000 if found.group(1) else self.timeout_s
        return CollectiveTimeout(op, nbytes, None, time.perf_counter() - t0,
                                 timeout if timeout is not None else float("nan"), self.timeout_key)

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
        dist.broadcast(length, group_src=src, group=self.group)
        self._close()
        n = int(length.item())
        if self.rank == src:
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                   torch.empty(0, dtype=torch.uint8)).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._count("broadcast", buf)
            dist.broadcast(buf, group_src=src, group=self.group)
            self._close()
        return bytes(buf.cpu().numpy().tobytes())
