"""Sample-id coverage: proof that every id in [0, N) was counted exactly once across all ranks.

Each rank run-length encodes the ids it counted as half-open runs ``[start, end)`` of consecutive ids
(int64 [k, 2]); contiguous shards give one run per rank, so the gathered payload is tiny. A repeated id
starts a new run, so multiplicity is preserved. ``check_coverage`` sweeps the runs of all ranks and reports
missing and duplicated ids exactly, without materialising an array of size N.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from disteval.errors import CoverageError


def ids_to_runs(ids: np.ndarray) -> np.ndarray:
    """Sorted ids -> runs int64 [k, 2] of consecutive ids; equal neighbours start a new run (multiplicity)."""
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    if ids.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.nonzero(np.diff(ids) != 1)[0] + 1
    starts = ids[np.concatenate(([0], breaks))]
    ends = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    return np.stack([starts, ends], axis=1)


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Sort runs and join those that touch (end == next start); overlapping runs stay separate."""
    if len(runs) <= 1:
        return runs.reshape(-1, 2).astype(np.int64)
    runs = runs[np.lexsort((runs[:, 1], runs[:, 0]))]
    out = [list(runs[0])]
    for s, e in runs[1:]:
        if s == out[-1][1]:
            out[-1][1] = e
        else:
            out.append([s, e])
    return np.asarray(out, dtype=np.int64)


class SampleIdCoverage:
    """Accumulates the sample ids a rank counted. ``runs()`` returns int64 [k, 2] for gathering."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def update(self, sample_ids: torch.Tensor) -> None:
        """sample_ids: int64 [B]."""
        if sample_ids.numel():
            self._runs.append(ids_to_runs(sample_ids.cpu().numpy()))
            if len(self._runs) > 256:  # keep memory bounded for long shards
                self._runs = [merge_runs(np.concatenate(self._runs))]

    def update_runs(self, runs: torch.Tensor) -> None:
        """Add ids given as runs int64 [k, 2] of [start, end) (a checkpoint's coverage)."""
        if runs.numel():
            self._runs.append(runs.cpu().numpy().astype(np.int64).reshape(-1, 2))

    def runs(self) -> torch.Tensor:
        if not self._runs:
            return torch.zeros((0, 2), dtype=torch.int64)
        return torch.from_numpy(merge_runs(np.concatenate(self._runs)))


@dataclass
class CoverageReport:
    """Outcome of ``check_coverage``: counts of ids in [0, N) seen 0 times (missing) and more than once
    (duplicated, with ``extra_counts`` the surplus), ids outside [0, N), and the first few of each."""

    num_samples: int
    missing: int = 0
    duplicated: int = 0
    extra_counts: int = 0
    out_of_range: int = 0
    first_missing: list[int] = field(default_factory=list)
    first_duplicated: list[int] = field(default_factory=list)
    first_out_of_range: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.out_of_range)

    def message(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{self.missing} sample id(s) missing (first: {self.first_missing})")
        if self.duplicated:
            parts.append(f"{self.duplicated} sample id(s) counted more than once, {self.extra_counts} extra "
                         f"count(s) (first: {self.first_duplicated})")
        if self.out_of_range:
            parts.append(f"{self.out_of_range} id(s) outside [0, {self.num_samples}) "
                         f"(first: {self.first_out_of_range})")
        return f"coverage check failed for N={self.num_samples}: " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {"num_samples": self.num_samples, "missing": self.missing, "duplicated": self.duplicated,
                "out_of_range": self.out_of_range, "ok": self.ok}


def _first_ids(starts: np.ndarray, ends: np.ndarray, limit: int) -> list[int]:
    out: list[int] = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        out.extend(range(s, min(e, s + limit - len(out))))
        if len(out) >= limit:
            break
    return out


def check_coverage(runs: np.ndarray | torch.Tensor, num_samples: int, first: int = 5) -> CoverageReport:
    """Sweep the runs (int64 [k, 2], any order, from all ranks) over [0, N).

    Cost O(k log k), independent of N. Returns a CoverageReport; see ``raise_if_incomplete``.
    """
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    n = int(num_samples)
    rep = CoverageReport(num_samples=n)
    points = np.unique(np.concatenate([runs.ravel(), [0, n]]))
    delta = np.zeros(points.size, dtype=np.int64)
    np.add.at(delta, np.searchsorted(points, runs[:, 0]), 1)
    np.add.at(delta, np.searchsorted(points, runs[:, 1]), -1)
    depth = np.cumsum(delta)[:-1]  # depth on segment [points[i], points[i+1])
    seg_s, seg_e = points[:-1], points[1:]
    inside = (seg_s >= 0) & (seg_e <= n)
    lengths = seg_e - seg_s
    miss = inside & (depth == 0)
    dup = inside & (depth > 1)
    oor = ~inside & (depth > 0)
    rep.missing = int(lengths[miss].sum())
    rep.duplicated = int(lengths[dup].sum())
    rep.extra_counts = int((lengths[dup] * (depth[dup] - 1)).sum())
    rep.out_of_range = int((lengths[oor] * depth[oor]).sum())
    rep.first_missing = _first_ids(seg_s[miss], seg_e[miss], first)
    rep.first_duplicated = _first_ids(seg_s[dup], seg_e[dup], first)
    rep.first_out_of_range = _first_ids(seg_s[oor], seg_e[oor], first)
    return rep


def raise_if_incomplete(report: CoverageReport) -> None:
    """Raise CoverageError with the report's message unless every id was counted exactly once."""
    if not report.ok:
        raise CoverageError(report.message())
