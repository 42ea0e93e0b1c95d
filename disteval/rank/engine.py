"""A whole rank of ``python -m disteval``: bootstrap, the task's dataset/model/metric, the loop, one
synchronisation per trial, and on rank 0 the coverage check, results.json and the console.

``run_rank`` runs one rank; ``worker_entry`` is what torch.distributed.elastic starts in each local rank.
The pieces live in their own modules: ``bootstrap`` (process group, records, compute settings), ``loop``
(the per-batch loop and its hooks), ``sync`` (the synchronisation protocol), ``peers`` (rank 0 watching the
others), ``records`` (results.json), ``report`` (console), ``tasks`` (what is evaluated).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from disteval.rank import model_set
from disteval import precision as prec
from disteval.job import report
from disteval.rank.bootstrap import RankContext, apply_compute_settings, connect, log, open_records
from disteval.comm import RankEnv, destroy_process_group
from disteval.common import allocator, launch_env, startup
from disteval.common.fingerprint import numeric_classes, rank_fingerprint
from disteval.common.liveness import beat_interval, heartbeat_timeout, heartbeat_timeout_key
from disteval.common.ranges import batch_aligned_bounds, shard_bounds
from disteval.errors import ConfigError, CoverageError, NumericDriftError
from disteval.rank.canary import Canary, describe, pin_cpu_kernels, probe_inputs, settle
from disteval.config import JobConfig, job_config
from disteval.config import heterogeneous_policy as policy
from disteval.faults import FaultPlan, apply_at_start
from disteval.rank.loop import CallbackHook, FaultHook, GuardHook, ShardSpec, StatusHook, evaluate_shard, pipeline_record
from disteval.metrics import check_coverage, raise_if_incomplete
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.robust import rank_outliers, summarize_trials
from disteval.models.fastpath import as_channels_last, prepare_model
from disteval.rank.parallel import MeshRun, dims_from_config, first_inputs, parallel_model
from disteval.rank.peers import PeerFailedError, PeerWatch
from disteval.metrics.bootstrap import CI_PROBS_MAX_CLASSES, intervals
from disteval.models.checkpoint_set import with_checkpoint
from disteval.rank.predictions import PredictionHook, SampleStatsHook, store_record, weights_digest
from disteval.job.records import (atomic_write_json, build_results, config_digest, rank_dir, read_status, relay_records,
                              write_results)
from disteval.rank.resume import CHECKPOINT, PreemptionGuard, load_checkpoint, save_checkpoint
from disteval.rank.sync import SyncPolicy, check_tp_peers, synchronise
from disteval.tasks import resolve_task
from disteval.rank.watchdog import Watchdog, parent_to_watch, record_driver_death

__all__ = ["PeerFailedError", "RankRun", "run_rank", "worker_entry"]



class RankRun:
    """One rank's run of a job: built by ``run_rank`` after bootstrap; ``trial()`` evaluates and synchronises
    once, ``finish()`` writes results on rank 0."""

    def __init__(self, ctx: RankContext):
        self.ctx, cfg = ctx, ctx.cfg
        t_load = time.perf_counter()
        ctx.status.update(phase="data")
        _say(ctx, f"rank 0 of {ctx.world_size} up (process group joined); loading data and model")
        self.task = resolve_task(cfg)(cfg)
        self.task.join(ctx.rank, _share(ctx) if ctx.world_size > 1 else None)
        self.dataset = self.task.dataset()
        self.streamed = self.task.streamed  # tar shards planned per rank (Task.streamed): no mesh, positions resumed
        # dist.parallel: a device mesh
        self.mesh = MeshRun(ctx) if dims_from_config(cfg, ctx.world_size) is not None else None
        # model.checkpoints: several networks on the same batches, the files rank 0's glob found (one broadcast)
        self.members = model_set.members_of(cfg, ctx.comm if ctx.world_size > 1 else None)
        self.model = self._build_model()
        self.faults = FaultPlan(ctx.rank)
        self.allocator = allocator.rank_record(str(cfg.dist.allocator))  # what is really in force
        if self.faults and self.model is not None:
            self.faults.on_model(self.model)
        self.fingerprint = rank_fingerprint(ctx.device, str(cfg.precision.model_dtype), self.allocator.get("in_force"))
        self.seconds_load = time.perf_counter() - t_load
        _say(ctx, f"data and model loaded in {self.seconds_load:.1f} s; evaluating {len(self.dataset)} samples")
        self.bitwise = ctx.compute["mode"] == "bitwise"
        self.sampler = str(cfg.data.sampler)
        self.policy = SyncPolicy.from_config(cfg.communication)
        n, b = len(self.dataset), int(cfg.data.batch_size)
        # the data is split over the data-parallel ranks: all ranks without a mesh, dp ranks under one
        self.dp_rank, self.dp_size = (self.mesh.dp_rank, self.mesh.dp_size) if self.mesh else (ctx.rank, ctx.world_size)
        self.shard = (batch_aligned_bounds(n, b, self.dp_size, self.dp_rank) if self.bitwise
                      else shard_bounds(n, self.dp_size, self.dp_rank))
        if self.mesh and self.streamed:
            raise ConfigError("dist.parallel", "a device mesh needs a map-style dataset, not a streamed one")
        self.dummy_steps = self.mesh.lockstep(n, b, self.bitwise) if self.mesh else 0
        if self.mesh:
            ctx.status.update(parallel=self.mesh.status_record(), force=True)
        # preemption: resume from this rank's checkpoint, and write one when the scheduler signals the job
        # (single-trial exact runs only: a checkpoint holds one pass over one exact shard)
        self.ckpt_path = rank_dir(ctx.run_dir, ctx.rank) / CHECKPOINT
        self.ckpt_key = {"config": config_digest(cfg), "world_size": ctx.world_size, "rank": ctx.rank,
                         "shard": list(self.shard), "job": launch_env.job_id()}
        # streamed data in fast mode with several loader workers: their positions are not one count per rank
        fast_multi_worker_stream = (self.streamed and not self.bitwise
                                    and int(cfg.data.num_workers) > 1)
        # (not under a mesh: a resumed rank would skip batches its FSDP/TP peers still run)
        self.resumable = (int(cfg.eval.trials) == 1 and self.sampler == "exact" and not fast_multi_worker_stream
                          and self.mesh is None)
        self.outcomes: list[dict] = []
        self.skipped_before: list[int] = []  # streamed data: positions skipped before a resume
        self.canary: dict | None = None
        self.store = self._store()
        cols = self.task.sample_columns() if int(cfg.eval.ci.resamples) > 0 else None
        self.stats = None
        self.ci_metric = None  # rank 0's synchronised metric whose Task.confidence_intervals come after results.json
        if cols is not None:  # per-sample rows for the intervals, one set per checkpoint of a model.checkpoints job
            self.stats = (model_set.MemberHooks({m.name: SampleStatsHook(cols) for m in self.members})
                          if self.members else SampleStatsHook(cols))

    def _build_model(self) -> torch.nn.Module | None:
        """The task's network (on a device mesh when ``dist.parallel`` is set), or a ``ModelSet`` of one
        network per ``model.checkpoints`` member; channels-last / compiled as configured; None for replays."""
        cfg, device = self.ctx.cfg, self.ctx.device

        def prepare(net: torch.nn.Module) -> torch.nn.Module:
            return prepare_model(net, channels_last=bool(cfg.model.channels_last),
                                 compile=bool(cfg.eval.compile),
                                 compile_mode=str(cfg.eval.compile_mode),
                                 compile_backend=str(cfg.eval.compile_backend))
        if self.members:
            return model_set.build_models(self.task, self.members, device, prepare)
        model = self.task.model(device)
        if self.mesh is not None and model is not None:
            model = parallel_model(model, self.mesh.groups)
        return prepare(model) if model is not None else None

    def _store(self) -> PredictionHook | None:
        """The prediction store's hook (``eval.save_predictions=true`` for a task with a store schema,
        ``Task.prediction_schema``), else None."""
        schema = self.task.prediction_schema() if self.ctx.cfg.eval.save_predictions else None
        if schema is None:
            return None
        if self.members:
            return model_set.MemberHooks({m.name: PredictionHook(str(model_set.member_dir(self.ctx.run_dir, m)),
                                                                 self.ctx.rank, schema, self.task.prediction_columns)
                                          for m in self.members})
        return PredictionHook(self.ctx.run_dir, self.ctx.rank, schema, self.task.prediction_columns)

    def check_canary(self) -> dict:
        """The canary before the loop (``disteval.rank.canary``): the dataset's first ``dist.canary_samples`` samples
        (one whole batch under ``eval.compile``: the loop's shape) through the model on every rank, digests
        compared in one all_gather, ``dist.heterogeneous`` applied. Returns the record for results.json
        ``canary`` ({skipped: why} without a model, on streamed data, under a device mesh, or when off). Raises
        NumericDriftError (refuse, or pin that cannot make the ranks agree)."""
        ctx, cfg = self.ctx, self.ctx.cfg
        samples = int(cfg.data.batch_size) if cfg.eval.compile else int(cfg.dist.canary_samples)
        skip = ("dist.canary_samples=0" if samples == 0 else "no model (replayed predictions)" if self.model is None
                else "streamed data (no sample every rank can read)" if self.streamed
                else "a device mesh (its ranks compute one forward together)" if self.mesh else
                "an empty dataset" if len(self.dataset) == 0 else None)
        if skip:
            self.canary = {"skipped": skip}
            return self.canary
        step, collate = self._step(), self.task.collate_fn()
        canary = Canary(lambda: step(self.model, probe_inputs(self.dataset, collate, samples)),
                        min(samples, len(self.dataset)),
                        ctx.comm if ctx.world_size > 1 else None,
                        lambda: {"fingerprint": self.fingerprint, "host": ctx.status.record.get("host"),
                                 "node": (ctx.net or {}).get("node")})
        ctx.status.update(in_collective={"op": "canary", "since": time.time()}, force=True)
        try:
            self.canary = settle(canary, policy(cfg), ctx.device)
        except NumericDriftError as exc:  # the doctor reads the classes from the record of the run that stopped
            ctx.status.update(canary=dict(exc.record, policy=policy(cfg)), force=True)
            raise
        finally:
            ctx.status.update(in_collective=None)
        if self.canary.get("pinned_cuda"):  # the CUDA settings changed: record them as now in force
            self.fingerprint = rank_fingerprint(ctx.device, str(cfg.precision.model_dtype), self.allocator.get("in_force"))
        if ctx.cpu_kernels:
            self.canary["cpu_kernels"] = ctx.cpu_kernels
        if not self.canary.get("homogeneous", True):
            _say(ctx, f"warning: {describe(self.canary)} (dist.heterogeneous={self.canary['policy']})")
        return self.canary

    def evaluator(self) -> Evaluator:
        """A fresh evaluator of the task's metric (one per trial), its states on the model's device when the
        metric adds batches there without host synchronisation (``Metric.device_resident``)."""
        metric = model_set.member_metrics(self.task, self.members) if self.members else self.task.metric()
        if metric.device_resident:
            metric.to(self.ctx.device)
        return Evaluator(metric, bitwise=self.bitwise, record_batches=bool(self.ctx.cfg.eval.record_batches))

    def _spec(self, skip: int) -> ShardSpec:
        cfg, collate = self.ctx.cfg, self.task.collate_fn()
        return ShardSpec(self.dp_rank, self.dp_size, int(cfg.data.batch_size), aligned=self.bitwise,
                         sampler=self.sampler, skip=skip, num_workers=int(cfg.data.num_workers),
                         collate_fn=self.faults.loader_collate(collate),
                         pin_memory=self.ctx.device.type == "cuda" and collate is None,
                         device=self.ctx.device, prefetch_factor=int(cfg.data.prefetch_factor),
                         persistent_workers=bool(cfg.data.persistent_workers) and int(cfg.eval.trials) > 1,
                         warmup=bool(cfg.eval.compile),
                         loader_timeout_s=cfg.data.loader_timeout_s,
                         skipped=list(self.skipped_before) if skip else [], dummy_steps=self.dummy_steps,
                         dummy_inputs=first_inputs(self.dataset, collate) if self.dummy_steps else None)

    def _resume(self, ev: Evaluator) -> int:
        ckpt = load_checkpoint(self.ckpt_path, self.ckpt_key) if self.resumable and not self.outcomes else None
        if ckpt is None:
            return 0
        ev.load_state_dict(ckpt["state"])
        self.skipped_before = [int(i) for i in ckpt["state"].get("stream_skipped", [])]
        log.info("resuming from %s: %d of %d samples already counted", self.ckpt_path, ckpt["samples_done"],
                 self.shard[1] - self.shard[0])
        return int(ckpt["samples_done"])

    def _hooks(self, progress_display, guard) -> list:
        ctx = self.ctx
        hooks = [StatusHook(ctx.status)]
        if ctx.rank == 0 and ctx.world_size > 1:
            watch = PeerWatch(ctx.run_dir, ctx.world_size, float(ctx.cfg.communication.timeout_s), progress_display,
                              started=ctx.status.record["t_start"])
            watch.read = ctx.read_peer
            if int(ctx.cfg.data.num_workers) > 0:  # a peer waiting for its workers is left to their timeout
                watch.loader_timeout_s = ctx.cfg.data.loader_timeout_s
            if ctx.filesystem == "node-local":  # the other nodes' records, copied into this node's run directory
                watch.relay_to = (ctx.run_dir, ctx.net["node"])
            self.watch = watch
            hooks.append(CallbackHook(lambda p: watch.maybe_check()))
        else:
            self.watch = None
            hooks.append(CallbackHook(lambda p: progress_display.refresh_from([{"samples_done": p.samples}])))
        if guard is not None:
            hooks.append(GuardHook(guard))
        hooks.append(FaultHook(self.faults))
        if self.store is not None and not self.outcomes:  # the first trial's predictions
            hooks.append(self.store)
        if self.stats is not None and not self.outcomes:
            hooks.append(self.stats)
        return hooks

    def _step(self):
        ctx = self.ctx
        channels_last = bool(ctx.cfg.model.channels_last)

        def step(model, inputs):
            if channels_last:
                inputs = as_channels_last(inputs)
            with prec.autocast(ctx.cfg.precision, ctx.device):
                return self.task.step(model, inputs, ctx.device)
        return model_set.member_step(step) if self.members else step

    @staticmethod
    def _checkpoint_state(ev: Evaluator, progress) -> dict:
        """The evaluator's state, plus (streamed data) the positions skipped so far, so that a resumed run
        still lists them in results.json."""
        return {**ev.state_dict(), "stream_skipped": torch.tensor(progress.skipped, dtype=torch.int64)}

    def trial(self) -> dict:
        """Evaluate the shard, synchronise, check coverage, find outlier ranks and (opt-in) synchronise once
        more without the excludable ones. Returns {metrics (rank 0), coverage, rows, outliers, exclusion,
        excluded, batches, seconds_forward, seconds_sync}."""
        ctx, cfg = self.ctx, self.ctx.cfg
        ev = self.evaluator()
        skip = self._resume(ev)
        guard = PreemptionGuard(lambda: save_checkpoint(self.ckpt_path, self._checkpoint_state(ev, guard.progress),
                                                        guard.progress.samples, self.ckpt_key)) if self.resumable else None
        display = report.GlobalProgress(len(self.dataset), enabled=ctx.rank == 0 and cfg.eval.progress)
        with display:
            with guard if guard is not None else contextlib.nullcontext():  # a checkpoint never holds synced states
                progress = evaluate_shard(self.model, self.dataset, ev, self._spec(skip), step=self._step(),
                                          hooks=self._hooks(display, guard))
            ctx.status.update(phase="sync", samples_done=progress.samples, batches_done=progress.batches, force=True)
            self.faults.on_sync()
            if self.watch:
                self.watch.wait_all_in_sync()
            seconds_after_loop = self._after_loop(ev)
            out = self._synchronise(ev, progress)
            out["seconds_after_loop"] = seconds_after_loop
            display.finish()
        return out

    def add_intervals(self, results: dict | None) -> None:
        """``eval.ci``: the bootstrap intervals, computed after results.json holds the metrics (``finish``), so
        that a long bootstrap interrupted (Ctrl-C, a time limit) loses none of them; rank 0 then rewrites
        results.json (and each checkpoint's) with ``confidence_intervals``. Every rank calls it: the per-sample
        rows are gathered to rank 0 (a collective)."""
        ci = self.ctx.cfg.eval.ci
        if self.stats is not None:
            got = self._intervals()
        elif self.ci_metric is not None:
            got = self._task_intervals(self.ci_metric, ci)
        else:
            return
        if self.ctx.rank != 0 or results is None or got is None:
            return
        results["confidence_intervals"] = got
        if self.members:
            self._finish_members(results)
        else:
            write_results(self.ctx.run_dir, results)

    def _intervals(self) -> dict | None:
        """The bootstrap intervals of the per-sample rows (``_intervals_of``); {name: intervals} for the
        checkpoints of a ``model.checkpoints`` job (one gather each, in the set's order); None off rank 0."""
        if not self.members:
            return self._intervals_of(self.stats)
        out = {name: self._intervals_of(hook) for name, hook in self.stats.hooks.items()}
        return out if self.ctx.rank == 0 else None

    def _intervals_of(self, stats: SampleStatsHook) -> dict | None:
        """Every rank's per-sample rows to rank 0 (one gather), which computes the bootstrap intervals
        (``disteval.metrics.bootstrap``); None on the other ranks."""
        ctx, ci = self.ctx, self.ctx.cfg.eval.ci
        ctx.status.update(in_collective={"op": "bootstrap_gather", "since": time.time()}, force=True)
        try:
            parts = ctx.comm.gather_variable(stats.rows(), dst=0) if ctx.world_size > 1 else [stats.rows()]
        finally:
            ctx.status.update(in_collective=None)
        if parts is None:
            return None
        t0 = time.perf_counter()
        out = intervals(torch.cat(parts).numpy(), stats.cols, int(ci.resamples), float(ci.level), int(ci.seed))
        if "ranking" in self.ctx.cfg.eval.metrics and not stats.cols.probs:
            out["not_computed"] = [f"auroc_macro: {self.task.num_classes} classes (the interval gathers every "
                                   f"sample's probabilities, done up to {CI_PROBS_MAX_CLASSES} classes)"]
        out["seconds"] = time.perf_counter() - t0
        return out

    def _after_loop(self, ev: Evaluator) -> float:
        """The task's collectives between the loop and the synchronisation (``Task.after_loop``), recorded as
        the collective phase this rank is in (the watchdog and the doctor read it). Returns its seconds
        (results.json ``timings.after_loop``: the sharded search of an embedding task)."""
        ctx = self.ctx
        ctx.status.update(in_collective={"op": "task_after_loop", "since": time.time()}, force=True)
        t0 = time.perf_counter()
        try:
            self.task.after_loop(ev.metric, ctx.comm)
        finally:
            ctx.status.update(in_collective=None)
        return time.perf_counter() - t0

    def _row(self, ev: Evaluator, progress) -> dict:
        return {"rank": self.ctx.rank, "start": progress.start, "end": progress.end, "samples": progress.samples,
                "batches": progress.batches, "seconds_load": self.seconds_load, "allocator": self.allocator,
                "fingerprint": self.fingerprint, **({"predictions": self.store.entry} if self.store else {}),
                "seconds_forward": progress.seconds_forward, "local": ev.metric.local_summary(),
                "seconds_warmup": progress.seconds_warmup, "samples_warmup": progress.samples_warmup,
                "pipeline": pipeline_record(progress),
                **({"skipped": progress.skipped} if self.streamed else {}),
                **(self.mesh.row(progress) if self.mesh else {})}

    def _synchronise(self, ev: Evaluator, progress) -> dict:
        ctx, cfg = self.ctx, self.ctx.cfg
        comm = self.mesh.dp_comm if self.mesh else ctx.comm  # under a mesh: the data-parallel group only
        if cfg.communication.sync_timeout_s is not None:  # a slow but alive peer must not fail the run
            comm.set_timeout(float(cfg.communication.sync_timeout_s), "communication.sync_timeout_s")
        t_sync = time.perf_counter()
        row = self._row(ev, progress)
        if cfg.eval.save_predictions and hasattr(ev.metric, "predictions"):
            atomic_write_json(rank_dir(ctx.run_dir, ctx.rank) / "predictions.json", ev.metric.predictions())
        if cfg.eval.record_batches:
            log_ = dict(ev.batch_log(), schema_version=1, rank=ctx.rank, batch_size=int(cfg.data.batch_size),
                        mode=ctx.compute["mode"])
            atomic_write_json(rank_dir(ctx.run_dir, ctx.rank) / "batches.json", log_)
        exclude = bool(cfg.eval.exclude_outlier_ranks)
        local = ev.state_dict() if exclude else None
        if self.mesh is not None:
            ctx.status.update(in_collective={"op": "tp_check", "since": time.time()}, force=True)
            self.mesh.tp_check = check_tp_peers(ev, self.mesh.tp_comm, self.mesh.groups.tp_peers)
        ctx.status.update(in_collective={"op": "synchronise", "since": time.time()}, force=True)
        synced = synchronise(ev, comm, row, self.policy)
        key = self.task.rank_metric  # the task's per-rank result; None: outliers are not looked for
        outliers = rank_outliers([r["local"].get(key) if key else None for r in synced.rows],
                                 [r["samples"] for r in synced.rows], float(cfg.eval.outlier_z))
        # every rank holds the same gathered rows, so every rank takes the same decision (no collective); with
        # several trials the first trial's decision holds for all, so that every trial covers the same samples
        drop = outliers["excludable"] if not self.outcomes else self.outcomes[0]["excluded"]
        final, kept_runs = ev, None
        if exclude and drop:
            final = self.evaluator()
            if ctx.rank not in drop:
                final.load_state_dict(local)
            kept_runs = synchronise(final, comm, row, self.policy).runs
        out = {"rows": synced.rows, "outliers": outliers, "exclusion": None, "excluded": list(drop) if exclude else [],
               "batches": progress.batches, "seconds_forward": progress.seconds_forward,
               "seconds_sync": time.perf_counter() - t_sync, "metrics": None, "coverage": None}
        ctx.status.update(in_collective=None)
        if ctx.rank == 0:
            cov = check_coverage(synced.runs, len(self.dataset))
            if self.sampler == "exact":
                raise_if_incomplete(cov)
            elif not cov.ok:
                log.warning("data.sampler=%s: %s", self.sampler, cov.message())
            out["coverage"], out["metrics"] = cov, final.metric.compute()
            ci = cfg.eval.ci
            if int(ci.resamples) > 0 and self.stats is None and not self.outcomes:
                self.ci_metric = final.metric  # its intervals come after results.json (add_intervals)
            if kept_runs is not None:
                out["exclusion"] = self._exclusion_record(drop, kept_runs, synced.rows, ev.metric.compute())
        return out

    def _task_intervals(self, metric, ci) -> dict | None:
        """``Task.confidence_intervals`` of the synchronised metric (rank 0), with its seconds; {name: ...}
        per checkpoint of a ``model.checkpoints`` job."""
        def one(m):
            t0 = time.perf_counter()
            out = self.task.confidence_intervals(m, int(ci.resamples), float(ci.level), int(ci.seed))
            return None if out is None else dict(out, seconds=time.perf_counter() - t0)
        return {n: one(m) for n, m in metric.metrics.items()} if self.members else one(metric)

    def _exclusion_record(self, drop: list[int], kept_runs, rows: list[dict], all_metrics: dict) -> dict:
        """What ``eval.exclude_outlier_ranks`` left out: ranks, hosts, their shards and sample count, and the
        metrics with every rank. Raises CoverageError if the kept ids are not exactly the other ranks' shards."""
        fields = {int(r["rank"]): r for r in rows}
        left = sum(int(fields[r]["samples"]) for r in drop)
        n = len(self.dataset)
        cov = check_coverage(kept_runs, n)
        if cov.duplicated or cov.out_of_range or cov.missing != left:
            raise CoverageError(f"after excluding outlier ranks {drop}: expected exactly {left} ids left "
                                f"out, {cov.message()}")
        return {"ranks": list(drop), "hosts": [(read_status(self.ctx.run_dir, r) or {}).get("host") for r in drop],
                "shards": [[int(fields[r]["start"]), int(fields[r]["end"])] for r in drop],
                "samples_left_out": left, "samples_kept": n - left, "metrics_all_ranks": all_metrics}

    def finish(self, t_total: float) -> dict | None:
        """On rank 0: combine trials, write results.json, print; warn about fault drills that never fired."""
        ctx, cfg, outcomes = self.ctx, self.ctx.cfg, self.outcomes
        for fault in self.faults.unfired():
            log.warning("%s=%s: %s after batch %d never fired: this rank had %d batches", "DISTEVAL_FAULTS",
                        os.environ.get("DISTEVAL_FAULTS"), fault.kind, int(fault.params.get("batch", 1)),
                        outcomes[-1]["batches"])
        if ctx.rank != 0:
            return None
        last = outcomes[-1]
        metrics, trial_summary = summarize_trials([o["metrics"] for o in outcomes], cfg.eval.trial_aggregate,
                                                  float(cfg.eval.clip_sigma))
        run = {"run_dir": ctx.run_dir, "world_size": ctx.world_size, "num_samples": len(self.dataset),
               "dataset": self.task.describe(), "task": dict(self.task.identity(), main_metric=self.task.main_metric(metrics),
                                                                 lower_is_better=self.task.lower_is_better(metrics)),
               "model_class": type(self.model).__name__ if self.model is not None else None, "coverage": last["coverage"],
               "comm": self.mesh.comm_stats(ctx.comm) if self.mesh else ctx.comm.stats(),
               "backend": ctx.backend, "device": str(ctx.device), "compute": ctx.compute,
               # each rank's host/node/interface/address from its record (its file, or the rendezvous store when
               # the run directory is node-local), not from the synchronised rows: the rows' bytes stay the same
               # in every node layout
               "net": {r: ((ctx.read_peer(r) or {}).get("net") if r else ctx.net) for r in range(ctx.world_size)},
               "timings": _timings(self.seconds_load, sum(o["seconds_sync"] for o in outcomes), t_total,
                                   sum(o["seconds_after_loop"] for o in outcomes))}
        results = build_results(cfg, run, last["rows"], metrics, extra={
            "sampler": self.sampler, "exact": last["coverage"].ok, "trials": trial_summary if len(outcomes) > 1 else None,
            "outliers": last["outliers"], "exclusion": last["exclusion"], "warnings": self._warnings(last["rows"]),
            "allocator": allocator.summarize([r.get("allocator") for r in last["rows"]]),
            "numeric_classes": numeric_classes({int(r["rank"]): r["fingerprint"] for r in last["rows"]
                                                if r.get("fingerprint")}),
            "canary": self.canary, "confidence_intervals": None,  # added after this write (add_intervals)
            "filesystem": ctx.filesystem,
            **({"parallel": self.mesh.record()} if self.mesh else {}),
            **self._decode_errors(last["rows"])})
        if self.store is not None:
            results["predictions"] = self._store_record([r["predictions"] for r in last["rows"]])
        if self.members:
            return self._finish_members(results)
        write_results(ctx.run_dir, results)  # the driver presents it (disteval.job.run_report.present_results)
        return results

    def _store_record(self, entries: list[dict]) -> dict:
        """The store's manifest(s) and results.json ``predictions``; a job of several checkpoints has one store
        per checkpoint under ``checkpoints/<name>/`` ({name: record})."""
        cfg, run_dir = self.ctx.cfg, Path(self.ctx.run_dir)

        def identity(net) -> dict:
            return {"task": self.task.name, "num_samples": len(self.dataset), "weights_digest": weights_digest(net),
                    "num_classes": getattr(self.task, "num_classes", None),
                    "columns": [f"{f.name}: {f.type}" for f in self.task.prediction_schema()]}
        if not self.members:
            return store_record(run_dir, cfg, identity(self.model), entries)
        return {m.name: store_record(run_dir / model_set.RESULTS_DIR / m.name, with_checkpoint(cfg, m.path),
                                     identity(self.model.members[m.name]), [e[m.name] for e in entries])
                for m in self.members}

    def _finish_members(self, results: dict) -> dict:
        """A job of several checkpoints: each member's results.json, the job's with ``checkpoints`` blocks
        (``disteval.rank.model_set``), each member's metrics on the console and the table of all."""
        nets = self.model.members
        results.pop("checkpoints", None)  # a second write (add_intervals): each member's record is its own
        results["model"]["class"] = type(next(iter(nets.values()))).__name__
        blocks = model_set.write_member_results(results, self.members, {m: weights_digest(n) for m, n in nets.items()})
        results["checkpoints"] = [{k: v for k, v in b.items() if k != "own"} for b in blocks]
        results["task"]["lower_is_better"] = sorted({k for b in blocks for k in self.task.lower_is_better(b["metrics"])})
        write_results(self.ctx.run_dir, results)
        return results

    def _decode_errors(self, rows: list[dict]) -> dict:
        """Streamed data: ``decode_errors`` {policy, skipped, evaluated, samples ("N of M samples"), ids
        [[shard, key], ...]} for results.json, and a console line when samples were skipped. {} otherwise."""
        if not self.streamed:
            return {}
        skipped = sorted(int(p) for r in rows for p in r.get("skipped", []))
        n = len(self.dataset)
        if skipped:
            _say(self.ctx, f"{len(skipped)} of {n} samples did not decode and were skipped "
                           f"(data.on_decode_error=skip; ids in results.json decode_errors)")
        return {"decode_errors": {"policy": str(self.ctx.cfg.data.on_decode_error), "skipped": len(skipped),
                                  "evaluated": n - len(skipped), "samples": f"{n - len(skipped)} of {n} samples",
                                  "ids": [list(self.dataset.sample_name(p)) for p in skipped]}}

    def _warnings(self, rows: list[dict]) -> list[str]:
        """What the user should know although the run succeeded: the preflight's notes (an empty predictions
        file, ineffective settings, a rebuilt cache file), the task's (``Task.run_warnings``: zero embeddings)
        and ranks that had nothing to evaluate (W > N, or fewer global batches than ranks in bitwise mode)."""
        out = [str(n) for n in self.ctx.cfg.preflight_notes] + list(self.task.run_warnings())
        malloc = allocator.summarize([r.get("allocator") for r in rows])
        if malloc and malloc.get("warning"):
            out.append(malloc["warning"])
        classes = numeric_classes({int(r["rank"]): r["fingerprint"] for r in rows if r.get("fingerprint")})
        canary = self.canary or {}
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
            out.append(f"rank(s) {idle} of {self.ctx.world_size} had nothing to evaluate (N={len(self.dataset)} "
                       f"samples{', in whole batches of ' + str(self.ctx.cfg.data.batch_size) if self.bitwise else ''}"
                       f"): they only took part in the synchronisation; fewer ranks would do")
        return out


def _share(ctx: RankContext):
    """``Task.join``'s ``share``: rank 0's bytes to every rank through ``Communicator.broadcast_bytes``,
    recorded as the collective this rank waits in (the watchdog and the doctor read it)."""

    def share(payload: bytes | None) -> bytes:
        ctx.status.update(in_collective={"op": "broadcast_bytes", "since": time.time()}, force=True)
        try:
            return ctx.comm.broadcast_bytes(payload)
        finally:
            ctx.status.update(in_collective=None)

    return share


def _say(ctx: RankContext, message: str) -> None:
    """A start-up progress line on the console (rank 0 only) and in this rank's log."""
    log.info(message)
    if ctx.rank == 0:
        startup.progress(message)


def _timings(load: float, sync: float, t_total: float, after_loop: float = 0.0) -> dict:
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


def start_watchdog(ctx: RankContext, parent: int | None) -> Watchdog:
    """This rank's heartbeat and its watch of peers and driver, timed by ``dist.heartbeat_timeout_s``
    (``disteval.common.liveness``)."""
    cfg = ctx.cfg
    timeout_s = heartbeat_timeout(cfg.dist.heartbeat_timeout_s, cfg.communication.timeout_s)
    timing = (timeout_s, beat_interval(timeout_s, cfg.eval.status_interval_s))
    watchdog = Watchdog(lambda: ctx.status, lambda: ctx.run_dir, ctx.rank, ctx.world_size, timing, parent)
    watchdog.timeout_key = heartbeat_timeout_key(cfg.dist.heartbeat_timeout_s)
    watchdog.read = ctx.read_peer
    return watchdog.start()


def run_rank(cfg: JobConfig, run_dir: str, env: RankEnv | None, agree_run_dir: bool = False) -> dict | None:
    """One rank of ``python -m disteval``: process group, shard evaluation, synchronisation, and on rank 0
    the coverage check, results.json and the console report. Returns the results dict on rank 0.

    With ``eval.trials`` = K > 1 the shard is evaluated and synchronised K times with fresh metric states and
    rank 0 combines the trials (``disteval.metrics.robust.summarize_trials``). ``env=None`` runs a single
    process (world size 1) without a launcher. ``agree_run_dir``: take rank 0's run directory (broadcast),
    for external launchers. Every exception is recorded in this rank's status.json (type, message,
    traceback) before it propagates."""
    apply_at_start(env.rank if env is not None else 0)  # a drill's kernel set: before this process's first kernel
    cfg = job_config(cfg)  # already a JobConfig from every launcher; a job container is validated into one
    ctx = open_records(cfg, run_dir, env)
    parent = parent_to_watch(env is not None)
    watchdog = start_watchdog(ctx, parent)
    if threading.current_thread() is threading.main_thread():
        record_driver_death(parent)
    try:
        t_total = time.perf_counter()
        connect(ctx, agree_run_dir)
        if policy(cfg) == "pin" and ctx.board is not None:
            ctx.cpu_kernels = pin_cpu_kernels(ctx.board.agree)  # before the first kernel
        apply_compute_settings(ctx)
        run = RankRun(ctx)
        run.check_canary()
        for trial in range(int(cfg.eval.trials)):
            if cfg.eval.trials > 1:
                log.info("trial %d of %d", trial + 1, cfg.eval.trials)
            run.outcomes.append(run.trial())
            ctx.status.update(trial=trial + 1, force=True)
        results = run.finish(t_total)
        run.add_intervals(results)
        ctx.status.update(comm=ctx.comm.stats() if ctx.comm is not None else None)
        ctx.status.done()
        if ctx.rank == 0 and ctx.filesystem == "node-local":  # the other nodes' last records, for the doctor
            relay_records(ctx.run_dir, [ctx.read_peer(r) for r in range(ctx.world_size)], ctx.net["node"])
        run.ckpt_path.unlink(missing_ok=True)
        return results
    except BaseException as exc:
        watchdog.stop()
        timed_out = ctx.comm.timeout_error(exc) if ctx.comm is not None else None
        if timed_out is not None:  # the backend's raw words for a collective that ran out of time, named
            exc = timed_out.with_traceback(exc.__traceback__)
            exc.__cause__ = exc.__context__ = None
        ctx.status.fail(exc)
        log.exception("rank %d failed", ctx.rank, exc_info=exc)
        ctx.share_failure()
        if timed_out is not None:
            raise timed_out from None
        raise
    finally:
        watchdog.stop()
        destroy_process_group()


@record
def worker_entry(cfg_container: dict, run_dir: str) -> None:
    """Entry point of a local rank started by torch.distributed.elastic (reads RANK/WORLD_SIZE/... from the
    environment). ``cfg_container`` is the resolved job config as a plain dict."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    sys.stdout.reconfigure(line_buffering=True)
    cfg = job_config(cfg_container)  # the validated, typed config (disteval.config.JobConfig)
    env = RankEnv.from_env()
    # across nodes every node's driver composed its own run directory: the ranks take rank 0's
    spans_nodes = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)) < env.world_size
    run_rank(cfg, str(Path(run_dir)), env, agree_run_dir=spans_nodes)
    startup.skip_teardown_at_exit()  # results and records are written; the launcher waits for the exit


