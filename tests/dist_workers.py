"""Functions run inside real ranks (started by launchers.local.launch) by the distributed tests.
Each starts the process group once and runs many cases inside it."""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import TensorDataset

from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
from disteval.data import IndexedDataset
from disteval.rank.loop import ShardSpec, evaluate_shard
from disteval.metrics.evaluator import Evaluator
from disteval.rank.sync import SyncPolicy, synchronise, synchronised
from disteval.metrics import (ClassificationMetrics, MetricCollection, RankingMetrics,
                              check_coverage)
from disteval.job.records import StatusWriter

NUM_CLASSES = 7
TOPK = (1, 3)


def multilabel_targets(n: int, seed: int) -> np.ndarray:
    """Deterministic multi-hot targets int64 [n, 7] (about 30 % positives) for the multi-label variant."""
    return (np.random.default_rng(seed + 1).random((n, NUM_CLASSES)) < 0.3).astype(np.int64)


def synthetic_logits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic logits float32 [n, 7] (half of the cases rounded, so ties occur) and labels [n]."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(n, NUM_CLASSES)).astype(np.float32)
    if seed % 2:
        logits = np.round(logits * 2) / 2
    return logits, rng.integers(0, NUM_CLASSES, size=n)


@contextmanager
def rank_with_status(out_dir: str, timeout_s: float = 120) -> Iterator[RankEnv]:
    """This rank's env inside a gloo process group; its status.json in ``out_dir`` says ``done`` when the block
    ends normally and records the exception (re-raised) otherwise; the group is always destroyed."""
    env = RankEnv.from_env()
    status = StatusWriter(out_dir, env.rank, env.world_size)
    try:
        init_process_group("gloo", timeout_s, env)
        yield env
        status.update(phase="done", force=True)
    except BaseException as exc:
        status.fail(exc)
        raise
    finally:
        destroy_process_group()


@record
def exactness_worker(out_dir: str, cases: list[tuple[int, int]]) -> None:
    """For each (N, batch size): evaluate an identity model over synthetic logits on this rank's exact shard,
    synchronise once, and on rank 0 write the computed metrics, coverage and collective counts."""
    with rank_with_status(out_dir) as env:
        comm = Communicator()
        chunked = Communicator(async_threshold_bytes=64, chunk_bytes=48, max_in_flight=2)
        model = torch.nn.Identity()
        for n, batch_size in cases:
            logits, labels = synthetic_logits(n, seed=n)
            dataset = IndexedDataset(TensorDataset(torch.from_numpy(logits), torch.from_numpy(labels)))
            metric = MetricCollection({"classification": ClassificationMetrics(NUM_CLASSES, topk=TOPK),
                                       "ranking": RankingMetrics(NUM_CLASSES)})
            ev = Evaluator(metric)
            outcome = evaluate_shard(model, dataset, ev, ShardSpec(env.rank, env.world_size, batch_size))
            other = copy.deepcopy(ev)
            before = comm.collectives
            runs, rows, _ = astuple(synchronise(ev, comm, {"rank": env.rank, "samples": outcome.samples}))
            # the same states through the other policies: confusion reduce-scattered and finished per slice,
            # gathers losslessly compressed, everything above 64 bytes in async chunks of 48 bytes
            before_alt = chunked.by_op.copy()
            synchronise(other, chunked, {}, SyncPolicy("lossless", None, reduce_scatter_min_bytes=0))
            # multi-label variant: the same logits with multi-hot targets, sigmoid scores
            ml_data = IndexedDataset(TensorDataset(torch.from_numpy(logits),
                                                   torch.from_numpy(multilabel_targets(n, seed=n))))
            ml = RankingMetrics(NUM_CLASSES, multilabel=True)
            ml_ev = Evaluator(ml)
            evaluate_shard(model, ml_data, ml_ev, ShardSpec(env.rank, env.world_size, batch_size))
            local = ml.snapshot()
            with synchronised(ml_ev, comm, {}) as synced:  # global inside the block, local again after it
                ml_global = ml.compute()
            ml_local = ml.compute()
            restored = synced.restore and all(torch.equal(v, local[k]) for k, v in ml.snapshot().items())
            try:
                with synchronised(ml_ev, comm, {}):
                    raise KeyError("inside")  # an error in the block restores the local states too
            except KeyError:
                restored = restored and all(torch.equal(v, local[k]) for k, v in ml.snapshot().items())
            with synchronised(ml_ev, comm, {}, restore=False) as synced:  # stays global
                pass
            kept = not synced.restore and ml.compute() == ml_global
            if env.rank == 0:
                rep = check_coverage(runs, n)
                out = {"metrics": metric.compute(), "coverage_ok": rep.ok, "collectives": comm.collectives - before,
                       "batches": outcome.batches, "rank_samples": [int(r["samples"]) for r in rows],
                       "metrics_alt": other.metric.compute(), "multilabel": ml_global, "ml_local": ml_local,
                       "restored": restored, "kept": kept, "alt_ops": dict(chunked.by_op - before_alt),
                       "alt_wire": {k: v["wire"] for k, v in chunked.compression.items()}}
                Path(out_dir, f"case_{n}_{batch_size}.json").write_text(json.dumps(out))


