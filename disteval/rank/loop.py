"""The per-rank evaluation loop, task-agnostic and small (in the spirit of detectron2's
``inference_on_dataset``): model, loader, evaluator, step, and named hooks for what is not evaluation
(status records, progress and peer watching, fault drills, the preemption guard). No collective is issued
here; ``disteval.rank.sync`` synchronises what the evaluator accumulated."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from disteval.data.device_feed import DeviceFeed
from disteval.data.pixels import TimedCollate
from disteval.data.sharding import build_sampler, sampler_span
from disteval.data.streaming import StreamSource
from disteval.data.wds_stream import StreamBatch
from disteval.errors import DataError, DistevalError
from disteval.metrics.evaluator import Evaluator


@dataclass
class ShardSpec:
    """Which part of the dataset this rank evaluates and how it is loaded.

    rank, world_size: the data-parallel rank and size. batch_size: B. aligned: batch-aligned shards (whole
    global batches; ``eval.mode=bitwise``) or sample-even ones (``fast``). sampler: ``data.sampler``
    (exact | padded | drop_last). skip: samples of the shard already counted (resume). num_workers: loader
    worker processes. collate_fn: the task's, or None for torch's default. pin_memory: page-locked host
    batches (CUDA devices). skipped: streamed data, the positions ``data.on_decode_error=skip`` skipped before
    a resume (from the checkpoint), carried into ``LoopProgress.skipped``. device: the model's device; on CUDA
    the next batch's inputs (and tensor targets) are copied there on a side stream while the current batch
    computes (``DeviceFeed``). prefetch_factor, persistent_workers: the DataLoader's (with workers; persistent
    loaders are kept for the next trial, ``eval.trials``). loader_timeout_s: the longest wait for one batch from
    the loader workers (null: forever), then a DataError. warmup: time the first batch apart
    (``LoopProgress.seconds_warmup``: compilation with ``eval.compile``).
    dummy_steps: forwards to run after
    the shard, outputs discarded (a model sharded across data-parallel ranks needs every rank in each forward;
    ``disteval.data.sharding.lockstep_plan``); dummy_inputs: ``() -> inputs`` of one such forward.
    batches: only these batches ``[start, end)`` of sample ids, in order (a resumed run: the batches of the shard
    that no recorded window covers, ``disteval.rank.journal``); recorded: the shard's samples the recorded
    windows hold (counted as done from the start).
    """

    rank: int
    world_size: int
    batch_size: int
    aligned: bool = True
    sampler: str = "exact"
    skip: int = 0
    num_workers: int = 0
    collate_fn: Callable | None = None
    pin_memory: bool = False
    skipped: list = field(default_factory=list)  # streamed data: positions skipped before a resume
    device: torch.device = torch.device("cpu")
    prefetch_factor: int = 4
    persistent_workers: bool = False
    warmup: bool = False
    loader_timeout_s: float | None = None
    dummy_steps: int = 0
    dummy_inputs: Callable[[], Any] | None = None
    batches: list[tuple[int, int]] | None = None
    recorded: int = 0


@dataclass
class LoopProgress:
    """What the loop did so far: the shard ``[start, end)``, the number of its first batch (the global batch
    index with batch-aligned shards, else a number unique to this rank), samples (including resumed ones) and
    batches counted, and the seconds spent in the loop."""

    start: int
    end: int
    first_batch: int
    planned: int
    samples: int = 0
    batches: int = 0
    seconds_forward: float = 0.0
    skipped: list = field(default_factory=list)  # positions skipped by data.on_decode_error=skip (streamed data)
    seconds_warmup: float = 0.0  # the first batch's seconds when timed apart (ShardSpec.warmup), else 0
    samples_warmup: int = 0
    dummy_planned: int = 0  # forwards planned after the shard whose outputs are discarded (lockstep)
    dummy_steps: int = 0  # of those, run so far
    # the loop's stage seconds (StageTimer: wait_for_data, forward, metric_update) and the loader's host stages
    # (read, decode, transform, collate: worker-seconds) when the dataset times them; read with ``pipeline_record``
    timer: Any = None
    stages: dict = field(default_factory=dict)
    grid: int = 0  # > 0: batches skip recorded ones, a batch's global index is its first sample id // grid


class LoopHook:
    """A named callback of the loop; every method is optional."""

    def before_loop(self, progress: LoopProgress) -> None:
        """Once, before the first batch."""

    def on_outputs(self, outputs: Any) -> Any:
        """Sees (and may replace) a batch's outputs before they are accumulated (fault drills)."""
        return outputs

    def batch_scope(self) -> ContextManager:
        """A context around the accumulation of one batch (the preemption guard defers its signal to the
        end of it, so a checkpoint holds whole batches)."""
        return contextlib.nullcontext()

    def waiting_for_data(self, since: float | None) -> None:
        """The loop starts waiting for its next batch from the loader (``since``: ``time.time()``) or got it
        (None); called twice per batch, so it must be cheap (the status record marks it in memory)."""

    def after_outputs(self, outputs: Any, targets: Any, ids: torch.Tensor) -> None:
        """A batch's outputs, targets and global sample ids (int64 [B]), after they were accumulated (the
        prediction store, ``disteval.store``)."""

    def after_batch(self, progress: LoopProgress) -> None:
        """After each batch was accumulated."""

    def after_dummy(self, progress: LoopProgress) -> None:
        """After each dummy step (a forward whose outputs are discarded, ``ShardSpec.dummy_steps``)."""

    def before_finish(self, progress: LoopProgress) -> None:
        """Once, after the last batch and before the evaluator's ``finish_local`` (the journal's last window)."""

    def after_loop(self, progress: LoopProgress) -> None:
        """Once, after the last batch and the dummy steps."""


