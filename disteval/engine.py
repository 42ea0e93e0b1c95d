"""The per-rank evaluation loop: exact shard -> forward -> metric.update -> one synchronisation at the end.

``evaluate_shard`` and ``synchronise`` are the reusable pieces (tests and benchmarks call them inside an
existing process group); ``run_rank`` is a whole rank of ``python -m disteval``; ``worker_entry`` is the
function torch.distributed.elastic starts in each local rank.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from disteval import precision as prec
from disteval.comm import (Communicator, RankEnv, destroy_process_group, init_process_group, resolve_backend,
                           resolve_device)
from disteval.data import build_dataset, shard_bounds
from disteval.data.sharding import build_sampler, sampler_span
from disteval.errors import DistevalError
from disteval.metrics import (ClassificationMetrics, MetricCollection, RankingMetrics, SampleIdCoverage,
                              check_coverage, raise_if_incomplete)
from disteval.metrics.base import Metric
from disteval.models import build_model, resolve_num_classes
from disteval.detection import (build_detection_metric, build_detection_task, collate_images, detector_forward, is_detection,
                                replay_forward)
from disteval.records import StatusWriter, atomic_write_json, rank_dir, read_status, recorded_progress
from disteval.faults import FaultPlan
from disteval.metrics.robust import rank_outliers, summarize_trials
from disteval.resume import CHECKPOINT, PreemptionGuard, load_checkpoint, save_checkpoint

log = logging.getLogger("disteval.rank")  # to RUN_DIR/ranks/rank{r}/log.txt only (not the console)
log.propagate = False


class PeerFailedError(DistevalError):
    """Rank 0, waiting for its peers before the synchronisation, saw a peer fail or stall. A victim's error:
    ``blames`` is the peer's rank (the culprit)."""

    def __init__(self, blames: int, message: str):
        self.blames = blames
        super().__init__(message)


@dataclass
class ShardOutcome:
    """What one rank did: its shard ``[start, end)``, samples and batches counted, seconds spent."""

    start: int
    end: int
    samples: int = 0
    batches: int = 0
    seconds_forward: float = 0.0


def evaluate_shard(model: torch.nn.Module, dataset, metric: Metric, coverage: SampleIdCoverage, *,
                   rank: int, world_size: int, batch_size: int, num_workers: int = 0,
                   device: torch.device | str = "cpu", precision: Any = None,
                   status: StatusWriter | None = None,
                   on_batch: Callable[[int, int], None] | None = None,
                   collate_fn: Callable | None = None, forward: Callable | None = None,
                   skip: int = 0, guard: Any = None, sampler: str = "exact",
                   faults: Any = None) -> ShardOutcome:
    """Evaluate this rank's exact shard of ``dataset`` (items ``(input, target, sample_id)``).

    No collective is issued here. ``on_batch(batches_done, samples_done)`` is called after each batch
    (progress display; benchmarks use it to add a naive per-batch collective). ``collate_fn`` / ``forward``:
    for tasks whose batches are not one tensor (detection: lists of images; ``outputs = forward(model,
    inputs)`` replaces ``model(inputs.to(device))``, and ``metric.update`` receives the outputs as they are).
    ``skip``: samples of the shard already counted in ``metric`` / ``coverage`` (resumed from a checkpoint);
    ``guard``: a ``disteval.resume.PreemptionGuard`` whose checkpoint signal waits for whole batches.
    ``sampler``: ``data.sampler`` (exact | padded | drop_last, see ``disteval.data.sharding.build_sampler``);
    ``faults``: a ``disteval.faults.FaultPlan`` (failure drills: noise on the outputs, kill/delay after a batch).
    Returns a ShardOutcome (``samples`` includes the skipped ones).
    Raises DataError from ``metric.update`` for bad labels or non-finite logits.
    """
    device = torch.device(device)
    shard_sampler = build_sampler(sampler, len(dataset), world_size, rank, skip=skip)
    # ranks are spawned; spawned loader workers would re-import torch (seconds each): fork them instead
    context = "fork" if num_workers > 0 and "fork" in multiprocessing.get_all_start_methods() else None
    loader = DataLoader(dataset, batch_size=batch_size, sampler=shard_sampler, num_workers=num_workers,
                        pin_memory=device.type == "cuda" and forward is None, persistent_workers=False,
                        multiprocessing_context=context, collate_fn=collate_fn)
    out = ShardOutcome(*sampler_span(shard_sampler), samples=skip)
    if guard is not None:
        guard.samples_done = skip
    if status:
        status.update(phase="forward", samples_planned=len(shard_sampler) + skip, samples_done=skip)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for images, targets, ids in loader:
                amp = prec.autocast(precision, device) if precision is not None else contextlib.nullcontext()
                if forward is not None:
                    with amp:
                        outputs = forward(model, images)
                else:
                    with amp:
                        outputs = model(images.to(device, non_blocking=True))
                    outputs = outputs.float()
                if faults:
                    outputs = faults.on_outputs(outputs)
                with guard.batch() if guard is not None else contextlib.nullcontext():  # whole batches only
                    metric.update(outputs, targets, ids)
                    coverage.update(ids)
                    out.samples += int(ids.numel())
                    if guard is not None:
                        guard.samples_done = out.samples
                out.batches += 1
                if status:
                    status.update(samples_done=out.samples, batches_done=out.batches)
                if on_batch:
                    on_batch(out.batches, out.samples)
                if faults:
                    faults.on_batch(out.batches)
    except DistevalError as exc:
        raise _unwrap_worker_error(exc) from exc
    out.seconds_forward = time.perf_counter() - t0
    return out


