"""Durable progress (``eval.journal``) and resuming any run at any world size (``eval.resume=RUN_DIR``): the
rank's part.

While it evaluates, every rank closes a window (``disteval.metrics.window``) after ``eval.journal.every_batches``
batches or ``eval.journal.every_s`` seconds, whichever comes first, and after its last batch, and writes it
atomically to its journal folder (``disteval.job.journal``: the records' contract). A rank killed at any moment
loses at most the open window; a write that fails (a full disk) is logged, noted in the rank's status and
journaling stops, the evaluation goes on.

A rank of a run started with ``eval.resume=OLD_RUN_DIR`` takes the recorded windows that lie whole inside its
shard (``disteval.job.journal.recorded_windows``), evaluates only the batches no window covers
(``uncovered_batches``), and its evaluator adds each window in sample-id order (``Evaluator.schedule``), so the
metrics equal an uninterrupted run's at any world size.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from disteval.errors import ConfigError
from disteval.common import launch_env
from disteval.job.journal import (AUTO, check_resume, journal_dir, requeue_chain, resume_dir, resume_problem,
                                     write_manifest)
from disteval.metrics.window import Window
from disteval.rank.loop import LoopHook, LoopProgress

log = logging.getLogger("disteval.rank")


def recorded_windows(chain: list[Path], start: int, end: int) -> tuple[list[Window], list[str]]:
    """The recorded windows that lie whole inside samples ``[start, end)``, from every rank's journal of the
    runs in ``chain``, without overlaps (the first found is kept), and the problems met (a file that cannot be
    read or whose digest does not match: its batches are evaluated again). Pure reading, no collective."""
    found: list[Window] = []
    problems: list[str] = []
    for run_dir in chain:
        for path in sorted(Path(run_dir).glob("ranks/rank*/journal/*.pt")):
            try:
                a, b = (int(x) for x in path.stem.split("-"))
            except ValueError:
                continue
            if a < start or b > end:
                continue
            try:
                window = Window.from_tensors(torch.load(path, weights_only=True, map_location="cpu"))
            except Exception as exc:  # noqa: BLE001 - a torn or altered record is evaluated again, never trusted
                problems.append(f"{path}: {exc}")
                continue
            if (window.start, window.end) != (a, b):
                problems.append(f"{path}: holds samples [{window.start}, {window.end}), not its name's")
                continue
            found.append(window)
    kept: list[Window] = []
    for w in sorted(found, key=lambda w: (w.start, -w.end)):
        if kept and w.start < kept[-1].end:
            continue
        kept.append(w)
    return kept, problems


def uncovered_batches(start: int, end: int, batch_size: int, windows: list[Window]) -> list[tuple[int, int]]:
    """The batches ``[a, b)`` of samples ``[start, end)`` that no window covers: each gap between windows cut
    into batches of ``batch_size`` from its start (in bitwise mode shards and windows begin on the global
    batch grid, so these are the global batches). Raises ValueError for a window outside ``[start, end)``."""
    out, at = [], start
    for w in sorted(windows, key=lambda w: w.start):
        if w.start < at or w.end > end:
            raise ValueError(f"recorded window [{w.start}, {w.end}) is not inside [{at}, {end})")
        out += [(a, min(a + batch_size, w.start)) for a in range(at, w.start, batch_size)]
        at = w.end
    return out + [(a, min(a + batch_size, end)) for a in range(at, end, batch_size)]


class RankJournal:
    """A rank's journal: whether it records (``eval.journal`` and ``resume_problem``), the windows it resumes from
    (``eval.resume``) and what it did, for its row of results.json. ``ctx``: the rank's context; ``plan``: its
    ``RunPlan``. Raises ConfigError naming ``eval.resume`` for a resume
    of a run that cannot be resumed exactly or whose records are of another run (``check_resume``)."""

    def __init__(self, ctx: Any, plan: Any):
        cfg, self.ctx, self.plan = ctx.cfg, ctx, plan
        why = resume_problem(cfg)
        self.why_not = "eval.journal.enabled=false" if not cfg.eval.journal.enabled else why
        self.chain: list[Path] = []
        if resume_dir(cfg):
            if why is not None:
                raise ConfigError("eval.resume", f"this run cannot be resumed exactly: {why}")
            self.chain = check_resume(cfg, plan.num_samples)
        elif cfg.eval.resume == AUTO and why is None:  # a requeued job: its own records (the driver resolved others)
            self.chain = requeue_chain(ctx.run_dir, cfg, launch_env.job_id(), plan.num_samples)
        if self.why_not is None:  # every rank, before its first window: also on node-local run directories
            here = Path(ctx.run_dir).resolve()
            write_manifest(ctx.run_dir, cfg, plan.num_samples, launch_env.job_id(),
                           next((p for p in self.chain if p != here), None))
        self.hook: JournalHook | None = None
        self.problems: list[str] = []
        self.replayed = {"windows": 0, "samples": 0}

    def prepare(self, ev: Any, sources: dict, resume: bool = True) -> tuple[list[tuple[int, int]] | None, int]:
        """Give ``ev`` the other per-sample keepers whose rows windows carry (``sources``, ``Evaluator.sources``),
        schedule the recorded windows inside this rank's shard on it (unless ``resume`` is False: the rank resumed
        from a checkpoint) and return ``(batches, samples)``: the batches left to evaluate (None: no resume, the
        whole shard) and the samples the windows hold."""
        ev.sources.update(sources)
        if not self.chain or not resume:
            return None, 0
        start, end = self.plan.shard
        windows, self.problems = recorded_windows(self.chain, start, end)
        for problem in self.problems:
            log.warning("eval.resume: not using %s; its batches are evaluated again", problem)
        try:
            ev.schedule(windows)
        except ValueError as exc:
            raise ConfigError("eval.resume", f"the records in {self.chain[0]} do not fit this run: {exc}") from None
        self.replayed = ev.replayed
        return uncovered_batches(start, end, self.plan.batch_size, windows), sum(w.samples for w in windows)

    def begin(self, ev: Any, sources: dict, *, resume: bool, first: bool, mesh: Any = None
              ) -> tuple[list[tuple[int, int]] | None, int, list]:
        """A trial's start: ``prepare`` (``first`` trial only: later trials evaluate everything and record
        nothing) and the loop hooks that record ``ev``'s windows. ``mesh``: the rank's ``MeshRun``, whose tensor-
        parallel peers evaluate the same batches: only the first of them writes (the others read the same records
        when resumed). Returns ``(batches, samples recorded, hooks)``."""
        if not first:
            return None, 0, []
        batches, recorded = self.prepare(ev, sources, resume)
        if self.why_not is not None or (mesh is not None and mesh.groups.tp_rank != 0):
            return batches, recorded, []
        return batches, recorded, [self.hook_for(ev)]

    def hook_for(self, ev: Any) -> "JournalHook":
        """The loop hook that records ``ev``'s windows (only when ``why_not`` is None)."""
        jc = self.ctx.cfg.eval.journal
        self.hook = JournalHook(ev, journal_dir(self.ctx.run_dir, self.ctx.rank), int(jc.every_batches),
                                float(jc.every_s), self.ctx.status)
        return self.hook

    def record(self) -> dict:
        """This rank's ``journal`` row: recorded windows/samples/bytes/seconds or why not, the write error, the
        windows and samples resumed from the records and the records that were refused."""
        return {"recording": self.why_not is None, "why_not": self.why_not,
                "written": self.hook.written if self.hook else None, "error": self.hook.error if self.hook else None,
                "resumed_from": str(self.chain[0]) if self.chain else None, "replayed": dict(self.replayed),
                "refused": self.problems}


