"""Ranks for tests/test_bitwise_dist.py: one group of W ranks runs many whole-engine cases (the real task,
model, loop, sync and results.json of ``disteval.rank.engine.RankRun``) inside one process group."""
from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from disteval.rank.bootstrap import apply_compute_settings, open_records
from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
from disteval.config import DistevalConfig, JobConfig, job_config
from disteval.rank.engine import RankRun


def job(overrides: dict) -> JobConfig:
    """A job config: the schema's defaults merged with ``overrides`` (nested dicts), as Hydra would compose, typed
    and validated as a rank receives it (``disteval.config.job_config``)."""
    cfg = OmegaConf.merge(OmegaConf.structured(DistevalConfig), {"eval": {"progress": False}}, overrides)
    return job_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def run_engine_case(env: RankEnv, out_dir: str, name: str, overrides: dict) -> RankRun:
    """One whole-engine run of this rank inside the already joined process group: RankRun's trial and finish
    (results.json in OUT/<name>/ on rank 0). Returns the RankRun; an exception is recorded in the rank's
    status.json and propagates."""
    cfg = job(overrides)
    ctx = open_records(cfg, str(Path(out_dir) / name), env)
    try:
        ctx.device, ctx.backend, ctx.comm = __import__("torch").device("cpu"), "gloo", Communicator()
        apply_compute_settings(ctx)
        run = RankRun(ctx)
        run.outcomes.append(run.trial())
        run.finish(time.perf_counter())
        ctx.status.update(phase="done", force=True)
        return run
    except BaseException as exc:
        ctx.status.fail(exc)
        raise


@record
def engine_cases_worker(out_dir: str, cases: dict[str, dict]) -> None:
    """For each named case (config overrides): run the engine's RankRun on this rank inside the one process
    group, results.json in OUT/<name>/ (rank 0)."""
    env = RankEnv.from_env()
    init_process_group("gloo", 300, env)
    try:
        for name, overrides in cases.items():
            run_engine_case(env, out_dir, name, overrides)
    finally:
        destroy_process_group()


def load_metrics(out_dir: Path, name: str) -> dict:
    return json.loads((out_dir / name / "results.json").read_text())