def make_loader(dataset: Dataset, spec: ShardSpec) -> tuple[DataLoader, Any]:
    """The DataLoader over this rank's shard and its sampler. Loader workers are forked (spawned ones would
    re-import torch, seconds each)."""
    sampler = build_sampler(spec.sampler, len(dataset), spec.world_size, spec.rank, skip=spec.skip,
                            batch_size=spec.batch_size if spec.aligned else None)
    if spec.batches is not None:  # a resumed shard: the batches no recorded window covers, each whole
        lists = [list(range(a, b)) for a, b in spec.batches]
        if spec.num_workers == 0 and spec.collate_fn is None and getattr(dataset, "in_memory", False):
            return DataLoader(_Batches(dataset), batch_size=None, pin_memory=spec.pin_memory, sampler=lists), sampler
        clock = getattr(dataset, "stage_clock", None)
        workers = spec.num_workers > 0
        return DataLoader(dataset, batch_sampler=lists, num_workers=spec.num_workers, pin_memory=spec.pin_memory,
                          prefetch_factor=spec.prefetch_factor if workers else None,
                          timeout=(spec.loader_timeout_s or 0) if workers else 0,
                          collate_fn=TimedCollate(clock, spec.collate_fn) if clock is not None else spec.collate_fn,
                          **_worker_processes(spec.num_workers)), sampler
    if spec.num_workers == 0 and spec.collate_fn is None and getattr(dataset, "in_memory", False):
        # tensors already in memory: each batch is one slice copy (or gather) out of them, not B per-item
        # fetches and a collation (measured: per-item fetch was ~3% of a pass of a small CNN over 10,000
        # 28x28 images)
        loader = DataLoader(_Batches(dataset), batch_size=None, pin_memory=spec.pin_memory,
                            sampler=BatchSampler(sampler, spec.batch_size, drop_last=False))
        return loader, sampler
    key = (id(dataset), spec.rank, spec.world_size, spec.batch_size, spec.aligned, spec.sampler, spec.num_workers)
    kept = _PERSISTENT.get(key)
    if kept is not None and kept[0] is dataset and spec.skip == 0:
        return kept[1], kept[2]
    workers = spec.num_workers > 0
    persistent = workers and spec.persistent_workers and spec.skip == 0
    clock = getattr(dataset, "stage_clock", None)  # a dataset that times its stages has its batches' collation timed
    collate = TimedCollate(clock, spec.collate_fn) if clock is not None else spec.collate_fn
    loader = DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler, num_workers=spec.num_workers,
                        pin_memory=spec.pin_memory, persistent_workers=persistent,
                        prefetch_factor=spec.prefetch_factor if workers else None,
                        timeout=(spec.loader_timeout_s or 0) if workers else 0,
                        collate_fn=collate, **_worker_processes(spec.num_workers))
    if persistent:
        _PERSISTENT[key] = (dataset, loader, sampler)
    return loader, sampler


