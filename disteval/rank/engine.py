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
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from disteval.rank import model_set
from disteval import precision as prec
from disteval.job import report
from disteval.rank.bootstrap import RankContext, apply_compute_settings, connect, log, open_records, say
from disteval.comm import RankEnv, destroy_process_group
from disteval.common import allocator, launch_env, startup
from disteval.common.fingerprint import rank_fingerprint
from disteval.common.liveness import beat_interval, heartbeat_timeout, heartbeat_timeout_key
from disteval.errors import ConfigError
from disteval.rank.canary import pin_cpu_kernels, run_canary
from disteval.config import JobConfig, job_config
from disteval.config import heterogeneous_policy as policy
from disteval.faults import FaultPlan, apply_at_start
from disteval.rank.loop import CallbackHook, FaultHook, GuardHook, ShardSpec, StatusHook, evaluate_shard, pipeline_record
from disteval.metrics import check_coverage, raise_if_incomplete
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.robust import rank_outliers
from disteval.models.fastpath import as_channels_last, prepare_model
from disteval.rank.parallel import MeshRun, dims_from_config, first_inputs, parallel_model
from disteval.rank.intervals import Intervals
from disteval.rank.journal import RankJournal
from disteval.rank.results import exclusion_record, finish, finish_members
from disteval.rank.peers import PeerFailedError, PeerWatch
from disteval.rank.plan import RunPlan
from disteval.rank.predictions import store_hook, store_sources
from disteval.job.records import (atomic_write_json, config_digest, rank_dir, relay_records,
                              write_results)
