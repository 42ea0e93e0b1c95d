"""The metric protocol: mergeable sufficient statistics, no torch.distributed here.

A metric accumulates *states* locally; ``states()`` declares each one with its reduction:

- ``"sum"``: element-wise sum across ranks (one coalesced all_reduce per dtype in the comm layer);
- ``"gather"``: variable-size records concatenated across ranks along dim 0.

``load_synced(states)`` replaces the local states by the synchronised ones; ``compute()`` turns states into
metric values. Integer counts are int64 and float sums float64, declared once per state.
"""
from __future__ import annotations

from typing import Iterable, Literal

import torch

Reduction = Literal["sum", "gather"]


class Metric:
    """Base class. Subclasses fill ``self._states`` (name -> tensor) and ``self._reductions``."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._reductions: dict[str, Reduction] = {}

    def add_state(self, name: str, value: torch.Tensor, reduction: Reduction = "sum") -> None:
        """Declare a state. Sum-states must be int64 or float64 (counts never narrower)."""
        if reduction == "sum" and value.dtype not in (torch.int64, torch.float64):
            raise TypeError(f"sum-state {name!r} must be int64 or float64, got {value.dtype}")
        self._states[name] = value
        self._reductions[name] = reduction

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def states(self) -> dict[str, tuple[torch.Tensor, Reduction]]:
        """``{name: (tensor, reduction)}`` of the local states (the tensors themselves, not copies)."""
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
        merged = {}
        for name, value in self._states.items():
            parts = [value] + [o._states[name] for o in others]
            if self._reductions[name] == "sum":
                merged[name] = torch.stack(parts).sum(0)
            else:
                merged[name] = torch.cat(parts, 0)
        self.load_synced(merged)

    def compute(self) -> dict:
        raise NotImplementedError
