"""Checks on the driver before any rank starts: everything knowable up front fails here, naming the key."""
from __future__ import annotations

import errno
import os
import socket
from typing import Any

import torch

from disteval.common import netif
from disteval.common.problems import Problems
from disteval.comm import external_launch_detected, resolve_backend, resolve_device
from disteval.config import JobConfig, job_config
from disteval.errors import ConfigError, RendezvousError
from disteval.models.builders import tp_split_problems, weights_plan
from disteval.models.checkpoint_set import expand_checkpoints, with_checkpoint
from disteval.faults import ENV as FAULTS_ENV, check_ranks as check_fault_ranks, parse as parse_faults
from disteval.job.journal import check_resume, resume_dir, resume_problem
from disteval.rank.sync import SyncPolicy, check_sync_policy, sync_policy_notes
from disteval.tasks import resolve_task


def validate_config(cfg: Any) -> JobConfig:
    """The schema's own checks (each config dataclass validates its fields, ``disteval.config``) and the
    device/backend pair. ``cfg``: a ``JobConfig`` or a job container (dict or DictConfig). Returns the typed
    ``JobConfig``. Raises ConfigError naming the key."""
    cfg = job_config(cfg)
    device = resolve_device(cfg.dist.device, 0)
    if str(getattr(cfg.dist.device, "value", cfg.dist.device)) == "cuda" and not torch.cuda.is_available():
        raise ConfigError("dist.device", "cuda requested but torch.cuda.is_available() is False")
    try:
        resolve_backend(cfg.communication.backend, device)
    except ValueError as exc:
        raise ConfigError("communication.backend", str(exc)) from None
    return cfg


