"""Checks on the driver before any rank starts: everything knowable up front fails here, naming the key."""
from __future__ import annotations

import errno
import math
import os
import socket
from typing import Any

import torch

from disteval.comm import external_launch_detected, resolve_backend, resolve_device
from disteval.data.datasets import check_data_root, dataset_num_classes, input_shape, prepare_data
from disteval.errors import ConfigError
from disteval.faults import ENV as FAULTS_ENV, check_ranks as check_fault_ranks, parse as parse_faults
from disteval.data.sharding import SAMPLERS
from disteval.metrics import METRIC_FAMILIES
from disteval.metrics.robust import AGGREGATES
from disteval.models import preflight_model, resolve_num_classes
from disteval.precision import check_metric_dtypes, model_dtype_name


def validate_config(cfg: Any) -> None:
    """Value checks the schema's types cannot express. Raises ConfigError naming the key."""
    if cfg.dist.world_size < 1:
        raise ConfigError("dist.world_size", f"must be >= 1, got {cfg.dist.world_size}")
    if cfg.dist.launcher != "local":
        raise ConfigError("dist.launcher", f"unknown launcher {cfg.dist.launcher!r}; available: ['local'] "
                          "(or start ranks yourself with torchrun)")
    if cfg.data.batch_size < 1:
        raise ConfigError("data.batch_size", f"must be >= 1, got {cfg.data.batch_size}")
    if cfg.data.limit is not None and cfg.data.limit < 1:
        raise ConfigError("data.limit", f"must be >= 1 (or null for the whole dataset), got {cfg.data.limit}")
    if cfg.data.num_workers < 0:
        raise ConfigError("data.num_workers", f"must be >= 0, got {cfg.data.num_workers}")
    if not math.isfinite(cfg.communication.timeout_s) or cfg.communication.timeout_s <= 0:
        raise ConfigError("communication.timeout_s", f"must be a finite number of seconds > 0, got "
                          f"{cfg.communication.timeout_s}")
    cc = cfg.communication
    for key, low, nullable in (("async_threshold_bytes", 0, True), ("chunk_bytes", 1, False),
                               ("max_in_flight", 1, False), ("reduce_scatter_min_bytes", 0, True)):
        value = cc.get(key)
        if (value is None and not nullable) or (value is not None and value < low):
            raise ConfigError(f"communication.{key}", f"must be an integer >= {low}"
                              f"{' or null' if nullable else ''}, got {value}")
    if cfg.eval.trials < 1:
        raise ConfigError("eval.trials", f"must be >= 1, got {cfg.eval.trials}")
    if cfg.eval.trial_aggregate not in AGGREGATES:
        raise ConfigError("eval.trial_aggregate", f"{cfg.eval.trial_aggregate!r} is not one of {list(AGGREGATES)}")
    for key in ("clip_sigma", "outlier_z"):
        if not (math.isfinite(float(cfg.eval[key])) and float(cfg.eval[key]) > 0):
            raise ConfigError(f"eval.{key}", f"must be a finite number > 0, got {cfg.eval[key]}")
    if cfg.data.sampler not in SAMPLERS:
        raise ConfigError("data.sampler", f"{cfg.data.sampler!r} is not one of {list(SAMPLERS)}")
    if cfg.eval.exclude_outlier_ranks and cfg.data.sampler != "exact":
        raise ConfigError("eval.exclude_outlier_ranks", f"needs data.sampler=exact: with {cfg.data.sampler} the ranks "
                          "share repeated samples, so leaving a rank out is not leaving its shard out")
    if cfg.eval.exclude_outlier_ranks and "classification" not in cfg.eval.metrics:
        raise ConfigError("eval.exclude_outlier_ranks", "outlier ranks are found from per-rank top-1 accuracy: "
                          "it needs classification in eval.metrics")
    sync_t = cfg.communication.sync_timeout_s
    if sync_t is not None and (not math.isfinite(sync_t) or sync_t <= 0):
        raise ConfigError("communication.sync_timeout_s", f"must be a finite number of seconds > 0 or null, got {sync_t}")
    if not cfg.eval.metrics:
        raise ConfigError("eval.metrics", f"needs at least one metric family of {list(METRIC_FAMILIES)}")
    unknown = [m for m in cfg.eval.metrics if m not in METRIC_FAMILIES]
    if unknown:
        raise ConfigError("eval.metrics", f"unknown metric families {unknown}; available: {list(METRIC_FAMILIES)}")
    if not cfg.eval.topk or any(k < 1 for k in cfg.eval.topk):
        raise ConfigError("eval.topk", f"needs positive integers, got {list(cfg.eval.topk)}")
    if cfg.eval.ece_bins < 1:
        raise ConfigError("eval.ece_bins", f"must be >= 1, got {cfg.eval.ece_bins}")
    check_metric_dtypes(cfg.precision)
    model_dtype_name(cfg.precision)
    device = resolve_device(cfg.dist.device, 0)
    if str(getattr(cfg.dist.device, "value", cfg.dist.device)) == "cuda" and not torch.cuda.is_available():
        raise ConfigError("dist.device", "cuda requested but torch.cuda.is_available() is False")
    try:
        resolve_backend(cfg.communication.backend, device)
    except ValueError as exc:
        raise ConfigError("communication.backend", str(exc)) from None
    if cfg.data.name == "imagefolder":
        if cfg.data.resize_size < 1 or cfg.data.crop_size < 1:
            raise ConfigError("data.crop_size" if cfg.data.crop_size < 1 else "data.resize_size",
                              f"must be >= 1 pixel, got {cfg.data.resize_size} / {cfg.data.crop_size}")
        if len(cfg.data.mean) != 3 or len(cfg.data.std) != 3 or any(v <= 0 for v in cfg.data.std):
            raise ConfigError("data.mean", f"data.mean and data.std need 3 values (RGB), std > 0; got "
                              f"{list(cfg.data.mean)} / {list(cfg.data.std)}")


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


