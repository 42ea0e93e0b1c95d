"""Checks on the driver before any rank starts: everything knowable up front fails here, naming the key."""
from __future__ import annotations

from typing import Any

import torch

from disteval.comm import resolve_backend, resolve_device
from disteval.data.datasets import check_data_root, dataset_num_classes, input_shape, prepare_data
from disteval.errors import ConfigError
from disteval.metrics import METRIC_FAMILIES
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
    if cfg.communication.timeout_s <= 0:
        raise ConfigError("communication.timeout_s", f"must be > 0 seconds, got {cfg.communication.timeout_s}")
    comp = str(getattr(cfg.communication.compression, "value", cfg.communication.compression))
    if comp != "none":
        raise ConfigError("communication.compression", f"{comp!r} is not implemented yet; use none")
    if cfg.eval.trials != 1:
        raise ConfigError("eval.trials", "only eval.trials=1 is implemented in this version")
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


def preflight(cfg: Any) -> int:
    """All driver-side checks: config values, dataset root, model/checkpoint/weights, top-k vs classes.
    Returns the number of classes. Raises ConfigError, CheckpointError or DataError."""
    validate_config(cfg)
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
    return num_classes