from disteval.rank.resume import CHECKPOINT, PreemptionGuard, load_checkpoint, save_checkpoint
from disteval.rank.sync import SyncPolicy, check_tp_peers, in_collective, synchronised
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
        say(ctx, f"rank 0 of {ctx.world_size} up (process group joined); loading data and model")
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
        say(ctx, f"data and model loaded in {self.seconds_load:.1f} s; evaluating {len(self.dataset)} samples")
        self.policy = SyncPolicy.from_config(cfg.communication)
        n, b = len(self.dataset), int(cfg.data.batch_size)
        if self.mesh and self.streamed:
            raise ConfigError("dist.parallel", "a device mesh needs a map-style dataset, not a streamed one")
        # the data is split over the data-parallel ranks: all ranks without a mesh, dp ranks under one
        dp_rank, dp_size = (self.mesh.dp_rank, self.mesh.dp_size) if self.mesh else (ctx.rank, ctx.world_size)
        self.plan = RunPlan.of(cfg, n, dp_rank, dp_size, self.streamed, self.mesh is not None)
        self.dummy_steps = self.mesh.lockstep(n, b, self.plan.bitwise) if self.mesh else 0
        if self.mesh:
            ctx.status.update(parallel=self.mesh.status_record(), force=True)
        # preemption: resume from this rank's checkpoint, and write one when the scheduler signals the job
        self.ckpt_path = rank_dir(ctx.run_dir, ctx.rank) / CHECKPOINT
        self.ckpt_key = self.plan.checkpoint_key(config_digest(cfg), ctx.world_size, ctx.rank, launch_env.job_id())
        self.outcomes: list[dict] = []
        self.skipped_before: list[int] = []  # streamed data: positions skipped before a resume
        self.canary: dict | None = None
        self.store = store_hook(ctx, self.task, self.members)
        self.intervals = Intervals(ctx, self.task, self.members)
        self.journal = RankJournal(ctx, self.plan)  # durable progress, eval.resume

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

    def check_canary(self) -> dict:
        """The canary before the loop (``disteval.rank.canary.run_canary``); sets and returns ``self.canary``."""
        return run_canary(self)

    def evaluator(self) -> Evaluator:
        """A fresh evaluator of the task's metric (one per trial), its states on the model's device when the
        metric adds batches there without host synchronisation (``Metric.device_resident``)."""
        metric = model_set.member_metrics(self.task, self.members) if self.members else self.task.metric()
        if metric.device_resident:
            metric.to(self.ctx.device)
        return Evaluator(metric, bitwise=self.plan.bitwise, record_batches=bool(self.ctx.cfg.eval.record_batches))

    def _spec(self, skip: int) -> ShardSpec:
        cfg, collate = self.ctx.cfg, self.task.collate_fn()
        return ShardSpec(self.plan.dp_rank, self.plan.dp_size, int(cfg.data.batch_size), aligned=self.plan.bitwise,
                         sampler=self.plan.sampler, skip=skip, num_workers=int(cfg.data.num_workers),
                         collate_fn=self.faults.loader_collate(collate),
                         pin_memory=self.ctx.device.type == "cuda" and collate is None,
                         device=self.ctx.device, prefetch_factor=int(cfg.data.prefetch_factor),
                         persistent_workers=bool(cfg.data.persistent_workers) and int(cfg.eval.trials) > 1,
                         warmup=bool(cfg.eval.compile),
                         loader_timeout_s=cfg.data.loader_timeout_s,
                         skipped=list(self.skipped_before) if skip else [], dummy_steps=self.dummy_steps,
                         dummy_inputs=first_inputs(self.dataset, collate) if self.dummy_steps else None)

    def _resume(self, ev: Evaluator) -> int:
        ckpt = load_checkpoint(self.ckpt_path, self.ckpt_key) if self.plan.resumable and not self.outcomes else None
        if ckpt is None:
            return 0
        ev.load_state_dict(ckpt["state"])
        self.skipped_before = [int(i) for i in ckpt["state"].get("stream_skipped", [])]
        log.info("resuming from %s: %d of %d samples already counted", self.ckpt_path, ckpt["samples_done"],
                 self.plan.shard[1] - self.plan.shard[0])
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
        if self.intervals.stats is not None and not self.outcomes:
            hooks.append(self.intervals.stats)
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
        """The evaluator's state, plus (streamed data) the positions skipped so far (results.json lists them)."""
        return {**ev.state_dict(), "stream_skipped": torch.tensor(progress.skipped, dtype=torch.int64)}

    def trial(self) -> dict:
        """Evaluate the shard, synchronise, check coverage, find outlier ranks and (opt-in) synchronise once
        more without the excludable ones. Returns {metrics (rank 0), coverage, rows, outliers, exclusion,
        excluded, batches, seconds_forward, seconds_sync}."""
        ctx, cfg = self.ctx, self.ctx.cfg
        ev = self.evaluator()
        skip = self._resume(ev)
        # eval.resume: the recorded windows of this shard are added, only the other batches evaluated
        batches, recorded, journal = self.journal.begin(ev, {**self.intervals.sources(), **store_sources(self.store)},
                                                        resume=not skip, first=not self.outcomes, mesh=self.mesh)
        if self.mesh is not None and batches is not None:  # a resumed mesh run: in lockstep over what is left
            self.dummy_steps = self.mesh.relockstep(len(batches))
        guard = PreemptionGuard(lambda: save_checkpoint(self.ckpt_path, self._checkpoint_state(ev, guard.progress),
                                                        guard.progress.samples, self.ckpt_key)) if self.plan.resumable else None
        display = report.GlobalProgress(len(self.dataset), enabled=ctx.rank == 0 and cfg.eval.progress)
        with display:
            with guard if guard is not None else contextlib.nullcontext():  # a checkpoint never holds synced states
                progress = evaluate_shard(self.model, self.dataset, ev,
                                          replace(self._spec(skip), batches=batches, recorded=recorded),
                                          step=self._step(), hooks=[*self._hooks(display, guard), *journal])
            ctx.status.update(phase="sync", samples_done=progress.samples, batches_done=progress.batches, force=True)
            self.faults.on_sync()
            if self.watch:
                self.watch.wait_all_in_sync()
            seconds_after_loop = self._after_loop(ev)
            out = self._synchronise(ev, progress)
            out["seconds_after_loop"] = seconds_after_loop
            display.finish()
        return out

    def finish(self, t_total: float) -> dict | None:
        """On rank 0: combine trials, write results.json (``disteval.rank.results.finish``); None elsewhere."""
        return finish(self, t_total)

    def add_intervals(self, results: dict | None) -> None:
        """``eval.ci``: the intervals (``disteval.rank.intervals``), computed after results.json holds the metrics
        (``finish``); rank 0 then rewrites results.json (and each checkpoint's) with ``confidence_intervals``.
        Every rank calls it: the per-sample rows are gathered to rank 0 (a collective)."""
        got = self.intervals.compute()
        if self.ctx.rank != 0 or results is None or got is None:
            return
        results["confidence_intervals"] = got
        if self.members:
            finish_members(self, results)
        else:
            write_results(self.ctx.run_dir, results)

    def _after_loop(self, ev: Evaluator) -> float:
        """The task's collectives between the loop and the synchronisation (``Task.after_loop``), recorded as
        the collective phase this rank is in (the watchdog and the doctor read it). Returns its seconds
        (results.json ``timings.after_loop``: the sharded search of an embedding task)."""
        t0 = time.perf_counter()
        with in_collective(self.ctx.status, "task_after_loop"):
            self.task.after_loop(ev.metric, self.ctx.comm)
        return time.perf_counter() - t0

    def _row(self, ev: Evaluator, progress) -> dict:
        return {"rank": self.ctx.rank, "start": progress.start, "end": progress.end, "samples": progress.samples,
                "batches": progress.batches, "seconds_load": self.seconds_load, "allocator": self.allocator,
                "fingerprint": self.fingerprint, **({"predictions": self.store.entry} if self.store else {}),
                "seconds_forward": progress.seconds_forward, "local": ev.metric.local_summary(),
                "seconds_warmup": progress.seconds_warmup, "samples_warmup": progress.samples_warmup,
                "pipeline": pipeline_record(progress), "journal": None if self.outcomes else self.journal.record(),
                **({"skipped": [*progress.skipped, *ev.skipped_recorded]} if self.streamed else {}),
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
        if self.mesh is not None:
            with in_collective(ctx.status, "tp_check"):
                self.mesh.tp_check = check_tp_peers(ev, self.mesh.tp_comm, self.mesh.groups.tp_peers)
        with synchronised(ev, comm, row, self.policy, status=ctx.status, restore=exclude) as synced:
            key = self.task.rank_metric  # the task's per-rank result; None: outliers are not looked for
            outliers = rank_outliers([r["local"].get(key) if key else None for r in synced.rows],
                                     [r["samples"] for r in synced.rows], float(cfg.eval.outlier_z))
            # every rank holds the same gathered rows, so every rank takes the same decision (no collective); with
            # several trials the first trial's decision holds for all, so that every trial covers the same samples
            drop = outliers["excludable"] if not self.outcomes else self.outcomes[0]["excluded"]
            synced.restore = bool(exclude and drop)  # the local states again, for a synchronisation without drop
            every_rank = ev.metric.compute() if synced.restore and ctx.rank == 0 else None
        final, kept_runs = ev, None
        if exclude and drop:
            final = ev if ctx.rank not in drop else self.evaluator()  # an excluded rank contributes nothing
            with synchronised(final, comm, row, self.policy, status=ctx.status, restore=False) as kept:
                kept_runs = kept.runs
        out = {"rows": synced.rows, "outliers": outliers, "exclusion": None, "excluded": list(drop) if exclude else [],
               "batches": progress.batches, "seconds_forward": progress.seconds_forward,
               "seconds_sync": time.perf_counter() - t_sync, "metrics": None, "coverage": None}
        if ctx.rank == 0:
            cov = check_coverage(synced.runs, len(self.dataset))
            if self.plan.sampler == "exact":
                raise_if_incomplete(cov)
            elif not cov.ok:
                log.warning("data.sampler=%s: %s", self.plan.sampler, cov.message())
            out["coverage"], out["metrics"] = cov, final.metric.compute()
            if not self.outcomes:
                self.intervals.keep(final.metric)  # its intervals come after results.json (add_intervals)
            if kept_runs is not None:
                out["exclusion"] = exclusion_record(self, drop, kept_runs, synced.rows, every_rank)
        return out


def _share(ctx: RankContext):
    """``Task.join``'s ``share``: rank 0's bytes to every rank through ``Communicator.broadcast_bytes``,
    recorded as the collective this rank waits in (the watchdog and the doctor read it)."""

    def share(payload: bytes | None) -> bytes:
        with in_collective(ctx.status, "broadcast_bytes"):
            return ctx.comm.broadcast_bytes(payload)

    return share


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