class JournalHook(LoopHook):
    """Writes this rank's windows (see the module): after a batch when ``every_batches`` batches or
    ``every_s`` seconds have passed since the last window, when the evaluator closed one before adding
    recorded windows, and before the evaluator finishes. ``status``: the rank's status writer (a failed write
    is noted as ``journal_error``)."""

    def __init__(self, evaluator: Any, folder: Path, every_batches: int, every_s: float, status: Any = None):
        self.ev, self.folder = evaluator, Path(folder)
        self.every_batches, self.every_s, self.status = int(every_batches), float(every_s), status
        self.ev.windows = True
        self.written = {"windows": 0, "samples": 0, "bytes": 0, "seconds": 0.0}
        self.error: str | None = None
        self._batches, self._since = 0, time.monotonic()

    def after_batch(self, progress: LoopProgress) -> None:
        self._batches += 1
        for window in self.ev.closed:
            self._write(window)
        self.ev.closed.clear()
        if self._batches >= self.every_batches or time.monotonic() - self._since >= self.every_s:
            self._flush()

    def before_finish(self, progress: LoopProgress) -> None:
        self._flush()

    def _flush(self) -> None:
        self._batches, self._since = 0, time.monotonic()
        window = self.ev.take_window()
        if window is not None:
            self._write(window)

    def _write(self, window: Window) -> None:
        if self.error is not None:
            return
        t0 = time.perf_counter()
        path = self.folder / f"{window.start:012d}-{window.end:012d}.pt"
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp_", suffix=".pt")
            os.close(fd)
            torch.save(window.to_tensors(), tmp)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self.error = f"{path}: {exc}"
            log.warning("eval.journal: could not write %s (%s); progress is no longer recorded, the evaluation "
                        "goes on", path, exc)
            if self.status is not None:
                self.status.update(journal_error=self.error, force=True)
            return
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        self.written["windows"] += 1
        self.written["samples"] += window.samples
        self.written["bytes"] += path.stat().st_size
        self.written["seconds"] += time.perf_counter() - t0


def journal_summary(rows: list[dict]) -> dict:
    """results.json ``journal`` from the ranks' rows of the first trial (the journal records and resumes the
    first pass of ``eval.trials``; later trials evaluate everything): recording or why not, where it resumed
    from, the samples recorded, added from records (``samples_resumed``) and evaluated, write errors and refused
    records."""
    parts = [r["journal"] for r in rows if r.get("journal")]
    if not parts:
        return {}
    resumed = sum(int(p["replayed"]["samples"]) for p in parts)
    return {"recording": parts[0]["recording"], "why_not": parts[0]["why_not"],
            "samples_recorded": sum(int((p["written"] or {}).get("samples", 0)) for p in parts),
            "windows_recorded": sum(int((p["written"] or {}).get("windows", 0)) for p in parts),
            "seconds_writing": max(float((p["written"] or {}).get("seconds", 0.0)) for p in parts),
            "resumed_from": parts[0]["resumed_from"], "samples_resumed": resumed,
            "samples_evaluated": sum(int(r["samples"]) for r in rows) - resumed,
            "errors": [p["error"] for p in parts if p["error"]], "refused": [x for p in parts for x in p["refused"]]}
