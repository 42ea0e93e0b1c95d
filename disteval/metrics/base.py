"""The metric protocol: mergeable sufficient statistics, no torch.distributed here.

A metric accumulates *states* locally; ``add_state`` declares each one, in one place, with its reduction:

- ``"sum"``: element-wise sum across ranks (one coalesced all_reduce per dtype in the comm layer);
- ``"gather"``: variable-size records concatenated across ranks along dim 0;
- ``"local"``: rank-local records (e.g. a rank's embedding shard) that synchronisation never moves; they
  are kept in snapshots and checkpoints, and ``merge_state`` concatenates them like gather-states.

``load_synced(states)`` replaces the local states by the synchronised ones; ``compute()`` turns states into
metric values. Integer counts are int64 and float sums float64, declared once per state.

Two declarations steer the communication layer (``specs()``):

- ``compressible=True`` (float gather-states only): the metric tolerates lossy fp16/bf16 transport of this
  state; every other state is *exact* and is never rounded.
- ``sliceable=True`` (sum-states): the metric can finish its per-row results from a block of rows of the
  summed state (``slice_partials`` / ``finish_slice`` / ``load_finished``), so a large state may be
  reduce-scattered instead of all-reduced (a confusion matrix over thousands of classes).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Literal

import torch

from disteval.metrics.meaning import Meaning, register

Reduction = Literal["sum", "gather", "local"]


@dataclass(frozen=True)
class StateSpec:
    """How a state is synchronised: its reduction and whether lossy transport / row slicing is allowed."""

    reduction: Reduction
    compressible: bool = False
    sliceable: bool = False
    root: bool = False


class Metric(abc.ABC):
    """The Metric protocol (abstract base). A subclass declares its states in ``__init__`` with
    ``add_state`` and implements ``update`` and ``compute``; everything else (``states``, ``specs``,
    ``load_synced``, ``merge_state``, ``reset``, ``snapshot``/``restore``) works from the declarations.

    Float64 sum-states must be updated *in place* by ``update`` (``+=``, ``index_add_``): in the default
    bitwise mode the evaluation loop moves each batch's float partials into a ``BatchTreeSum`` after every
    batch (``float_sum_states``) so that their total does not depend on the world size.
    """

    #: True when ``update`` accepts outputs on the states' device and adds them there with no host
    #: synchronisation (the engine then moves the metric to the model's device with ``to``); False: the
    #: states stay on the CPU and ``update`` copies what it needs there.
    device_resident: ClassVar[bool] = False
    #: what the numbers of ``compute()`` mean: the main metric and the keys where lower is better
    #: (``disteval.metrics.meaning``); every concrete metric declares it, the registry collects it
    meaning: ClassVar[Meaning] = Meaning()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "meaning" in cls.__dict__:
            register(f"{cls.__module__}.{cls.__qualname__}", cls.meaning)

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._reductions: dict[str, Reduction] = {}
        self._specs: dict[str, StateSpec] = {}
        self._initial: dict[str, torch.Tensor | None] = {}
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> "Metric":
        """Keep the states on ``device`` (the model's: ``update`` then adds each batch there with no host
        transfer; the comm layer moves them for the one synchronisation, after which ``load_synced`` holds
        them on the CPU for ``compute``). Returns self."""
        self.device = torch.device(device)
        self._flush()
        for name, value in self._states.items():
            self._states[name] = value.to(self.device)
        return self

    def raise_deferred(self) -> None:
        """Raise the error that ``update`` found but, to issue no host synchronisation per batch, only recorded
        on the device (e.g. a label outside [0, C), non-finite outputs): called once after the loop and before
        a checkpoint. Raises DataError naming the first offending sample id. Default: nothing recorded."""

    def add_state(self, name: str, value: torch.Tensor, reduction: Reduction = "sum", *,
                  compressible: bool = False, sliceable: bool = False, root: bool = False) -> None:
        """Declare a state. Sum-states must be int64 or float64 (counts never narrower). Raises TypeError /
        ValueError for a narrower sum-state, a compressible state that is not a float gather-state, or a
        sliceable state that is not a sum-state with at least one dimension. ``root=True`` (gather-states):
        gathered to rank 0 only, the only rank that computes (other ranks keep their local part)."""
        if reduction == "sum" and value.dtype not in (torch.int64, torch.float64):
            raise TypeError(f"sum-state {name!r} must be int64 or float64, got {value.dtype}")
        if compressible and (reduction != "gather" or not value.dtype.is_floating_point):
            raise ValueError(f"state {name!r}: only float gather-states can be declared compressible")
        if sliceable and (reduction != "sum" or value.ndim < 1):
            raise ValueError(f"state {name!r}: only sum-states with a row dimension can be declared sliceable")
        self._states[name] = value
        # zeros (the usual case) are re-created by reset(); only other initial values are kept
        self._initial[name] = value.detach().clone() if bool(value.any()) else None
        self._reductions[name] = reduction
        if root and reduction != "gather":
            raise ValueError(f"state {name!r}: only gather-states can be gathered to the root rank only")
        self._specs[name] = StateSpec(reduction, compressible, sliceable, root)

    def specs(self) -> dict[str, StateSpec]:
        """``{name: StateSpec}`` of every state."""
        return dict(self._specs)

    def slice_partials(self, name: str, block: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """For a sliceable state: from this rank's rows ``[start, stop)`` of the summed state, a partial
        sum-state over the same row space (e.g. a confusion matrix's column sums, [C]) that the comm layer
        reduce-scatters with the same row split; None when the rows suffice."""
        raise NotImplementedError(f"{type(self).__name__} declares {name!r} sliceable but has no slice_partials")

    def finish_slice(self, name: str, block: torch.Tensor, start: int, stop: int,
                     partial: torch.Tensor | None) -> torch.Tensor:
        """Per-row results ``[stop - start, k]`` of rows ``[start, stop)`` (``partial``: this rank's rows of
        the summed ``slice_partials``). The comm layer gathers them and calls ``load_finished``."""
        raise NotImplementedError(f"{type(self).__name__} declares {name!r} sliceable but has no finish_slice")

    def load_finished(self, name: str, rows: torch.Tensor) -> None:
        """Receive the gathered per-row results of every rank (``[R, k]``, rows in order) in place of the
        full synchronised state ``name``."""
        raise NotImplementedError(f"{type(self).__name__} declares {name!r} sliceable but has no load_finished")

    @abc.abstractmethod
    def update(self, outputs: Any, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Add one batch. ``outputs``: what the task's step returns (e.g. logits float [B, C]); ``targets``
        int64 [B]; ``sample_ids`` int64 [B] (global dataset indices). Raises DataError naming the sample id
        for bad input. Issues no collective."""

    def _flush(self) -> None:
        """Fold work queued by ``update`` into the states (no-op here; metrics that batch their work, e.g.
        ranking scores or COCO matching, override it). ``states``, ``merge_state`` call it first."""

    @property
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors by name, live (the dict the metric holds, not a copy): a subclass's ``update`` and
        ``compute`` read them, add into them in place, or put a new tensor under a declared name (``add_state``
        declares names and reductions; a name not declared there is never synchronised)."""
        return self._states

    def states(self) -> dict[str, tuple[torch.Tensor, Reduction]]:
        """``{name: (tensor, reduction)}`` of the local states (the tensors themselves, not copies)."""
        self._flush()
        return {k: (v, self._reductions[k]) for k, v in self._states.items()}

    def load_synced(self, states: dict[str, torch.Tensor]) -> None:
        """Replace local states by synchronised ones (same names, dtypes and, for sum-states, shapes)."""
        for name, value in states.items():
            old = self._states[name]
            if value.dtype != old.dtype:
                raise TypeError(f"state {name!r}: synced dtype {value.dtype} != declared {old.dtype}")
            if self._reductions[name] == "sum" and value.shape != old.shape:
                raise ValueError(f"state {name!r}: synced shape {tuple(value.shape)} != {tuple(old.shape)}")
            self._states[name] = value.detach().cpu()

    def merge_state(self, others: Iterable["Metric"]) -> None:
        """Merge other instances' states into this one in process (sum or concatenate), like torcheval's
        ``merge_state``; the single-process equivalent of synchronisation, used by tests and tools."""
        others = list(others)
        for m in [self, *others]:
            m._flush()
        merged = {}
        for name, value in self._states.items():
            parts = [value] + [o._states[name] for o in others]
            if self._reductions[name] == "sum":
                merged[name] = torch.stack(parts).sum(0)
            else:
                merged[name] = torch.cat(parts, 0)
        self.load_synced(merged)

    @abc.abstractmethod
    def compute(self) -> dict:
        """Metric values from the (synchronised) states: a JSON-able dict (floats, ints, lists, None)."""

    def local_summary(self) -> dict:
        """A few named scalars of the *local* states before synchronisation (per-rank rows of results.json,
        outlier detection), e.g. ``{"accuracy": 0.93, "nll": 0.21}``; empty by default."""
        return {}

    def float_sum_states(self) -> dict[str, torch.Tensor]:
        """The float64 sum-states (the tensors themselves, in declaration order), without flushing queued
        work: what the loop folds per batch in bitwise mode."""
        return {k: v for k, v in self._states.items()
                if self._reductions[k] == "sum" and v.dtype == torch.float64}

    def reset(self) -> None:
        """Back to the declared initial states (queued work dropped), as after ``__init__``."""
        self._flush()
        self.restore({k: v.clone() if v is not None else torch.zeros_like(self._states[k]) if
                      self._reductions[k] == "sum" else self._states[k][:0].clone() for k, v in self._initial.items()})

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the local states ``{name: tensor}`` (queued work folded in first), to ``restore``
        after a synchronisation replaced them (e.g. to synchronise again without some ranks). Raises what
        ``raise_deferred`` raises: a checkpoint never holds a batch that failed validation."""
        self._flush()
        self.raise_deferred()
        return {k: v.detach().clone() for k, v in self._states.items()}

    def mark(self) -> dict[str, torch.Tensor | int]:
        """Where the states stand now, for ``contribution``: a copy of each sum-state, the row count of each
        gather- and local-state (queued work folded in first; raises what ``raise_deferred`` raises, so a mark
        never follows a batch that failed validation)."""
        self._flush()
        self.raise_deferred()
        return {k: v.detach().clone() if self._reductions[k] == "sum" else int(v.shape[0])
                for k, v in self._states.items()}

    def contribution(self, mark: dict[str, torch.Tensor | int]) -> dict[str, torch.Tensor]:
        """What the batches added since ``mark`` contributed, on the CPU: each sum-state's difference and each
        gather-/local-state's new rows. Exact for int64 states and for rows (a state is a sum or a concatenation
        of whole batches: the premise of synchronisation); a float64 sum-state's difference is exact only when
        it was zero at the mark (bitwise mode folds float partials out of the states after every batch)."""
        self._flush()
        self.raise_deferred()
        out = {}
        for k, v in self._states.items():
            at = mark[k]
            out[k] = (v - at.to(v.device) if self._reductions[k] == "sum" else v[int(at):]).detach().cpu().clone()
        return out

    def add_contribution(self, part: dict[str, torch.Tensor]) -> None:
        """Add a ``contribution`` of other batches after the batches added so far: sum-states add it, gather-
        and local-states append its rows (so rows stay in the order of the batches). Raises KeyError for a
        missing state, TypeError / ValueError for another dtype or sum-state shape."""
        self._flush()
        missing = sorted(set(self._states) - set(part))
        if missing:
            raise KeyError(f"contribution lacks states {missing}")
        for k, v in self._states.items():
            add = part[k]
            if add.dtype != v.dtype:
                raise TypeError(f"state {k!r}: contribution dtype {add.dtype} != declared {v.dtype}")
            if self._reductions[k] == "sum":
                if add.shape != v.shape:
                    raise ValueError(f"state {k!r}: contribution shape {tuple(add.shape)} != {tuple(v.shape)}")
                v += add.to(v.device)
            else:
                self._states[k] = torch.cat([v, add.to(v.device)])

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Replace the states by a ``snapshot()`` of this metric (same names, dtypes and sum-state shapes).
        Raises KeyError for a missing state, TypeError / ValueError as ``load_synced``."""
        missing = sorted(set(self._states) - set(snapshot))
        if missing:
            raise KeyError(f"snapshot lacks states {missing}")
        self.load_synced({k: snapshot[k].clone() for k in self._states})
        if self.device.type != "cpu":  # back where update adds (load_synced holds states on the CPU)
            self.to(self.device)
