"""Rank 0's results.json from a finished ``RankRun``: the trials combined, the per-rank rows, coverage,
outliers and exclusion, warnings, the prediction store's record and, for a job of several checkpoints, one
record per checkpoint. The record's shape is ``disteval.job.records.build_results``'s (the contract with the
doctor); this module fills it from the rank's parts. ``run`` is always the rank's
``disteval.rank.engine.RankRun``."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from disteval.common import allocator, startup
from disteval.common.fingerprint import numeric_classes
from disteval.errors import CoverageError
from disteval.job.records import build_results, read_status, write_results
from disteval.metrics import check_coverage
from disteval.metrics.robust import summarize_trials
from disteval.models.checkpoint_set import with_checkpoint
from disteval.rank import model_set
from disteval.rank.bootstrap import say
from disteval.rank.canary import describe
from disteval.rank.journal import journal_summary
from disteval.rank.predictions import store_record, weights_digest

log = logging.getLogger("disteval.rank")


def timings(load: float, sync: float, t_total: float, after_loop: float = 0.0) -> dict:
    """results.json ``timings`` (seconds): load, sync, after_loop (the task's work between the loop and the
    synchronisation, ``Task.after_loop``: an embedding task's sharded search; 0 for most tasks);
    ``evaluation_s`` = rank 0's bootstrap, load, forward and sync (from this rank's start after its imports,
    ``t_total`` on the perf_counter clock, to now), also kept as ``total``; ``process_wall_s`` = the whole
    run's wall time, from the start of the job's driver process (``python -m disteval``; a later job of a
    multirun in one process: its own start) to now, None when the driver did not pass its start
    (``DISTEVAL_T0``)."""
    evaluation = time.perf_counter() - t_total
    return {"load": load, "sync": sync, "after_loop": after_loop, "total": evaluation, "evaluation_s": evaluation,
            "process_wall_s": startup.seconds_since_start()}


def exclusion_record(run: Any, drop: list[int], kept_runs, rows: list[dict], all_metrics: dict) -> dict:
    """What ``eval.exclude_outlier_ranks`` left out: ranks, hosts, their shards and sample count, and the
    metrics with every rank. Raises CoverageError if the kept ids are not exactly the other ranks' shards."""
    fields = {int(r["rank"]): r for r in rows}
    left = sum(int(fields[r]["samples"]) for r in drop)
    n = len(run.dataset)
    cov = check_coverage(kept_runs, n)
    if cov.duplicated or cov.out_of_range or cov.missing != left:
        raise CoverageError(f"after excluding outlier ranks {drop}: expected exactly {left} ids left "
                            f"out, {cov.message()}")
    return {"ranks": list(drop), "hosts": [(read_status(run.ctx.run_dir, r) or {}).get("host") for r in drop],
            "shards": [[int(fields[r]["start"]), int(fields[r]["end"])] for r in drop],
            "samples_left_out": left, "samples_kept": n - left, "metrics_all_ranks": all_metrics}



def finish(run: Any, t_total: float) -> dict | None:
    """``RankRun.finish``. On rank 0: combine trials, write results.json, print; warn about fault drills that never fired."""
    ctx, cfg, outcomes = run.ctx, run.ctx.cfg, run.outcomes
    for fault in run.faults.unfired():
        log.warning("%s=%s: %s after batch %d never fired: this rank had %d batches", "DISTEVAL_FAULTS",
                    os.environ.get("DISTEVAL_FAULTS"), fault.kind, int(fault.params.get("batch", 1)),
                    outcomes[-1]["batches"])
    if ctx.rank != 0:
        return None
    last = outcomes[-1]
    metrics, trial_summary = summarize_trials([o["metrics"] for o in outcomes], cfg.eval.trial_aggregate,
                                              float(cfg.eval.clip_sigma))
    record = {"run_dir": ctx.run_dir, "world_size": ctx.world_size, "num_samples": len(run.dataset),
           "dataset": run.task.describe(), "task": dict(run.task.identity(), main_metric=run.task.main_metric(metrics),
                                                             lower_is_better=run.task.lower_is_better(metrics)),
           "model_class": type(run.model).__name__ if run.model is not None else None, "coverage": last["coverage"],
           "comm": run.mesh.comm_stats(ctx.comm) if run.mesh else ctx.comm.stats(),
           "backend": ctx.backend, "device": str(ctx.device), "compute": ctx.compute,
           # each rank's host/node/interface/address from its record (its file, or the rendezvous store when
           # the run directory is node-local), not from the synchronised rows: the rows' bytes stay the same
           # in every node layout
           "net": {r: ((ctx.read_peer(r) or {}).get("net") if r else ctx.net) for r in range(ctx.world_size)},
           "timings": timings(run.seconds_load, sum(o["seconds_sync"] for o in outcomes), t_total,
                               sum(o["seconds_after_loop"] for o in outcomes))}
    results = build_results(cfg, record, last["rows"], metrics, extra={
        "sampler": run.plan.sampler, "exact": last["coverage"].ok, "trials": trial_summary if len(outcomes) > 1 else None,
        "outliers": last["outliers"], "exclusion": last["exclusion"], "warnings": warnings_of(run, last["rows"]),
        "allocator": allocator.summarize([r.get("allocator") for r in last["rows"]]),
        "numeric_classes": numeric_classes({int(r["rank"]): r["fingerprint"] for r in last["rows"]
                                            if r.get("fingerprint")}),
        "canary": run.canary, "confidence_intervals": None,  # added after this write (add_intervals)
        "filesystem": ctx.filesystem, "journal": journal_summary(outcomes[0]["rows"]),
        **({"parallel": run.mesh.record()} if run.mesh else {}),
        **decode_errors(run, last["rows"])})
    if run.store is not None:
        results["predictions"] = store_record_of(run, [r["predictions"] for r in last["rows"]])
    if run.members:
        return finish_members(run, results)
    write_results(ctx.run_dir, results)  # the driver presents it (disteval.job.run_report.present_results)
    return results


