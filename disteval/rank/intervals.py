"""``eval.ci``: a rank's part in the confidence intervals of a run. Either every rank keeps per-sample rows
(``Task.sample_columns``: one ``SampleStatsHook`` in the loop, one per checkpoint of a ``model.checkpoints`` job)
that rank 0 gathers and resamples (``disteval.metrics.bootstrap``), or rank 0 keeps the synchronised metric and
asks the task (``Task.confidence_intervals``). Computed after results.json holds the metrics, so that a long
bootstrap interrupted (Ctrl-C, a time limit) loses none of them."""
from __future__ import annotations

import time
from typing import Any

import torch

from disteval.metrics.bootstrap import CI_PROBS_MAX_CLASSES, intervals
from disteval.rank import model_set
from disteval.rank.predictions import SampleStatsHook
from disteval.rank.sync import in_collective


class Intervals:
    """The intervals of one rank's run. ``ctx``: the rank's context (config ``eval.ci``, comm, status, rank);
    ``task``: the run's Task; ``members``: the checkpoints of a ``model.checkpoints`` job (empty otherwise)."""

    def __init__(self, ctx: Any, task: Any, members: list):
        self.ctx, self.task, self.members = ctx, task, members
        self.ci = ctx.cfg.eval.ci
        cols = task.sample_columns() if int(self.ci.resamples) > 0 else None
        self.stats: Any = None  # the loop hook keeping per-sample rows (first trial only)
        self.metric: Any = None  # rank 0's synchronised metric, for Task.confidence_intervals
        if cols is not None:
            self.stats = (model_set.MemberHooks({m.name: SampleStatsHook(cols) for m in members})
                          if members else SampleStatsHook(cols))

    def sources(self) -> dict:
        """The per-sample keepers whose rows the journal's windows carry (``Evaluator.sources``): this rank's
        ``SampleStatsHook``, one per checkpoint of a set; {} when no rows are kept."""
        if self.stats is None:
            return {}
        return {f"sample_stats:{n}": h for n, h in self.stats.hooks.items()} if self.members else \
            {"sample_stats": self.stats}

    def keep(self, metric: Any) -> None:
        """Rank 0, first trial: keep the synchronised metric when the task computes its own intervals."""
        if int(self.ci.resamples) > 0 and self.stats is None and self.metric is None:
            self.metric = metric

    def compute(self) -> dict | None:
        """The intervals: {metric: interval, seconds, ...}, or {checkpoint name: ...} for a job of several
        checkpoints; None off rank 0 and when ``eval.ci`` is off. A collective when per-sample rows are kept:
        every rank must call it."""
        if self.stats is not None:
            if not self.members:
                return self._of_rows(self.stats)
            out = {name: self._of_rows(hook) for name, hook in self.stats.hooks.items()}
            return out if self.ctx.rank == 0 else None
        if self.metric is None:
            return None
        return ({n: self._of_task(m) for n, m in self.metric.metrics.items()} if self.members
                else self._of_task(self.metric))

    def _of_rows(self, stats: SampleStatsHook) -> dict | None:
        """Every rank's per-sample rows to rank 0 (one gather), which computes the bootstrap intervals; None on
        the other ranks."""
        ctx, ci = self.ctx, self.ci
        with in_collective(ctx.status, "bootstrap_gather"):
            parts = ctx.comm.gather_variable(stats.rows(), dst=0) if ctx.world_size > 1 else [stats.rows()]
        if parts is None:
            return None
        t0 = time.perf_counter()
        out = intervals(torch.cat(parts).numpy(), stats.cols, int(ci.resamples), float(ci.level), int(ci.seed))
        if "ranking" in ctx.cfg.eval.metrics and not stats.cols.probs:
            out["not_computed"] = [f"auroc_macro: {self.task.num_classes} classes (the interval gathers every "
                                   f"sample's probabilities, done up to {CI_PROBS_MAX_CLASSES} classes)"]
        out["seconds"] = time.perf_counter() - t0
        return out

    def _of_task(self, metric: Any) -> dict | None:
        """``Task.confidence_intervals`` of one synchronised metric, with its seconds."""
        t0 = time.perf_counter()
        out = self.task.confidence_intervals(metric, int(self.ci.resamples), float(self.ci.level), int(self.ci.seed))
        return None if out is None else dict(out, seconds=time.perf_counter() - t0)