def _unwrap_worker_error(exc: DistevalError) -> DistevalError:
    """A DataLoader worker's error arrives as "Caught DataError in DataLoader worker process 0. Original
    Traceback ...": keep the type and only the original one-line message (the traceback stays in the log)."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = text.strip().splitlines()[-1]
    return type(exc)(re.sub(rf"^(?:[\w.]+\.)?{type(exc).__name__}: ", "", last))


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
        states = comm_cfg.get("compress_states")
        return cls(str(getattr(comm_cfg.compression, "value", comm_cfg.compression)),
                   None if states is None else [str(x) for x in states],
                   comm_cfg.get("reduce_scatter_min_bytes"))


def synchronise(metric: Metric, coverage: SampleIdCoverage, comm: Communicator,
                per_rank_row: list[float], policy: SyncPolicy | None = None) -> tuple[torch.Tensor, list[list[float]]]:
    """The one synchronisation of a run, in three collectives whatever the number of batches or states:

    1. one all_reduce of all int64 sum-states flattened into one buffer, which also carries a [W] vector
       holding this rank's payload size at its own index (so the sum tells every rank every size);
    2. one all_reduce of all float64 sum-states;
    3. one all_gather of the padded int64 payload: this rank's sample-id runs and a small float64 row
       (bit-cast, no pickle).

    By payload kind (``policy``): each gather-state adds one metadata all_gather and one variable-size gather (to
    rank 0 only for states declared ``root``, e.g. detection match records)
    (compressed as the policy says); each sliceable sum-state above ``reduce_scatter_min_bytes`` leaves the
    all_reduce for two reduce_scatters (its rows, then the small per-row partials) and one all_gather of the
    per-row results that each rank finished for its slice. ``per_rank_row`` must have the same length on
    every rank. Loads the synced states into ``metric``.
    Returns ``(all id runs int64 [k, 2], rows of all ranks in rank order)``.
    """
    policy = policy or SyncPolicy()
    states, specs = metric.states(), metric.specs()
    row = torch.tensor(per_rank_row, dtype=torch.float64)
    payload = torch.cat([row.view(torch.int64), coverage.runs().reshape(-1)])
    sizes = torch.zeros(comm.world_size, dtype=torch.int64)
    sizes[comm.rank] = payload.numel()
    sums = {k: v for k, (v, red) in states.items() if red == "sum"}
    if "payload_sizes" in sums:
        raise ValueError("metric state name 'payload_sizes' is reserved")
    limit = policy.reduce_scatter_min_bytes
    sliced = sorted(k for k, v in sums.items() if specs[k].sliceable and limit is not None
                    and v.numel() * v.element_size() > limit)
    synced = comm.all_reduce_coalesced({**{k: v for k, v in sums.items() if k not in sliced}, "payload_sizes": sizes})
    sizes = synced.pop("payload_sizes").tolist()
    for name in sorted(k for k, (v, red) in states.items() if red == "gather"):
        mode = policy.compression if policy.compress_states is None or name in policy.compress_states else "none"
        parts = comm.gather_variable(states[name][0], dst=0 if specs[name].root else None, compression=mode,
                                     compressible=specs[name].compressible, name=name)
        if parts is not None:  # None: a root-only state on another rank keeps its local part
            synced[name] = torch.cat(parts)
    metric.load_synced(synced)
    for name in sliced:
        block, start, stop = comm.reduce_scatter_rows(sums[name])
        partial = metric.slice_partials(name, block, start, stop)
        part_block = comm.reduce_scatter_rows(partial)[0] if partial is not None else None
        done = metric.finish_slice(name, block, start, stop, part_block)
        counts = [b - a for a, b in comm.row_bounds(sums[name].shape[0])]
        metric.load_finished(name, torch.cat(comm.all_gather_sized(done, counts)))
    parts = comm.all_gather_sized(payload, sizes)
    width = row.numel()
    rows = [p[:width].clone().view(torch.float64).tolist() for p in parts]
    runs = torch.cat([p[width:].reshape(-1, 2) for p in parts])
    return runs, rows


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
    from disteval.errors import ConfigError

    specs = metric.specs()
    if policy.compress_states is None:
        return
    gather = sorted(k for k, s in specs.items() if s.reduction == "gather")
    compressible = sorted(k for k, s in specs.items() if s.compressible)
    for name in policy.compress_states:
        if name not in specs:
            family = name.split(".", 1)[0]
            hint = f" (add {family} to eval.metrics)" if family in ("classification", "ranking", "coco") else ""
            raise ConfigError("communication.compress_states", f"unknown state {name!r}{hint}; the gather-states "
                              f"of eval.metrics are {gather}")
        if specs[name].reduction != "gather":
            raise ConfigError("communication.compress_states", f"state {name!r} is an exact sum-state "
                              f"(all-reduced in int64/float64) and is never compressed; gather-states: {gather}")
        if policy.compression in ("fp16", "bf16") and not specs[name].compressible:
            raise ConfigError("communication.compress_states", f"state {name!r} is declared exact by its metric "
                              f"and cannot be sent as {policy.compression}; compressible states: {compressible} "
                              "(communication.compression=lossless keeps it exact)")


def build_metric(cfg: Any, num_classes: int) -> MetricCollection:
    """The metric families of ``eval.metrics`` (classification: sum-states; ranking: AUROC/AP from gathered
    scores) as one collection, synchronised together."""
    if is_detection(cfg):
        return MetricCollection({"coco": build_detection_metric(cfg)})
    families = {"classification": lambda: ClassificationMetrics(num_classes, topk=list(cfg.eval.topk),
                                                                ece_bins=cfg.eval.ece_bins),
                "ranking": lambda: RankingMetrics(num_classes)}
    unknown = [m for m in cfg.eval.metrics if m not in families]
    if unknown:
        raise DistevalError(f"eval.metrics: unknown metric families {unknown}; available: {sorted(families)}")
    return MetricCollection({name: families[name]() for name in cfg.eval.metrics})


def _setup_logging(run_dir: str, rank: int) -> None:
    path = rank_dir(run_dir, rank) / "log.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    for old in list(log.handlers):
        log.removeHandler(old)
        old.close()
    log.addHandler(handler)
    log.setLevel(logging.INFO)


class PeerWatch:
    """Rank 0's view of its peers through their status records (no collective): feeds the progress display
    and raises PeerFailedError when a peer's record says ``failed`` (quoting its error), has not changed for
    ``timeout_s`` seconds (stopped, hung on I/O, deadlocked), or never appeared, so that a stalled rank is
    named within one timeout, while rank 0 is still evaluating as well as while it waits to synchronise."""

    def __init__(self, run_dir: str, world_size: int, timeout_s: float, progress, started: float,
                 every_s: float = 0.5):
        self.run_dir, self.world_size, self.timeout_s = run_dir, world_size, timeout_s
        self.progress, self.started, self.every_s = progress, started, every_s
        self._last = 0.0

    def check(self) -> list[dict | None]:
        """Read every record, refresh the display, raise on a failed, stalled or missing peer."""
        records = [read_status(self.run_dir, r) for r in range(self.world_size)]
        now = time.time()
        for r, s in enumerate(records):
            if s and s.get("phase") == "failed":
                err = s.get("error") or {}
                raise PeerFailedError(r, f"rank {r} failed before the synchronisation: {err.get('type')}: "
                                         f"{err.get('message')}")
            if s and s.get("phase") not in ("sync", "done") and now - float(s.get("t_update", now)) > self.timeout_s:
                raise PeerFailedError(r, f"rank {r} stalled: its status has not changed for {self.timeout_s:g} s "
                                         f"(communication.timeout_s) in {recorded_progress(s)}")
        missing = [r for r, s in enumerate(records) if s is None]
        if missing and now - self.started > self.timeout_s:
            raise PeerFailedError(missing[0], f"rank {missing[0]} never wrote a status record")
        if self.progress:
            self.progress.refresh_from(records)
        return records

    def maybe_check(self) -> None:
        """``check()`` at most every ``every_s`` seconds (called after each of rank 0's batches)."""
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self.check()

    def wait_all_in_sync(self) -> None:
        """Poll until every rank reached ``sync`` (or raise as ``check`` does)."""
        while not all(s and s.get("phase") in ("sync", "done") for s in self.check()):
            time.sleep(0.2)


def _checkpoint(path, metric: Metric, coverage: SampleIdCoverage, key: dict, samples_done: Callable[[], int]) -> None:
    save_checkpoint(path, {k: v for k, (v, _) in metric.states().items()}, coverage.runs(), samples_done(), key)


def _one_pass(cfg: Any, run_dir: str, rank: int, world_size: int, status: StatusWriter, comm: Communicator,
              dataset, model, metric: Metric, coverage: SampleIdCoverage, *, device, collate_fn, forward, skip: int,
              guard, sampler: str, faults, policy: SyncPolicy, seconds_load: float,
              make_metric: Callable[[], Metric], exclude_ranks: list[int] | None = None) -> dict:
    """One trial of a rank: evaluate the shard, synchronise, check coverage, find outlier ranks and (opt-in)
    synchronise once more without the excludable ones (``exclude_ranks``: an earlier trial's decision).
    Returns {metrics (rank 0), coverage, rows, outliers, exclusion, excluded, seconds_forward, seconds_sync}."""
    from disteval import report

    progress = report.GlobalProgress(len(dataset), enabled=rank == 0 and cfg.eval.progress)
    watch = PeerWatch(run_dir, world_size, float(cfg.communication.timeout_s), progress,
                      started=status.record["t_start"]) if rank == 0 and world_size > 1 else None
    with progress:
        with guard if guard is not None else contextlib.nullcontext():  # a checkpoint never holds synced states
            outcome = evaluate_shard(
                model, dataset, metric, coverage, rank=rank, world_size=world_size,
                batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers, device=device,
                precision=cfg.precision, status=status,
                on_batch=(lambda b, s: watch.maybe_check()) if watch else
                (lambda b, s: progress.refresh_from([{"samples_done": s}])), collate_fn=collate_fn, forward=forward,
                skip=skip, guard=guard, sampler=sampler, faults=faults)
        status.update(phase="sync", samples_done=outcome.samples, batches_done=outcome.batches, force=True)
        if watch:
            watch.wait_all_in_sync()
        local = metric.local_summary()
        if cfg.communication.sync_timeout_s is not None:  # a slow but alive peer must not fail the run
            comm.set_timeout(float(cfg.communication.sync_timeout_s))
        t_sync = time.perf_counter()
        fields = {**local, "rank": rank, "start": outcome.start, "end": outcome.end,
                  "samples": outcome.samples, "batches": outcome.batches, "seconds_load": seconds_load,
                  "seconds_forward": outcome.seconds_forward}
        row = [float("nan") if fields[k] is None else float(fields[k]) for k in report.ROW_FIELDS]
        if cfg.eval.get("save_predictions") and hasattr(metric, "predictions"):
            atomic_write_json(rank_dir(run_dir, rank) / "predictions.json", metric.predictions())
        exclude = bool(cfg.eval.get("exclude_outlier_ranks"))
        local_states = {k: v.clone() for k, (v, _) in metric.states().items()} if exclude else None
        local_runs = coverage.runs() if exclude else None
        runs, rows = synchronise(metric, coverage, comm, row, policy)
        outliers = _outliers(rows, cfg)
        exclusion = None
        final = metric
        # every rank holds the same gathered rows, so every rank takes the same decision (no collective); with
        # several trials the first trial's decision holds for all, so that every trial covers the same samples
        drop = outliers["excludable"] if exclude_ranks is None else exclude_ranks
        if exclude and drop:
            final = make_metric()
            kept = SampleIdCoverage()
            if rank not in drop:
                final.load_synced(local_states)
                kept.update_runs(local_runs)
            kept_runs, _ = synchronise(final, kept, comm, row, policy)
            exclusion = {"ranks": list(drop), "runs": kept_runs}
        seconds_sync = time.perf_counter() - t_sync
        progress.finish()
    out = {"rows": rows, "outliers": outliers, "exclusion": None, "excluded": list(drop) if exclude else [],
           "batches": outcome.batches,
           "seconds_forward": outcome.seconds_forward,
           "seconds_sync": seconds_sync, "metrics": None, "coverage": None}
    if rank == 0:
        cov = check_coverage(runs, len(dataset))
        if sampler == "exact":
            raise_if_incomplete(cov)
        elif not cov.ok:
            log.warning("data.sampler=%s: %s", sampler, cov.message())
        out["coverage"], out["metrics"] = cov, final.compute()
        if exclusion is not None:
            out["exclusion"] = _exclusion_record(exclusion, rows, metric.compute(), len(dataset), run_dir)
    return out


def _outliers(rows: list[list[float]], cfg: Any) -> dict:
    """Outlier ranks by the modified z-score of their local top-1 accuracy (``disteval.metrics.robust``)."""
    from disteval import report

    fields = [dict(zip(report.ROW_FIELDS, r)) for r in rows]
    acc = [None if f["accuracy"] != f["accuracy"] else f["accuracy"] for f in fields]
    return rank_outliers(acc, [int(f["samples"]) for f in fields], float(cfg.eval.get("outlier_z", 3.5)))


def _exclusion_record(exclusion: dict, rows: list[list[float]], all_metrics: dict, num_samples: int,
                      run_dir: str) -> dict:
    """What ``eval.exclude_outlier_ranks`` left out: ranks, hosts, their shards and sample count, and the
    metrics with every rank. Raises CoverageError if the kept ids are not exactly the other ranks' shards."""
    from disteval import report
    from disteval.errors import CoverageError

    fields = {int(r[0]): dict(zip(report.ROW_FIELDS, r)) for r in rows}
    left = sum(int(fields[r]["samples"]) for r in exclusion["ranks"])
    cov = check_coverage(exclusion["runs"], num_samples)
    if cov.duplicated or cov.out_of_range or cov.missing != left:
        raise CoverageError(f"after excluding outlier ranks {exclusion['ranks']}: expected exactly {left} ids left "
                            f"out, {cov.message()}")
    return {"ranks": exclusion["ranks"], "hosts": [(read_status(run_dir, r) or {}).get("host") for r in exclusion["ranks"]],
            "shards": [[int(fields[r]["start"]), int(fields[r]["end"])] for r in exclusion["ranks"]],
            "samples_left_out": left, "samples_kept": num_samples - left, "metrics_all_ranks": all_metrics}


def run_rank(cfg: Any, run_dir: str, env: RankEnv | None, agree_run_dir: bool = False) -> dict | None:
    """One rank of ``python -m disteval``: process group, shard evaluation, synchronisation, and on rank 0
    the coverage check, results.json and the console report. Returns the results dict on rank 0.

    With ``eval.trials`` = K > 1 the shard is evaluated and synchronised K times with fresh metric states and
    rank 0 combines the trials (``disteval.metrics.robust.summarize_trials``); every trial also tests the
    ranks' local accuracies for outliers and, with ``eval.exclude_outlier_ranks``, synchronises once more
    without them. Faults of ``DISTEVAL_FAULTS`` (``disteval.faults``) are applied to this rank.

    ``env=None`` runs a single process (world size 1) without a launcher. ``agree_run_dir``: take rank 0's
    run directory (broadcast), for external launchers where each rank composed its own. Every exception is
    recorded in this rank's status.json (type, message, traceback) before it propagates.
    """
    from disteval import report

    rank = env.rank if env else 0
    world_size = env.world_size if env else 1
    try:
        status = StatusWriter(run_dir, rank, world_size, interval_s=float(cfg.eval.status_interval_s))
        _setup_logging(run_dir, rank)
    except OSError as exc:
        raise DistevalError(f"rank {rank} cannot write its records under {run_dir}/ranks: {exc}") from exc
    comm = None
    try:
        t_total = time.perf_counter()
        device = resolve_device(cfg.dist.device, env.local_rank if env else 0)
        backend = resolve_backend(cfg.communication.backend, device)
        status.update(force=True, config_digest=report.config_digest(cfg), rendezvous={
            "backend": backend, "master_addr": os.environ.get("MASTER_ADDR") if env else None,
            "master_port": int(os.environ["MASTER_PORT"]) if env and os.environ.get("MASTER_PORT") else None,
            "timeout_s": float(cfg.communication.timeout_s)})
        init_process_group(backend, cfg.communication.timeout_s, env)
        status.update(force=True, joined=time.time())
        cc = cfg.communication
        comm = Communicator("cpu" if backend == "gloo" else device,
                            on_collective=lambda op, n: status.update(last_collective={"op": op, "bytes": n}),
                            async_threshold_bytes=cc.async_threshold_bytes, chunk_bytes=cc.chunk_bytes,
                            max_in_flight=cc.max_in_flight)
        if agree_run_dir and env is not None:  # each rank composed its own config: rank 0's metadata wins
            meta = comm.broadcast_json({"run_dir": run_dir, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                                        "seed": int(cfg.seed), "t_start": status.record["t_start"]}
                                       if rank == 0 else None)
            if meta["seed"] != int(cfg.seed):
                raise DistevalError(f"rank {rank} has seed={cfg.seed} but rank 0 has {meta['seed']}: the ranks "
                                    "were started with different overrides")
            if meta["run_dir"] != run_dir:  # move this rank's records next to rank 0's
                old, run_dir = status, meta["run_dir"]
                status = StatusWriter(run_dir, rank, world_size, interval_s=old.interval_s)
                status.record.update(t_start=old.record["t_start"])
                _setup_logging(run_dir, rank)
        log.info("rank %d/%d on %s, backend %s, device %s", rank, world_size, status.record["host"], backend,
                 device)
        if device.type == "cpu" and env is not None:  # share the cores among the local ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        with warnings.catch_warnings():
            if rank != 0:  # say it once
                warnings.simplefilter("ignore")
            prec.apply_global_switches(cfg.precision, device)
        status.update(phase="data")
        t_load = time.perf_counter()
        collate_fn = forward = None
        if is_detection(cfg):
            dataset, model, metric, gt = build_detection_task(cfg)
            num_classes = gt.num_categories
            if model is None:
                forward = replay_forward
            else:
                model = model.to(device)
                forward = functools.partial(detector_forward, device=device)
            collate_fn = collate_images
        else:
            dataset, data_classes = build_dataset(cfg.data)
            num_classes = resolve_num_classes(cfg.model, data_classes)
            model = build_model(cfg.model, num_classes, seed=cfg.seed).to(device)
            metric = build_metric(cfg, num_classes)
        faults = FaultPlan(rank)
        if faults and model is not None:
            faults.on_model(model)
        seconds_load = time.perf_counter() - t_load
        trials, sampler = int(cfg.eval.get("trials", 1)), str(cfg.data.get("sampler", "exact"))
        # preemption: resume from this rank's checkpoint, and write one when SLURM signals the job
        # (single-trial exact runs only: a checkpoint holds one pass over one exact shard)
        ckpt_path = rank_dir(run_dir, rank) / CHECKPOINT
        start, end = shard_bounds(len(dataset), world_size, rank)
        key = {"config": report.config_digest(cfg), "world_size": world_size, "rank": rank, "shard": [start, end],
               "job": os.environ.get("SLURM_JOB_ID")}  # a requeued job keeps its id; another job never matches
        resumable = trials == 1 and sampler == "exact"
        ckpt = load_checkpoint(ckpt_path, key) if resumable else None
        policy = SyncPolicy.from_config(cfg.communication)
        outcomes = []
        for trial in range(trials):
            if trial:
                metric = build_metric(cfg, num_classes)
            coverage = SampleIdCoverage()
            skip = 0
            if ckpt is not None:
                metric.load_synced(ckpt["states"])
                coverage.update_runs(ckpt["runs"])
                skip = int(ckpt["samples_done"])
                log.info("resuming from %s: %d of %d samples already counted", ckpt_path, skip, end - start)
            guard = PreemptionGuard(functools.partial(
                _checkpoint, ckpt_path, metric, coverage, key, lambda: guard.samples_done)) if resumable else None
            if trials > 1:
                log.info("trial %d of %d", trial + 1, trials)
            outcomes.append(_one_pass(cfg, run_dir, rank, world_size, status, comm, dataset, model, metric, coverage,
                                      device=device, collate_fn=collate_fn, forward=forward, skip=skip, guard=guard,
                                      sampler=sampler, faults=faults, policy=policy, seconds_load=seconds_load,
                                      make_metric=lambda: build_metric(cfg, num_classes),
                                      exclude_ranks=outcomes[0]["excluded"] if outcomes else None))
            status.update(trial=trial + 1, force=True)
        for fault in faults.unfired():
            log.warning("%s=%s: %s after batch %d never fired: this rank had %d batches", "DISTEVAL_FAULTS",
                        os.environ.get("DISTEVAL_FAULTS"), fault.kind, int(fault.params.get("batch", 1)),
                        outcomes[-1]["batches"])
        results = None
        if rank == 0:
            last = outcomes[-1]
            metrics, trial_summary = summarize_trials([o["metrics"] for o in outcomes], cfg.eval.trial_aggregate,
                                                      float(cfg.eval.clip_sigma))
            results = report.build_results(
                cfg, run_dir=run_dir, world_size=world_size, num_samples=len(dataset), num_classes=num_classes,
                metrics=metrics, coverage=last["coverage"], rows=last["rows"], comm=comm.stats(), backend=backend,
                device=str(device), timings={"load": seconds_load, "forward": sum(o["seconds_forward"] for o in outcomes),
                                             "sync": sum(o["seconds_sync"] for o in outcomes),
                                             "total": time.perf_counter() - t_total},
                extra={"sampler": sampler, "exact": last["coverage"].ok,
                       "trials": trial_summary if trials > 1 else None, "outliers": last["outliers"],
                       "exclusion": last["exclusion"]})
            report.write_results(run_dir, results)
            report.print_metrics(results)
        status.update(phase="done", force=True)
        ckpt_path.unlink(missing_ok=True)
        return results
    except BaseException as exc:
        status.fail(exc)
        log.exception("rank %d failed", rank)
        raise
    finally:
        destroy_process_group()


@record
def worker_entry(cfg_container: dict, run_dir: str) -> None:
    """Entry point of a local rank started by torch.distributed.elastic (reads RANK/WORLD_SIZE/... from the
    environment). ``cfg_container`` is the resolved job config as a plain dict."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    sys.stdout.reconfigure(line_buffering=True)
    cfg = OmegaConf.create(cfg_container)
    run_rank(cfg, str(Path(run_dir)), RankEnv.from_env())