def check_rendezvous_address(addr: str, port: int) -> None:
    """The local launcher hosts the rendezvous store at ``addr:port``: the address must be one of this
    machine's and an explicit port must be free (a port held by another program made the rendezvous hang).
    Raises ConfigError naming dist.master_addr or dist.master_port."""
    try:
        infos = socket.getaddrinfo(addr, port or None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError("dist.master_addr", f"cannot resolve {addr!r}: {exc}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
        except OSError as exc:
            key = "dist.master_port" if exc.errno == errno.EADDRINUSE else "dist.master_addr"
            what = f"port {port} on {addr} is already in use" if key == "dist.master_port" else \
                f"{addr!r} is not an address of this machine ({exc.strerror})"
            raise ConfigError(key, f"{what}; the local launcher hosts the rendezvous there "
                              "(dist.master_port=0 picks a free port)") from None


def check_multi_node(cfg: Any) -> None:
    """A multi-node launch (``dist.nnodes`` > 1) before this node's agent joins the rendezvous: the rendezvous
    host must resolve and be routable from here, and this node's hostname must not resolve to a loopback
    address unless ``dist.local_addr`` says which address to advertise. Raises ConfigError naming the key."""
    host = str(cfg.dist.rdzv_endpoint).rpartition(":")[0]
    if netif.resolve(host) is None:
        raise ConfigError("dist.rdzv_endpoint", f"node {socket.gethostname()}: cannot resolve the rendezvous host "
                          f"{host!r}")
    if netif.route_to(host) is None:  # a network fault, not a setting: exit 1 like a rendezvous that timed out
        raise RendezvousError(socket.gethostname(), str(cfg.dist.rdzv_endpoint), "unreachable", 0.0,
                              f"no route to host {netif.resolve(host)} from this node (link down or a prohibit route)",
                              int(cfg.dist.nnodes))
    problem = netif.loopback_hostname_error(host, cfg.dist.local_addr)
    if problem:
        raise ConfigError("dist.local_addr", problem)


def preflight(cfg: Any, notes: list[str] | None = None) -> None:
    """All driver-side checks: the rendezvous address of a local or multi-node launch, then ``check_job``.
    Warnings for valid but ineffective settings are appended to ``notes``. Raises ConfigError, CheckpointError,
    DataError or RendezvousError."""
    notes = notes if notes is not None else []
    cfg = validate_config(cfg)
    if cfg.dist.nnodes > 1 and not external_launch_detected():
        check_multi_node(cfg)
    elif cfg.dist.world_size > 1 and not external_launch_detected():
        check_rendezvous_address(cfg.dist.master_addr, cfg.dist.master_port)
    check_job(cfg, notes)


def check_job(cfg: Any, notes: list[str]) -> None:
    """The checks of one job wherever its ranks will run (the local launcher, and a scheduling launcher on the
    submitting host before anything is submitted): config values, fault drills, ``dist.parallel``, then the
    task's own (dataset root, model/checkpoint/weights, metric families) and the sync policy against the task's
    metric. Warnings are appended to ``notes``. Raises ConfigError, CheckpointError or DataError; the problems of
    independent checks together, as one PreflightProblems (a ConfigError listing them all)."""
    cfg = validate_config(cfg)
    problems = Problems()  # the independent checks all run: one try reports every problem
    with problems.check():
        try:
            world = int(os.environ["WORLD_SIZE"]) if external_launch_detected() else int(cfg.dist.world_size)
            check_fault_ranks(parse_faults(os.environ.get(FAULTS_ENV)), world)
        except ValueError as exc:
            message = str(exc).removeprefix(f"{FAULTS_ENV}: ")
            raise ConfigError(FAULTS_ENV, f"{message} (an environment variable for fault drills; unset it to run "
                              "normally)") from None
    with problems.check():
        check_parallel(cfg, notes)
    # model.checkpoints: the task's checks once per file (each must load into the architecture), notes once
    jobs = [cfg]
    with problems.check():
        jobs = [with_checkpoint(cfg, m.path) for m in expand_checkpoints(cfg.model.checkpoints)] or [cfg]
    for job in jobs:
        seen = list(notes)
        with problems.check():
            resolve_task(job)(job).preflight(notes)
        notes[len(seen):] = [n for n in notes[len(seen):] if n not in seen]
    problems.raise_any()  # the checks below need the task's data and model
    task = resolve_task(cfg)(cfg)
    if cfg.eval.exclude_outlier_ranks and task.rank_metric is None:
        raise ConfigError("eval.exclude_outlier_ranks", f"task {task.name or type(task).__name__} has no per-rank "
                          "metric to find outlier ranks from (Task.rank_metric; classification's is top-1 accuracy)")
    if resume_dir(cfg):  # the records are of this run, and the run can be resumed exactly
        why = resume_problem(cfg)
        if why is not None:
            raise ConfigError("eval.resume", f"this run cannot be resumed exactly: {why}")
        check_resume(cfg)
    metric, policy = task.metric(), SyncPolicy.from_config(cfg.communication)
    check_sync_policy(metric, policy)
    notes.extend(sync_policy_notes(metric, policy))


def check_parallel(cfg: Any, notes: list[str]) -> None:
    """``dist.parallel`` before any rank starts (the product of the degrees is checked by the config schema):
    no streamed data (its shards are planned per rank, not per data-parallel rank), no outlier-rank exclusion,
    and with tp > 1 an architecture whose plan splits it ``tp`` ways. A model without weights (random
    initialisation) is said in ``notes`` (results.json warnings and the console). Raises ConfigError naming
    the key."""
    cfg = job_config(cfg)
    if not cfg.dist.parallel.enabled:
        return
    if resolve_task(cfg)(cfg).streamed:
        raise ConfigError("dist.parallel", f"data.name={cfg.data.name} is streamed from tar shards; a device mesh "
                          "needs a map-style dataset")
    if cfg.eval.exclude_outlier_ranks:
        raise ConfigError("eval.exclude_outlier_ranks", "cannot leave ranks out under dist.parallel (a rank's "
                          "TP/FSDP peers share its shard)")
    tp = cfg.dist.parallel.tp or 1
    if tp > 1:
        problems = tp_split_problems(cfg.model, tp)
        if problems:
            raise ConfigError("dist.parallel.tp", f"model.name={cfg.model.name}: {'; '.join(problems)}")
    if weights_plan(cfg.model)[0] == "random":
        notes.append(f"model.name={cfg.model.name} runs with random initialisation (seed {cfg.seed}; no "
                     "model.weights or model.checkpoint): the metrics measure the pipeline, not a trained model")


def preflight_without_kernels(cfg: Any, notes: list[str]) -> None:
    """``preflight`` in a forked child, for a rank of an external launcher (torchrun, srun) with
    ``dist.heterogeneous=pin``: the checks build metrics and models, i.e. run torch kernels, and the first kernel
    fixes the process's CPU kernel set (``disteval.common.kernels``), which the rank must still be free to pin
    after meeting its peers. The child reports the notes, or its error's type, key and message, as JSON through
    a pipe; the same error is raised here. Call it before this process starts threads."""
    import json

    from disteval.errors import CheckpointError, DataError, DistevalError

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child_notes: list[str] = []
            preflight(cfg, child_notes)
            out = {"notes": child_notes}
        except DistevalError as exc:
            out = {"type": type(exc).__name__, "key": getattr(exc, "key", None),
                   "message": str(exc).removeprefix(f"{getattr(exc, 'key', '')}: ")}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it as a DistevalError
            out = {"type": "DistevalError", "message": f"preflight failed: {type(exc).__name__}: {exc}"}
        try:
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks).decode() or '{"type": "DistevalError", "message": "preflight died"}')
    if "notes" in out:
        notes.extend(out["notes"])
        return
    if out["type"] == "ConfigError":
        raise ConfigError(out["key"], out["message"])
    raise {"CheckpointError": CheckpointError, "DataError": DataError,
           "RendezvousError": DistevalError}.get(out["type"], DistevalError)(out["message"])
