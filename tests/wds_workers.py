"""Ranks for tests/test_wds_dist.py: one group of W real gloo ranks runs every streamed case of that W inside one
process group: whole-engine runs (``disteval.rank.engine.RankRun``: task, model, loop, sync, coverage, results.json)
over tar shards and over the map-style copy of the same images, a shard cut after indexing read through the
loop, and a preemption drill (the checkpoint signal mid-shard, then a resumed run from the checkpoints)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from bitwise_workers import run_engine_case
from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
from disteval.data.index import load_index
from disteval.data.streaming import StreamSource
from disteval.data.wds_stream import SampleFormat
from disteval.errors import DataError
from disteval.faults import ENV as FAULTS_ENV
from disteval.rank.loop import ShardSpec, evaluate_shard
from disteval.metrics import ClassificationMetrics
from disteval.metrics.evaluator import Evaluator
from disteval.job.records import StatusWriter
from disteval.common import launch_env


class Requeued(Exception):
    """Raised by the stand-in for submitit's checkpoint-signal handler (which requeues the job and exits)."""


def _requeue(signum, frame):
    """Every rank gets the signal after its own K-th batch (SLURM signals all tasks of a job at once): wait
    until all have saved (an all-reduce, under the group's timeout) before ending, so that rank 0's peer
    watch never sees a requeued peer as failed before its own signal."""
    Communicator().all_reduce_(torch.zeros(1))
    raise Requeued()


def read_cut_shards(env: RankEnv, out_dir: str, name: str, index: str, urls: list[str], batch_size: int,
                    num_workers: int) -> None:
    """This rank's planned batches of a shard set whose index no longer matches a cut shard, through the loop
    (``evaluate_shard``, a real DataLoader with ``num_workers`` workers and a linear model): writes
    OUT/<name>/rank{r}.json with the DataError's message (None when the rank's ranges miss the cut part) and
    the samples counted."""
    source = StreamSource(load_index(index, urls), SampleFormat(image_mode="l8"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10)).eval()
    ev = Evaluator(ClassificationMetrics(10, topk=(1,)), bitwise=True)
    spec = ShardSpec(env.rank, env.world_size, batch_size, num_workers=num_workers)
    out = {"error": None, "samples": None}
    try:
        out["samples"] = evaluate_shard(model, source, ev, spec).samples
    except DataError as exc:
        out["error"] = str(exc)
    Path(out_dir, name).mkdir(parents=True, exist_ok=True)
    Path(out_dir, name, f"rank{env.rank}.json").write_text(json.dumps(out))


def preempt_then_resume(env: RankEnv, out_dir: str, name: str, overrides: dict, batch: int) -> None:
    """The preemption drill inside a requeueing launcher's job (DISTEVAL_JOB_ID and DISTEVAL_PREEMPT_SIGNAL set,
    as the submitit launcher exports them, so the engine's PreemptionGuard is active):
    ``DISTEVAL_FAULTS=preempt@*:batch=K`` sends every rank the checkpoint signal after its K-th batch; the guard
    saves the rank's checkpoint and hands the signal to the previous handler, here a stand-in for
    submitit's that ends the run (``Requeued``). The same job then runs again in the same folder and resumes
    from the checkpoints (the requeued job). Writes OUT/<name>/ranks/rank{r}/drill.json: whether the first run
    was preempted and the checkpoint's samples_done."""
    os.environ.update({launch_env.JOB_ID: f"drill-{name}", launch_env.PREEMPT_SIGNAL: "USR2"})
    previous = signal.signal(launch_env.preempt_signal(), _requeue)
    os.environ[FAULTS_ENV] = f"preempt@*:batch={batch}"
    preempted = False
    try:
        try:
            run_engine_case(env, out_dir, name, overrides)
        except Requeued:
            preempted = True
        finally:
            del os.environ[FAULTS_ENV]
            signal.signal(launch_env.preempt_signal(), previous)
        rank_dir = Path(out_dir, name, "ranks", f"rank{env.rank}")
        ckpt = torch.load(rank_dir / "checkpoint.pt", weights_only=True) if preempted else None
        # the requeued job: every rank's record is fresh before any rank resumes (run_rank's rendezvous orders
        # this: rank 0's peer watch must not read a peer's record of the preempted run)
        StatusWriter(str(Path(out_dir, name)), env.rank, env.world_size)
        Communicator().all_reduce_(torch.zeros(1))
        run = run_engine_case(env, out_dir, name, overrides)  # same config, same folder
        run.ckpt_path.unlink(missing_ok=True)  # as run_rank does when the rank finishes
        (rank_dir / "drill.json").write_text(json.dumps(
            {"preempted": preempted, "samples_done": None if ckpt is None else int(ckpt["samples_done"]),
             "skipped_in_checkpoint": None if ckpt is None else ckpt["state"]["stream_skipped"].tolist()}))
    finally:
        del os.environ[launch_env.JOB_ID], os.environ[launch_env.PREEMPT_SIGNAL]


@record
def stream_cases_worker(out_dir: str, cases: dict[str, dict], cut: dict[str, dict], drills: dict[str, dict]) -> None:
    """Inside one process group: every engine case (config overrides; results.json in OUT/<name>/), every
    cut-shard read (``read_cut_shards`` keyword arguments) and every preemption drill
    (``preempt_then_resume`` keyword arguments). Each rank writes the seconds of each case to
    OUT/seconds_rank{r}.json (where the test's time goes)."""
    env = RankEnv.from_env()
    init_process_group("gloo", 300, env)
    seconds = {}
    try:
        for name, overrides in cases.items():
            t = time.perf_counter()
            run_engine_case(env, out_dir, name, overrides)
            seconds[name] = time.perf_counter() - t
        for name, kw in cut.items():
            t = time.perf_counter()
            read_cut_shards(env, out_dir, name, **kw)
            seconds[name] = time.perf_counter() - t
        for name, kw in drills.items():
            t = time.perf_counter()
            preempt_then_resume(env, out_dir, name, **kw)
            seconds[name] = time.perf_counter() - t
        Path(out_dir, f"seconds_rank{env.rank}.json").write_text(json.dumps(seconds))
    finally:
        destroy_process_group()