@record
def padding_worker(out_dir: str) -> None:
    """N=10 at W=4 with a model right only on items 0 and 1 (logits favour the label only there)."""
    env = RankEnv.from_env()
    init_process_group("gloo", 60, env)
    try:
        labels = torch.zeros(10, dtype=torch.long)
        logits = torch.zeros(10, 2)
        logits[:, 1] = 1.0
        logits[:2] = torch.tensor([1.0, 0.0])
        metric = ClassificationMetrics(2, topk=(1,))
        ev = Evaluator(metric)
        evaluate_shard(torch.nn.Identity(), IndexedDataset(TensorDataset(logits, labels)), ev,
                       ShardSpec(env.rank, env.world_size, 4))
        runs = synchronise(ev, Communicator(), {}).runs
        if env.rank == 0:
            Path(out_dir, "padding.json").write_text(json.dumps(
                {"top1": metric.compute()["top1"], "coverage_ok": check_coverage(runs, 10).ok}))
    finally:
        destroy_process_group()


@record
def coco_worker(out_dir: str, cases: list[dict]) -> None:
    """For each case {name, annotations, predictions, iou_type, limit}: this rank matches the images of its
    exact shard, records are gathered to rank 0 by the engine's synchronise, and rank 0 writes the metrics."""
    from disteval.data.coco import load_detections, load_ground_truth
    from disteval.data.sharding import shard_bounds
    from disteval.metrics.detection import CocoDetectionMetric

    env = RankEnv.from_env()
    init_process_group("gloo", 120, env)
    try:
        comm = Communicator()
        for case in cases:
            gt = load_ground_truth(case["annotations"])
            dets = load_detections(case["predictions"], gt, case["iou_type"])
            n = min(gt.num_images, case.get("limit") or gt.num_images)
            start, end = shard_bounds(n, env.world_size, env.rank)
            images = np.arange(start, end)
            metric = CocoDetectionMetric(gt, case["iou_type"])
            metric.add_detections(images, dets.select(images))
            ev = Evaluator(metric)
            ev.coverage.update(torch.from_numpy(images))
            runs = synchronise(ev, comm, {"samples": len(images)}).runs
            if env.rank == 0:
                out = {"metrics": metric.compute(), "coverage_ok": check_coverage(runs, n).ok,
                       "by_op": dict(comm.by_op)}
                Path(out_dir, f"{case['name']}.json").write_text(json.dumps(out))
    finally:
        destroy_process_group()


def parent_and_mark() -> tuple[int, str | None, str | None]:
    """A rank's parent pid (its fork server's) and the environment variables DISTEVAL_TEST_MARK and DISTEVAL_T0 as
    the rank sees them (tests/test_fork_server.py)."""
    import os

    return os.getppid(), os.environ.get("DISTEVAL_TEST_MARK"), os.environ.get("DISTEVAL_T0")


def parent_and_faults() -> tuple[int, str | None]:
    """A rank's parent pid (its fork server's) and DISTEVAL_FAULTS as the rank sees it (tests/test_fork_server.py)."""
    import os

    return os.getppid(), os.environ.get("DISTEVAL_FAULTS")


def say(text: str) -> None:
    """Write "<text>: rank R to stdout" to the rank's stdout and the same with stderr to its stderr (fds 1 and 2)."""
    import os
    import sys

    rank = int(os.environ["RANK"])
    print(f"{text}: rank {rank} to stdout", flush=True)
    print(f"{text}: rank {rank} to stderr", file=sys.stderr, flush=True)