def _worker_processes(num_workers: int) -> dict:
    """The DataLoader arguments of how its worker processes start and end: forked (spawned ones would re-import
    torch, seconds each) and tied to this rank's life (``die_with_rank``); none without workers."""
    if num_workers == 0:
        return {"multiprocessing_context": None, "worker_init_fn": None}
    fork = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return {"multiprocessing_context": fork, "worker_init_fn": functools.partial(die_with_rank, os.getpid())}


def die_with_rank(rank_pid: int, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: the kernel SIGKILLs this worker when its rank ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``, the way torch's spawn start ties a rank to its launcher). torch's own watchdog
    notices a dead rank only every 5 s, and a worker whose result pipe is full then never exits: every worker
    holds the pipe's read end too (inherited), so the write blocks forever, the worker keeps the killed rank's
    sentinel open and torch's elastic agent waits 30 s for a rank that is already gone. ``rank_pid``: the
    rank's pid when the loader was made (a worker whose rank died before this ran ends at once). No-op off
    Linux."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != rank_pid:  # the rank died between the fork and the prctl
        os._exit(1)


# loaders with persistent workers, kept for the next trial of the same shard (a process evaluates one job)
_PERSISTENT: dict[tuple, tuple[Dataset, DataLoader, Any]] = {}


class _Batches(Dataset):
    """A dataset with ``fetch_batch`` seen as one whose items are whole batches, keyed by their index lists
    (a DataLoader with ``batch_size=None`` over a BatchSampler)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]):
        return self.dataset.fetch_batch(indices)


def inference_on_dataset(model: Any, loader: Iterable, evaluator: Evaluator, step: Callable[[Any, Any], Any],
                         progress: LoopProgress, hooks: Sequence[LoopHook] = ()) -> LoopProgress:
    """Run ``outputs = step(model, inputs)`` over ``loader`` and accumulate each batch into ``evaluator``
    under ``torch.inference_mode``; batch k of the loader is global batch ``progress.first_batch + k``.
    Nothing here reads a device value: progress counts come from the host-side sample ids. Returns
    ``progress`` updated. Raises what the step or ``evaluator.process`` raises (a DataError from a loader
    worker with its original one-line message; a deferred DataError of the metric at the end)."""
    for hook in hooks:
        hook.before_loop(progress)
    t0, n0 = time.perf_counter(), progress.samples
    timer = StageTimer(getattr(loader, "device", torch.device("cpu")))
    batches = iter(loader)
    ok = False
    try:
        with torch.inference_mode():
            for k, batch in enumerate(_marked(batches, hooks, timer)):
                inputs, targets, ids, index = _unpack(batch, progress, evaluator, k)
                if inputs is None:  # every sample of this streamed batch was skipped (and counted)
                    continue
                with timer("forward"):
                    outputs = step(model, inputs)
                for hook in hooks:
                    outputs = hook.on_outputs(outputs)
                with contextlib.ExitStack() as scope:
                    for hook in hooks:
                        scope.enter_context(hook.batch_scope())
                    with timer("metric_update"):
                        evaluator.process(index, outputs, targets, ids)
                    progress.samples += int(ids.numel())
                    progress.batches += 1
                for hook in hooks:
                    hook.after_outputs(outputs, targets, ids)
                if k == 0 and progress.seconds_warmup < 0:  # timed apart (ShardSpec.warmup)
                    progress.seconds_warmup = time.perf_counter() - t0
                    progress.samples_warmup = int(ids.numel())
                for hook in hooks:
                    hook.after_batch(progress)
        ok = True
    except DistevalError as exc:
        raise _unwrap_worker_error(exc) from exc
    except RuntimeError as exc:
        if "DataLoader timed out" not in str(exc):
            raise
        raise DataError(f"no batch from the loader workers after global batch {progress.first_batch + progress.batches - 1}"
                        f" within data.loader_timeout_s ({exc}): a worker is stuck or could not send its batch "
                        "(see the rank's log for the worker's traceback)") from exc
    finally:
        _stop_workers(loader.batches if isinstance(loader, DeviceFeed) else batches, keep_persistent=ok)
    progress.seconds_forward = time.perf_counter() - t0
    progress.seconds_warmup = max(progress.seconds_warmup, 0.0)
    if isinstance(loader, DeviceFeed) and loader.copies:  # CUDA: the side stream's host-to-device copies
        timer.events["host_to_device"] = loader.copies
    progress.timer = timer
    progress.stages.update(loop=progress.seconds_forward, images=progress.samples - n0)
    for hook in hooks:
        hook.before_finish(progress)
    evaluator.finish_local()
    for hook in hooks:
        hook.after_loop(progress)
    return progress


class StageTimer:
    """Seconds of the loop's stages, summed over batches: ``with timer("forward"): ...``. On a CUDA device a
    stage is timed by a pair of CUDA events recorded on the current stream (no host synchronisation per batch;
    ``totals`` waits for the last event once, after the loop); elsewhere by ``time.perf_counter``. The time
    waiting for the loader is host time on every device (``add``)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.host: dict[str, float] = {}
        self.events: dict[str, list] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.setdefault(stage, []).append((start, end))
            return
        t = time.perf_counter()
        yield
        self.add(stage, time.perf_counter() - t)

    def add(self, stage: str, seconds: float) -> None:
        self.host[stage] = self.host.get(stage, 0.0) + seconds

    def totals(self) -> dict:
        """``{stage: seconds}``."""
        out = dict(self.host)
        for stage, pairs in self.events.items():
            if pairs:
                pairs[-1][1].synchronize()
                out[stage] = out.get(stage, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        return out


def pipeline_record(progress: LoopProgress) -> dict:
    """This rank's input pipeline, stage by stage (results.json ``per_rank[].pipeline``): ``images`` evaluated,
    ``loop`` seconds, ``wait_for_data``/``forward``/``metric_update`` seconds (the forward on a CUDA device timed
    by events; read here, after the loop, so the loop itself never waits for the device), and ``host``: the
    loader's read/decode/transform/collate worker-seconds, items and active workers (datasets that time them), with
    ``num_workers``."""
    out = dict(progress.stages)
    if progress.timer is not None:
        out.update(progress.timer.totals())
    return out


def _marked(batches: Iterator, hooks: Sequence[LoopHook], timer: StageTimer | None = None) -> Iterator:
    """``batches``, telling the hooks when the loop waits for the loader (``LoopHook.waiting_for_data``) and
    adding the wait to ``timer``'s ``wait_for_data``."""
    marking = [h for h in hooks if type(h).waiting_for_data is not LoopHook.waiting_for_data]
    while True:
        for hook in marking:
            hook.waiting_for_data(time.time())
        t = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            if timer is not None:
                timer.add("wait_for_data", time.perf_counter() - t)
        for hook in marking:  # not on an error: a rank whose loader timed out still waits for data until the
            hook.waiting_for_data(None)  # error is recorded
        yield batch


def _stop_workers(batches: Any, keep_persistent: bool) -> None:
    """Stop a multi-process DataLoader iterator's workers now, with torch's own clean-up (``_shutdown_workers``,
    what its ``__del__`` runs; a no-op once done). A loop left by an exception keeps the iterator in a reference
    cycle with the traceback; the garbage collector may then finalise its queues first, and torch waits 5 s
    (``MP_STATUS_CHECK_INTERVAL``) per worker that never receives its stop message (measured: 5.4 s per worker
    after a truncated shard), or runs the clean-up in a later DataLoader's forked worker. A persistent
    loader's workers (``data.persistent_workers``) are kept after a pass that ended normally (the next trial
    reuses them); after a failed one they are stopped and the loader is forgotten."""
    if keep_persistent and getattr(batches, "_persistent_workers", False):
        return
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        if getattr(batches, "_persistent_workers", False):
            for key in [k for k, v in _PERSISTENT.items() if v[1]._iterator is batches]:
                _PERSISTENT[key][1]._iterator = None
                del _PERSISTENT[key]


def _unpack(batch: Any, progress: LoopProgress, evaluator: Evaluator, k: int) -> tuple:
    """``(inputs, targets, ids, global batch index)`` of a loader batch: a map-style tuple (batch k of the
    shard), or a ``StreamBatch`` (``disteval.data.wds_stream``) that carries its own batch index and the
    positions it skipped; those are recorded in ``progress.skipped`` and in the coverage (accounted for,
    not evaluated) and counted as done."""
    if not isinstance(batch, StreamBatch):
        inputs, targets, ids = batch
        if progress.grid and ids.numel():  # batches around recorded ones: the global grid by sample id
            return inputs, targets, ids, int(ids[0]) // progress.grid
        return inputs, targets, ids, progress.first_batch + k
    if batch.skipped.numel():
        progress.skipped.extend(int(i) for i in batch.skipped)
        evaluator.skip(batch.skipped)
        progress.samples += int(batch.skipped.numel())
    return batch.inputs, batch.targets, batch.sample_ids, int(batch.batch)


def _stream_loader(source: StreamSource, spec: ShardSpec) -> tuple[DataLoader, LoopProgress]:
    """The DataLoader over this rank's planned shard ranges (``batch_size=None``: the stream yields whole
    batches) and the progress to start from. Resuming (``spec.skip`` samples done, one count per rank): the
    rank's batches arrived in order, so the count says where the rank is; the rest is dealt to the workers
    again (``stream_plan.worker_spans``). Raises ValueError for another sampler than exact, or a resume of
    a sample-even plan with several workers."""
    if spec.sampler != "exact":
        raise ValueError(f"data.sampler={spec.sampler} does not apply to streamed shards (always exact)")
    b = spec.batch_size if spec.aligned else None
    start, end = source.bounds(spec.world_size, spec.rank, b)
    stream = source.stream(spec.world_size, spec.rank, spec.num_workers, spec.batch_size, spec.aligned,
                           spec.skip if spec.batches is None else spec.batches)
    loader = DataLoader(stream, batch_size=None, num_workers=spec.num_workers, pin_memory=spec.pin_memory,
                        **_worker_processes(spec.num_workers),
                        prefetch_factor=spec.prefetch_factor if spec.num_workers > 0 else None,
                        timeout=(spec.loader_timeout_s or 0) if spec.num_workers > 0 else 0)
    first = (start + spec.skip) // spec.batch_size if spec.aligned else start
    return loader, LoopProgress(start, end, first, planned=end - start,
                                samples=spec.skip if spec.batches is None else spec.recorded,
                                skipped=list(spec.skipped))


def evaluate_shard(model: Any, dataset: Dataset, evaluator: Evaluator, spec: ShardSpec, *,
                   step: Callable[[Any, Any], Any] | None = None, hooks: Sequence[LoopHook] = ()) -> LoopProgress:
    """Evaluate this rank's exact shard of ``dataset`` (items ``(input, target, sample_id)``) into
    ``evaluator``. ``step(model, inputs) -> outputs`` defaults to ``model(inputs).float()`` (CPU). Returns
    the LoopProgress (``samples`` includes ``spec.skip``)."""
    if isinstance(dataset, StreamSource):
        loader, progress = _stream_loader(dataset, spec)
    else:
        loader, sampler = make_loader(dataset, spec)
        start, end = sampler_span(sampler)
        first = getattr(sampler, "first_batch", None)
        if first is None:  # not batch-aligned (fast mode, padded/drop_last samplers): rank-unique batch numbers
            first = spec.rank * max(len(loader), 1)
        progress = LoopProgress(start, end, first, planned=len(sampler) + spec.skip, samples=spec.skip)
        if spec.batches is not None:
            progress.samples = spec.recorded
            progress.grid = spec.batch_size if spec.aligned else 0
    if spec.dummy_steps and spec.dummy_inputs is None:
        raise ValueError(f"ShardSpec: {spec.dummy_steps} dummy steps planned but no dummy_inputs")
    progress.dummy_planned = spec.dummy_steps
    step = step or (lambda m, x: m(x).float())
    if spec.warmup:
        progress.seconds_warmup = -1.0  # marks: time the first batch apart
    # a pixel cache being built sees the host batches of a whole, fresh shard (not a resumed one)
    tap = dataset.host_tap(progress.start, progress.end) if hasattr(dataset, "host_tap") and not spec.skip and \
        spec.batches is None else None
    clock = getattr(dataset, "stage_clock", None)
    if clock is not None:
        clock.reset()
    try:
        progress = inference_on_dataset(model, DeviceFeed(loader, spec.device, tap), evaluator, step, progress, hooks)
    except BaseException:
        if tap is not None:
            tap.finish(ok=False)
        raise
    if tap is not None:
        tap.finish(ok=True)
    if clock is not None:  # the loader's host stages (read, decode, transform, collate), summed over its workers
        progress.stages["host"] = clock.totals()
        progress.stages["num_workers"] = spec.num_workers
    return run_dummy_steps(model, step, progress, hooks, spec.dummy_inputs)


def run_dummy_steps(model: Any, step: Callable[[Any, Any], Any], progress: LoopProgress, hooks: Sequence[LoopHook],
                    dummy_inputs: Callable[[], Any] | None) -> LoopProgress:
    """The ``progress.dummy_planned`` dummy steps after the shard: ``step(model, dummy_inputs())`` under
    ``torch.inference_mode``, outputs discarded (never accumulated, never counted as samples or batches), each
    counted in ``progress.dummy_steps``; a model sharded across data-parallel ranks (FSDP) issues its
    collectives in them as in a real step, so ranks with fewer batches keep their peers' forwards matched."""
    with torch.inference_mode():
        for _ in range(progress.dummy_planned - progress.dummy_steps):
            step(model, dummy_inputs())
            progress.dummy_steps += 1
            for hook in hooks:
                hook.after_dummy(progress)
    return progress


def _unwrap_worker_error(exc: DistevalError) -> DistevalError:
    """A DataLoader worker's error arrives as "Caught DataError in DataLoader worker process 0. Original
    Traceback ...": keep the type and only the original one-line message (the traceback stays in the log)."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = text.strip().splitlines()[-1]
    return type(exc)(re.sub(rf"^(?:[\w.]+\.)?{type(exc).__name__}: ", "", last))


class StatusHook(LoopHook):
    """Keeps ``ranks/rank{r}/status.json`` current: phase ``forward`` with the planned samples, then samples
    and batches done (written at most every ``eval.status_interval_s``)."""

    def __init__(self, status: Any):
        self.status = status

    def before_loop(self, progress: LoopProgress) -> None:
        self.status.update(phase="forward", samples_planned=progress.planned, samples_done=progress.samples)

    def after_batch(self, progress: LoopProgress) -> None:
        self.status.update(samples_done=progress.samples, batches_done=progress.batches)

    def waiting_for_data(self, since: float | None) -> None:
        self.status.mark(t_data_wait=since)

    def after_dummy(self, progress: LoopProgress) -> None:
        self.status.update(dummy_steps_done=progress.dummy_steps, dummy_steps_planned=progress.dummy_planned)


class CallbackHook(LoopHook):
    """``after_batch`` as a plain function of the progress (progress display, peer watching, benchmarks)."""

    def __init__(self, fn: Callable[[LoopProgress], None]):
        self.fn = fn

    def after_batch(self, progress: LoopProgress) -> None:
        self.fn(progress)


class FaultHook(LoopHook):
    """Fault drills of ``DISTEVAL_FAULTS`` (``disteval.faults.FaultPlan``): noise on outputs, kill or delay
    after a batch."""

    def __init__(self, faults: Any):
        self.faults = faults

    def on_outputs(self, outputs: Any) -> Any:
        return self.faults.on_outputs(outputs)

    def after_batch(self, progress: LoopProgress) -> None:
        self.faults.on_batch(progress.batches)


class GuardHook(LoopHook):
    """The preemption guard (``disteval.rank.resume.PreemptionGuard``): its checkpoint signal waits for whole
    batches; it reads the samples done from the progress it is given."""

    def __init__(self, guard: Any):
        self.guard = guard

    def before_loop(self, progress: LoopProgress) -> None:
        self.guard.progress = progress

    def batch_scope(self) -> ContextManager:
        return self.guard.batch()