def store_record_of(run: Any, entries: list[dict]) -> dict:
    """The store's manifest(s) and results.json ``predictions``; a job of several checkpoints has one store
    per checkpoint under ``checkpoints/<name>/`` ({name: record})."""
    cfg, run_dir = run.ctx.cfg, Path(run.ctx.run_dir)

    def identity(net) -> dict:
        return {"task": run.task.name, "num_samples": len(run.dataset), "weights_digest": weights_digest(net),
                "num_classes": getattr(run.task, "num_classes", None),
                "columns": [f"{f.name}: {f.type}" for f in run.task.prediction_schema()]}
    if not run.members:
        return store_record(run_dir, cfg, identity(run.model), entries)
    return {m.name: store_record(run_dir / model_set.RESULTS_DIR / m.name, with_checkpoint(cfg, m.path),
                                 identity(run.model.members[m.name]), [e[m.name] for e in entries])
            for m in run.members}


def finish_members(run: Any, results: dict) -> dict:
    """A job of several checkpoints: each member's results.json, the job's with ``checkpoints`` blocks
    (``disteval.rank.model_set``), each member's metrics on the console and the table of all."""
    nets = run.model.members
    results.pop("checkpoints", None)  # a second write (add_intervals): each member's record is its own
    results["model"]["class"] = type(next(iter(nets.values()))).__name__
    blocks = model_set.write_member_results(results, run.members, {m: weights_digest(n) for m, n in nets.items()})
    results["checkpoints"] = [{k: v for k, v in b.items() if k != "own"} for b in blocks]
    results["task"]["lower_is_better"] = sorted({k for b in blocks for k in run.task.lower_is_better(b["metrics"])})
    write_results(run.ctx.run_dir, results)
    return results


def decode_errors(run: Any, rows: list[dict]) -> dict:
    """Streamed data: ``decode_errors`` {policy, skipped, evaluated, samples ("N of M samples"), ids
    [[shard, key], ...]} for results.json, and a console line when samples were skipped. {} otherwise."""
    if not run.streamed:
        return {}
    skipped = sorted(int(p) for r in rows for p in r.get("skipped", []))
    n = len(run.dataset)
    if skipped:
        say(run.ctx, f"{len(skipped)} of {n} samples did not decode and were skipped "
                       f"(data.on_decode_error=skip; ids in results.json decode_errors)")
    return {"decode_errors": {"policy": str(run.ctx.cfg.data.on_decode_error), "skipped": len(skipped),
                              "evaluated": n - len(skipped), "samples": f"{n - len(skipped)} of {n} samples",
                              "ids": [list(run.dataset.sample_name(p)) for p in skipped]}}


def warnings_of(run: Any, rows: list[dict]) -> list[str]:
    """What the user should know although the run succeeded: the preflight's notes (an empty predictions
    file, ineffective settings, a rebuilt cache file), the task's (``Task.run_warnings``: zero embeddings)
    and ranks that had nothing to evaluate (W > N, or fewer global batches than ranks in bitwise mode)."""
    out = [str(n) for n in run.ctx.cfg.preflight_notes] + list(run.task.run_warnings())
    malloc = allocator.summarize([r.get("allocator") for r in rows])
    if malloc and malloc.get("warning"):
        out.append(malloc["warning"])
    classes = numeric_classes({int(r["rank"]): r["fingerprint"] for r in rows if r.get("fingerprint")})
    canary = run.canary or {}
    if canary.get("homogeneous") is False:
        out.append(f"the metrics depend on the placement of samples: {describe(canary)} (results.json canary; "
                   "dist.heterogeneous=pin runs every rank on the common kernels)")
    elif len(classes) > 1:
        out.append(f"the ranks ran different kernels ({len(classes)} numeric classes: " + "; ".join(
            f"ranks {c['ranks']}" + (f" differ in {', '.join(c['differs'])}" if c.get("differs") else "")
            for c in classes) + "): float metrics may depend on which samples each rank evaluated "
            "(results.json numeric_classes)" + ("; the canary's probe batch gave the same bits on every rank"
                                                if canary.get("homogeneous") else ""))
    idle = [int(r["rank"]) for r in rows if int(r["samples"]) == 0]
    if idle:
        out.append(f"rank(s) {idle} of {run.ctx.world_size} had nothing to evaluate (N={len(run.dataset)} "
                   f"samples{', in whole batches of ' + str(run.ctx.cfg.data.batch_size) if run.plan.bitwise else ''}"
                   f"): they only took part in the synchronisation; fewer ranks would do")
    return out