def preflight(cfg: Any, notes: list[str] | None = None) -> int:
    """All driver-side checks: config values, dataset root, model/checkpoint/weights, top-k vs classes.
    Returns the number of classes; warnings for valid but ineffective settings are appended to ``notes``. Raises ConfigError, CheckpointError or DataError."""
    validate_config(cfg)
    try:
        world = int(os.environ["WORLD_SIZE"]) if external_launch_detected() else int(cfg.dist.world_size)
        check_fault_ranks(parse_faults(os.environ.get(FAULTS_ENV)), world)
    except ValueError as exc:
        message = str(exc).removeprefix(f"{FAULTS_ENV}: ")
        raise ConfigError(FAULTS_ENV, f"{message} (an environment variable for fault drills; unset it to run "
                          "normally)") from None
    if cfg.dist.world_size > 1 and not external_launch_detected():
        check_rendezvous_address(cfg.dist.master_addr, cfg.dist.master_port)
    from disteval.detection import check_detection_config, is_detection

    if is_detection(cfg):
        check_detection_config(cfg)
        return 0
    if "coco" in cfg.eval.metrics:
        raise ConfigError("eval.metrics", "the coco family needs detection data (data=coco or data=coco_replay)")
    check_data_root(cfg.data)
    prepare_data(cfg.data)
    data_classes = dataset_num_classes(cfg.data)
    num_classes = resolve_num_classes(cfg.model, data_classes)
    if num_classes != data_classes:
        raise ConfigError("data.root" if cfg.data.name == "imagefolder" else "model.num_classes",
                          f"the dataset {cfg.data.name} ({cfg.data.root or 'bundled'}) has {data_classes} classes but "
                          f"the model {cfg.model.name} has {num_classes} outputs: labels would not line up with the "
                          "model's classes (an ImageFolder root must hold every class folder, e.g. all 1000 ImageNet "
                          "wnids)")
    too_big = [k for k in cfg.eval.topk if k > num_classes]
    if too_big:
        raise ConfigError("eval.topk", f"k={too_big} exceed the {num_classes} classes; e.g. eval.topk=[1]")
    preflight_model(cfg.model, num_classes, input_shape(cfg.data))
    from disteval.engine import SyncPolicy, build_metric, check_sync_policy, sync_policy_notes
    metric, policy = build_metric(cfg, num_classes), SyncPolicy.from_config(cfg.communication)
    check_sync_policy(metric, policy)
    if notes is not None:
        notes.extend(sync_policy_notes(metric, policy))
    return num_classes
