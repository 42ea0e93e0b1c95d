"""The synchronisation protocol and its policy: the one module that knows both the metrics' state
declarations and the comm layer (as torcheval's toolkit does).

One synchronisation per run (per trial), whatever the number of batches:

1. one all_reduce of all int64 sum-states flattened into one buffer, which also carries a [W] vector
   holding this rank's payload size at its own index (so the sum tells every rank every size);
2. in ``fast`` mode only, one all_reduce of all float64 sum-states (in ``bitwise`` mode they travel as
   tree nodes in 3., so that their total does not depend on W: ``disteval.metrics.ordered_sum``);
3. one all_gather of the padded int64 payload: this rank's per-rank row (named fields, JSON bytes), its
   sample-id runs and its float tree nodes (bit-cast, no pickle).

States declared ``local`` (a rank's embedding shard) are never moved. By payload kind (``SyncPolicy``): each
gather-state adds one metadata all_gather and one variable-size gather
(to rank 0 only for states declared ``root``) compressed as the policy says; each sliceable sum-state above
``reduce_scatter_min_bytes`` leaves the all_reduce for two reduce_scatters and one all_gather.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from disteval.comm import Communicator
from disteval.errors import ConfigError, DistevalError
from disteval.metrics.base import Metric
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.ordered_sum import BatchTreeSum

RESERVED = "payload_sizes"


@contextlib.contextmanager
def in_collective(status: Any, op: str) -> Iterator[None]:
    """The block is a collective phase of this rank: its status record says ``in_collective {op, since}`` (written
    at once) while the block runs, and nothing once it ends normally. When the block raises (a peer's timeout, a
    closed connection) the record stays: it is the failing rank's evidence of the phase it died in. The watchdog
    blames the peers that never arrive and the doctor names the phase from it. ``status``: the rank's status
    writer (anything with ``update(**fields, force=bool)``); ``op``: e.g. ``synchronise``, ``canary``,
    ``bootstrap_gather``."""
    status.update(in_collective={"op": op, "since": time.time()}, force=True)
    yield
    status.update(in_collective=None)


@dataclass
class SyncPolicy:
    """How ``synchronise`` moves each kind of state (``communication.*``).

    compression: none | lossless | fp16 | bf16 for gather-states (``disteval.comm.compression``);
    compress_states: the gather-states it applies to (None = all; lossy modes round only states declared
    compressible); reduce_scatter_min_bytes: sliceable sum-states larger than this many bytes are
    reduce-scattered and finished per slice (None = never)."""

    compression: str = "none"
    compress_states: list[str] | None = None
    reduce_scatter_min_bytes: int | None = None

    @classmethod
    def from_config(cls, comm_cfg: Any) -> "SyncPolicy":
        """From the ``communication`` config node."""
        states = comm_cfg.compress_states
        return cls(str(comm_cfg.compression), None if states is None else [str(x) for x in states],
                   comm_cfg.reduce_scatter_min_bytes)


@dataclass
class SyncResult:
    """What every rank learns at synchronisation: ``runs`` int64 [k, 2] (all ranks' sample-id runs) and
    ``rows`` (each rank's row of named fields, in rank order). ``restore``: in a ``synchronised`` block, whether
    the local states come back when the block ends (the block may change it once it knows)."""

    runs: torch.Tensor
    rows: list[dict]
    restore: bool = False


def _pack(row: dict, runs: torch.Tensor, nodes: list, width: int) -> torch.Tensor:
    """int64 payload: [len(json), n_runs, n_nodes, json bytes padded to 8, runs, node (level, index),
    node values bit-cast]."""
    data = json.dumps(row, allow_nan=True, sort_keys=True).encode()
    text = torch.zeros(-(-len(data) // 8) * 8, dtype=torch.uint8)
    text[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    head = torch.tensor([len(data), runs.shape[0], len(nodes)], dtype=torch.int64)
    where, values = BatchTreeSum.to_tensors(nodes, width)
    return torch.cat([head, text.view(torch.int64), runs.reshape(-1), where.reshape(-1),
                      values.reshape(-1).view(torch.int64)])


def _unpack(part: torch.Tensor, width: int) -> tuple[dict, torch.Tensor, list]:
    n_text, n_runs, n_nodes = (int(x) for x in part[:3])
    pos = 3 + -(-n_text // 8)
    row = json.loads(bytes(part[3:pos].clone().view(torch.uint8)[:n_text].numpy().tobytes()).decode())
    runs = part[pos:pos + 2 * n_runs].reshape(-1, 2)
    pos += 2 * n_runs
    where = part[pos:pos + 2 * n_nodes].reshape(-1, 2)
    pos += 2 * n_nodes
    values = part[pos:pos + n_nodes * width].clone().view(torch.float64).reshape(n_nodes, width)
    return row, runs, BatchTreeSum.from_tensors(where, values)


def synchronise(state: Evaluator, comm: Communicator, row: dict, policy: SyncPolicy | None = None) -> SyncResult:
    """Synchronise ``state`` (metric states, coverage, float tree) across the ranks of ``comm`` and load the
    global states into ``state.metric`` on every rank (root-only gather-states: on rank 0). ``row``: this
    rank's named per-rank fields (JSON values; every rank's row is returned). Every collective runs under the
    process group's timeout. Raises ValueError for a state named ``payload_sizes`` (reserved)."""
    policy = policy or SyncPolicy()
    metric = state.metric
    states, specs = metric.states(), metric.specs()
    bitwise = state.tree is not None
    floats = set(state.float_names) if bitwise else set()
    nodes = state.tree.nodes() if bitwise else []
    width = state.tree.width if bitwise else 0
    payload = _pack(row, state.coverage.runs(), nodes, width)
    sizes = torch.zeros(comm.world_size, dtype=torch.int64)
    sizes[comm.rank] = payload.numel()
    sums = {k: v for k, (v, red) in states.items() if red == "sum" and k not in floats}
    if RESERVED in sums:
        raise ValueError(f"metric state name {RESERVED!r} is reserved")
    limit = policy.reduce_scatter_min_bytes
    sliced = sorted(k for k, v in sums.items() if specs[k].sliceable and limit is not None
                    and v.numel() * v.element_size() > limit)
    synced = comm.all_reduce_coalesced({**{k: v for k, v in sums.items() if k not in sliced}, RESERVED: sizes})
    sizes = synced.pop(RESERVED).tolist()
    for name in sorted(k for k, (v, red) in states.items() if red == "gather"):
        mode = policy.compression if policy.compress_states is None or name in policy.compress_states else "none"
        parts = comm.gather_variable(states[name][0], dst=0 if specs[name].root else None, compression=mode,
                                     compressible=specs[name].compressible, name=name)
        if parts is not None:  # None: a root-only state on another rank keeps its local part
            synced[name] = torch.cat(parts)
    metric.load_synced(synced)
    _finish_sliced(metric, comm, sums, sliced)
    unpacked = [_unpack(p, width) for p in comm.all_gather_sized(payload, sizes)]
    if bitwise and state.float_names:
        state.load_float_total(BatchTreeSum.combine([n for _, _, ns in unpacked for n in ns], width))
    return SyncResult(torch.cat([r for _, r, _ in unpacked]), [row for row, _, _ in unpacked])


@contextlib.contextmanager
def synchronised(state: Evaluator, comm: Communicator, row: dict, policy: SyncPolicy | None = None, *,
                 status: Any = None, restore: bool = True) -> Iterator[SyncResult]:
    """``synchronise`` for the length of a block (the shape of torchmetrics' ``Metric.sync_context``): inside
    it, ``state.metric`` holds the global states (and the collectives ran as the collective phase
    ``synchronise`` of ``status``, when given); when the block ends, also by an exception, the rank's local
    states come back if ``restore`` (torchmetrics' ``should_unsync``) so that the same evaluator can be
    synchronised again over other ranks (outlier exclusion). The block may set ``result.restore`` once it knows
    whether it needs the local states again. Coverage and the float tree are never changed by a
    synchronisation, so only the metric's states are kept (one ``Metric.snapshot``, taken only when
    ``restore``). Raises what ``synchronise`` raises; nothing is restored then (the states were not replaced
    or the run is failing)."""
    local = state.metric.snapshot() if restore else None
    with in_collective(status, "synchronise") if status is not None else contextlib.nullcontext():
        result = synchronise(state, comm, row, policy)
    result.restore = restore
    try:
        yield result
    finally:
        if result.restore:
            if local is None:
                raise ValueError("synchronised(restore=False) took no snapshot: the block cannot ask to restore")
            state.metric.restore(local)


def _finish_sliced(metric: Metric, comm: Communicator, sums: dict, sliced: list[str]) -> None:
    """Reduce-scatter each large sliceable sum-state, finish its rows per slice, gather the per-row results."""
    for name in sliced:
        block, start, stop = comm.reduce_scatter_rows(sums[name])
        partial = metric.slice_partials(name, block, start, stop)
        part_block = comm.reduce_scatter_rows(partial)[0] if partial is not None else None
        done = metric.finish_slice(name, block, start, stop, part_block)
        counts = [b - a for a, b in comm.row_bounds(sums[name].shape[0])]
        metric.load_finished(name, torch.cat(comm.all_gather_sized(done, counts)))


def sync_policy_notes(metric: Metric, policy: SyncPolicy) -> list[str]:
    """Warnings for a valid but ineffective request (a lossy mode with nothing compressible to apply it to)."""
    if policy.compression not in ("fp16", "bf16"):
        return []
    chosen = [k for k, s in metric.specs().items() if s.compressible
              and (policy.compress_states is None or k in policy.compress_states)]
    if chosen:
        return []
    return [f"communication.compression={policy.compression} has nothing to compress: no state of eval.metrics is "
            "declared compressible (e.g. add ranking to eval.metrics for its scores); every payload stays exact"]


def check_sync_policy(metric: Metric, policy: SyncPolicy) -> None:
    """Refuse a compression request the metrics do not allow, before any rank starts. Raises ConfigError
    naming ``communication.compress_states`` and the state: an unknown state, a sum-state (all-reduced,
    never compressed), or with fp16/bf16 a state its metric declares exact (integer counts, labels)."""
    specs = metric.specs()
    if policy.compress_states is None:
        return
    gather = sorted(k for k, s in specs.items() if s.reduction == "gather")
    compressible = sorted(k for k, s in specs.items() if s.compressible)
    families = sorted({k.split(".", 1)[0] for k in specs})
    for name in policy.compress_states:
        if name not in specs:
            raise ConfigError("communication.compress_states", f"unknown state {name!r} (families of eval.metrics: "
                              f"{families}); the gather-states of eval.metrics are {gather}")
        if specs[name].reduction != "gather":
            raise ConfigError("communication.compress_states", f"state {name!r} is an exact sum-state "
                              f"(all-reduced in int64/float64) and is never compressed; gather-states: {gather}")
        if policy.compression in ("fp16", "bf16") and not specs[name].compressible:
            raise ConfigError("communication.compress_states", f"state {name!r} is declared exact by its metric "
                              f"and cannot be sent as {policy.compression}; compressible states: {compressible} "
                              "(communication.compression=lossless keeps it exact)")


def _digest(tensors: list[torch.Tensor]) -> int:
    """A 63-bit BLAKE2b digest of the tensors' shapes, dtypes and bytes, in order (int, non-negative)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


def check_tp_peers(state: Evaluator, comm: Communicator, peers: list[int]) -> dict:
    """Check that the tensor-parallel peers of this rank (the ranks of ``comm``'s group, global ranks
    ``peers`` in group order) evaluated the same samples and accumulated bit-identical metric states: one
    all_gather of two digests per rank (BLAKE2b of the sample-id runs; of every metric state, the coverage
    and the float tree). TP peers receive identical batches and their models end every row-parallel layer with
    the same all_reduce, so their states are equal; each then synchronises its own data-parallel group, and
    rank 0's is the one reported. Returns ``{"sample_digest", "state_digest"}`` (hex strings).

    Raises DistevalError on every rank of the group, naming the ranks and their digests, when the sample ids
    differ (the data was split by global rank rather than by data-parallel rank: every sample would be counted
    ``tp`` times over the world, or each TP rank fed different data) or, with equal ids, when the states do."""
    local = state.state_dict()
    ids = _digest([local["runs"]])
    states = _digest([local["states"][k] for k in sorted(local["states"])] + [local["tree_where"], local["tree_values"]])
    mine = torch.tensor([[ids, states]], dtype=torch.int64)
    rows = [p.reshape(-1).tolist() for p in comm.all_gather_sized(mine, [1] * comm.world_size)]
    for col in (0, 1):  # the sample ids, the metric states
        if len({r[col] for r in rows}) > 1:
            by_rank = ", ".join(f"rank {peers[i]}: {r[col]:016x}" for i, r in enumerate(rows))
            if col == 0:
                raise DistevalError(f"tensor-parallel peers {peers} evaluated different samples (sample-id digests "
                                    f"{by_rank}): TP peers must receive identical batches; the data must be split "
                                    "by data-parallel rank, not by global rank")
            raise DistevalError(f"tensor-parallel peers {peers} evaluated the same samples but hold different "
                                f"metric states (digests {by_rank}): their model outputs differ")
    return {"sample_digest": f"{ids:016x}", "state_digest": f"{states:016x}"}
