"""Ranks for tests/test_embedding_dist.py: one process group runs every sharded top-k case
(``Communicator.sharded_topk``) on batch-aligned shards of the gallery and of the queries."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from bitwise_workers import job
from disteval.rank.bootstrap import apply_compute_settings, open_records
from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
from disteval.rank.engine import RankRun
from disteval.common.ranges import batch_aligned_bounds
from disteval.common.topk import Rows, SearchSpec

GALLERY_BATCH, QUERY_BATCH = 64, 16


def run_engine_case(run_dir: Path, cfg, env: RankEnv) -> None:
    """One whole-engine run (task, loop, after_loop search, synchronisation, results.json on rank 0) inside the
    existing process group (as tests/bitwise_workers.py's engine_cases_worker)."""
    ctx = open_records(cfg, str(run_dir), env)
    try:
        ctx.device, ctx.backend, ctx.comm = torch.device("cpu"), "gloo", Communicator()
        apply_compute_settings(ctx)
        run = RankRun(ctx)
        run.outcomes.append(run.trial())
        run.finish(time.perf_counter())
        ctx.status.update(phase="done", force=True)
    except BaseException as exc:
        ctx.status.fail(exc)
        raise


@record
def topk_worker(out_dir: str, data_path: str, cases: dict[str, dict], engine_cases: dict[str, dict]) -> None:
    """For each case {gallery, queries (array names), n_queries, k, similarity, chunk, tile_queries,
    tile_gallery}: this rank's batch-aligned shards -> sharded_topk; writes OUT/<case>.rank<r>.npz with the
    rank's query positions, scores and gallery positions, and the bytes this rank sent. Then each of
    ``engine_cases`` (config overrides) through the engine's RankRun in the same process group, results.json
    in OUT/<name>/."""
    env = RankEnv.from_env()
    init_process_group("gloo", 120, env)
    torch.set_num_threads(1)
    try:
        data = np.load(data_path)
        for name, c in cases.items():
            gallery = torch.from_numpy(data[c["gallery"]])
            queries = torch.from_numpy(data[c["queries"]][:c["n_queries"]])
            g0, g1 = batch_aligned_bounds(gallery.shape[0], GALLERY_BATCH, env.world_size, env.rank)
            q0, q1 = batch_aligned_bounds(queries.shape[0], QUERY_BATCH, env.world_size, env.rank)
            comm = Communicator()
            spec = SearchSpec(c["k"], c["similarity"], c["chunk"], c["tile_queries"], c["tile_gallery"])
            qpos = torch.arange(q0, q1).flip(0)  # any order in, the same order out
            scores, ids = comm.sharded_topk(Rows(gallery[g0:g1], torch.arange(g0, g1)), Rows(queries[qpos], qpos),
                                            queries.shape[0], spec)
            np.savez(Path(out_dir) / f"{name}.rank{env.rank}.npz", positions=qpos.numpy(), scores=scores.numpy(),
                     ids=ids.numpy(), bytes=np.int64(comm.bytes), collectives=np.int64(comm.collectives))
        for name, overrides in engine_cases.items():
            run_engine_case(Path(out_dir) / name, job(overrides), env)
    finally:
        destroy_process_group()
