"""Live probes (``doctor --probe``): start the run's world size of ranks again, the way the local launcher
does (torch.distributed.elastic), with the run's configuration, and measure

* rendezvous: ``monitored_barrier`` (gloo) with ``wait_all_ranks``, naming ranks that did not arrive;
* collective latency: median seconds of an 8-byte all_reduce (20 calls) and of one the size of the run's
  largest recorded payload (3 calls, capped at 64 MiB), and a timeout that fits: max(30 s, 20 x the payload time);
* shard balance: each rank times two batches of its own exact shard and projects its forward seconds;
* cross-rank drift: the same canary batch (the dataset's first samples) on every rank; rank 0 compares the
  outputs of every rank with the reference (max |difference|; for logits, argmax disagreements), for mixed
  hardware or a rank that loaded other weights.

Data, model and step come from the run's Task, so every task family is probed (streamed data: no balance).

Rank 0 writes ``OUT_DIR/probe.json``; nothing is written into the run's own records.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

CANARY = 32
PAYLOAD_CAP = 64 * 1024 * 1024


@record
def probe_entry(cfg_container: dict, out_dir: str, payload_bytes: int) -> None:
    """One probe rank (started by torch.distributed.elastic; env:// variables set)."""
    import torch
    import torch.distributed as dist
    from disteval.comm import RankEnv, init_process_group
    from disteval.config import job_config

    cfg = job_config(cfg_container)  # typed and validated, as a rank of the run received it
    env = RankEnv.from_env()
    torch.set_num_threads(1)
    timeout = min(float(cfg.communication.timeout_s), 60.0)
    init_process_group("gloo", timeout, env)
    out: dict = {"world_size": env.world_size}
    t0 = time.perf_counter()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        out["rendezvous"] = {"missing": [], "seconds": time.perf_counter() - t0, "timeout_s": timeout}
    except RuntimeError as exc:
        missing = sorted({int(r) for r in re.findall(r"\d+", str(exc).split("monitoredBarrier")[0].split("Ranks")[-1])})
        out["rendezvous"] = {"missing": missing, "error": str(exc)[:500], "timeout_s": timeout}
        if env.rank == 0:
            _write(out_dir, out)
        raise
    small = torch.zeros(1, dtype=torch.int64)
    times = []
    for _ in range(20):
        t = time.perf_counter()
        dist.all_reduce(small)
        times.append(time.perf_counter() - t)
    n = max(1, min(int(payload_bytes), PAYLOAD_CAP) // 8)
    big = torch.zeros(n, dtype=torch.float64)
    big_times = []
    for _ in range(3):
        t = time.perf_counter()
        dist.all_reduce(big)
        big_times.append(time.perf_counter() - t)
    payload_s = statistics.median(big_times)
    out["latency"] = {"small_s": statistics.median(times), "payload_bytes": n * 8, "payload_s": payload_s,
                      "suggested_timeout_s": float(max(30, round(20 * payload_s * max(1.0, payload_bytes / (n * 8)))))}
    out.update(_task_probes(cfg, env))
    dist.barrier()
    if env.rank == 0:
        _write(out_dir, out)
    dist.destroy_process_group()


def _task_probes(cfg, env) -> dict:
    """Shard balance and cross-rank drift through the run's Task (``disteval.tasks``): its dataset, model,
    collate and step, so every task family is probed alike. Each rank times two batches of its own exact shard;
    the canary is the dataset's first ``CANARY`` samples through the task's step on every rank, its outputs
    flattened (``disteval.rank.canary.output_tensors``) and compared with the reference (the element-wise median over
    ranks at W >= 3, else rank 0): max |difference| and, for logits [B, C], argmax disagreements. Streamed data
    (no sample every rank can index) gives ``{"balance": {"skipped": why}}``."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from disteval.rank.canary import output_tensors
    from disteval.common.ranges import batch_aligned_bounds, shard_bounds
    from disteval.data.streaming import StreamSource
    from disteval.faults import FaultPlan
    from disteval.tasks import resolve_task

    task = resolve_task(cfg)(cfg)
    task.join(env.rank, None)
    dataset = task.dataset()
    if isinstance(dataset, StreamSource):
        return {"balance": {"skipped": "streamed data (tar shards): no sample every rank can index; see the run's "
                            "own per-rank records"}}
    device = torch.device("cpu")
    model = task.model(device)
    if model is not None:
        FaultPlan(env.rank).on_model(model)
    collate = task.collate_fn() or default_collate
    bs = int(cfg.data.batch_size)
    bitwise = cfg.eval.mode == "bitwise"
    start, end = (batch_aligned_bounds(len(dataset), bs, env.world_size, env.rank) if bitwise
                  else shard_bounds(len(dataset), env.world_size, env.rank))
    idx = list(range(start, min(end, start + 2 * bs)))
    with torch.inference_mode():
        t = time.perf_counter()
        for i in range(0, len(idx), bs):
            task.step(model, collate([dataset[j] for j in idx[i:i + bs]])[0], device)
        secs = time.perf_counter() - t
        canary = collate([dataset[j] for j in range(min(CANARY, len(dataset)))])[0] if len(dataset) else None
        outputs = task.step(model, canary, device) if canary is not None else None
    tensors = output_tensors(outputs)
    flat = torch.cat([x.double().reshape(-1) for x in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)
    ips = len(idx) / secs if secs > 0 and idx else 0.0
    row = torch.tensor([float(end - start), ips, (end - start) / ips if ips else 0.0, float(flat.numel())],
                       dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(env.world_size)]
    dist.all_gather(rows, row)
    out = {"balance": {"samples": [int(r[0]) for r in rows], "images_per_s": [float(r[1]) for r in rows],
                       "projected_s": [float(r[2]) for r in rows]}}
    if len({int(r[3]) for r in rows}) > 1:  # other output sizes (e.g. another number of detections)
        out["drift"] = {"batch": min(CANARY, len(dataset)), "tolerance": 1e-4, "reference": "rank 0",
                        "max_abs_logit_diff": [float("inf") if int(r[3]) != int(rows[0][3]) else 0.0 for r in rows],
                        "argmax_disagreements": [0] * env.world_size, "sizes": [int(r[3]) for r in rows]}
        return out
    out["drift"] = _drift(flat, tensors, env.world_size, min(CANARY, len(dataset)))
    return out


def _drift(flat, tensors: list, world_size: int, batch: int) -> dict:
    """Every rank's canary outputs (``flat``: float64 [n], the same n on every rank) against the reference: the
    element-wise median over ranks (W >= 3), so a lone odd rank 0 is named as such; with two ranks there is no
    majority and the difference is reported against rank 0. One all_gather."""
    import torch
    import torch.distributed as dist

    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    ref = torch.stack(gathered).median(dim=0).values if world_size >= 3 else gathered[0]
    logits = len(tensors) == 1 and tensors[0].ndim == 2 and tensors[0].is_floating_point()
    shape = tensors[0].shape if logits else None
    return {"batch": batch, "tolerance": 1e-4, "reference": "median of ranks" if world_size >= 3 else "rank 0",
            "max_abs_logit_diff": [float((g - ref).abs().max()) if g.numel() else 0.0 for g in gathered],
            "argmax_disagreements": [int((g.reshape(shape).argmax(1) != ref.reshape(shape).argmax(1)).sum())
                                     if logits and g.numel() else 0 for g in gathered]}


def _write(out_dir: str, out: dict) -> None:
    from disteval.job.records import atomic_write_json, json_safe

    atomic_write_json(Path(out_dir) / "probe.json", json_safe(out))


def run_probes(run, out_dir: Path) -> dict:
    """Launch the probe ranks for ``run`` (a ``diagnostics.evidence.Run`` with a config) the way the run's ranks
    were launched (``launchers.protocol.Launcher.run_probe``) and return the probe results, with ``path`` (where
    probe.json is), ``launcher`` and ``error`` / ``culprit`` when the probe ranks failed.
    Raises ValueError when the run has no readable .hydra/config.yaml."""
    from omegaconf import OmegaConf

    from disteval.errors import RankFailedError
    from diagnostics.remedies import launcher_choice
    from launchers.protocol import ProbeRequest
    from launchers.registry import launcher_for

    if run.config is None:
        raise ValueError(f"{run.path}/.hydra/config.yaml is missing: the probes need the run's configuration")
    container = OmegaConf.to_container(run.config, resolve=True)
    payload = max([int((s.get("last_collective") or {}).get("bytes") or 0) for s in run.statuses.values() if s]
                  + [1 << 20])
    out_dir.mkdir(parents=True, exist_ok=True)
    size = int(run.world_size or container["dist"]["world_size"])
    launcher = launcher_for(launcher_choice(run))
    result: dict = {}
    try:
        launcher.run_probe(ProbeRequest(probe_entry, container, out_dir, payload, size, launcher_options(run)))
    except RankFailedError as exc:
        result = {"error": str(exc), "culprit": exc.rank}
    except Exception as exc:  # noqa: BLE001 - a failed scheduler job: its error is the finding
        result = {"error": f"{type(exc).__name__}: {str(exc)[-1000:]}", "culprit": None}
    result["launcher"] = launcher.name
    path = out_dir / "probe.json"
    if path.exists():
        result = {**json.loads(path.read_text()), **result}
    result["path"] = str(path)
    return result


def launcher_options(run) -> dict:
    """The run's ``hydra.launcher`` settings as plain values ({} without .hydra/hydra.yaml); a setting that
    interpolates the sweep's own fields is left out (the probes do not need it)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(run.hydra, "hydra.launcher") if run.hydra is not None else None
    params: dict = {}
    for key in (node.keys() if node is not None else ()):
        try:
            value = OmegaConf.select(node, key)
            params[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception:  # noqa: BLE001 - an interpolation into the sweep's own fields
            continue
    return params
