"""The Task protocol and its registry: a task family turns a config into a dataset, a model (or a source
of saved predictions), a metric, a per-batch step and a console section. The loop, the sync and the
engine know no task by name; adding a family is one module that calls ``register_task`` plus its conf/
files, or a class named by import path (``eval.task=package.module:ClassName``)."""
from __future__ import annotations

import abc
import importlib
import inspect
from typing import Any, Callable, ClassVar

import torch
from torch.utils.data import Dataset

from disteval.common.formatting import fmt
from disteval.config import JobConfig, job_config
from disteval.errors import ConfigError
from disteval.metrics.base import Metric
from disteval.metrics import meaning
from disteval.metrics.bootstrap import SampleColumns

_REGISTRY: dict[str, type["Task"]] = {}


class Task(abc.ABC):
    """One task family. Built on the driver (``preflight``) and in every rank from the job config.

    Class attributes: ``name`` (the ``eval.task`` value) and ``data_names`` (the ``data.name`` values this
    task evaluates when ``eval.task=auto``); ``logits_per_sample`` (see below). Dataset items are ``(input, target, sample_id)`` with
    ``sample_id`` the item's index in ``[0, len(dataset))``.
    """

    name: ClassVar[str] = ""
    data_names: ClassVar[tuple[str, ...]] = ()
    # outputs are logits [B, C] against class-index targets [B]: the prediction store (eval.save_predictions) and
    # the bootstrap intervals (eval.ci) take them per sample
    logits_per_sample: ClassVar[bool] = False
    # a key of the metric's ``local_summary()`` stating each rank's own result (a fraction in [0, 1], e.g.
    # classification's "accuracy"): the per-rank console column and outlier-rank detection (eval.outlier_z,
    # eval.exclude_outlier_ranks) use it; None: neither (the task's preflight refuses exclude_outlier_ranks)
    rank_metric: ClassVar[str | None] = None

    def __init__(self, cfg: Any):
        """``cfg``: the job's typed ``disteval.config.JobConfig`` (a job container, dict or DictConfig, is
        validated into one: ConfigError naming the key)."""
        self.cfg: JobConfig = job_config(cfg)
        self.rank = 0
        self.share: Callable[[bytes | None], bytes] | None = None

    def join(self, rank: int, share: Callable[[bytes | None], bytes] | None) -> None:
        """Called by the engine in every rank before ``dataset()``: this rank's index and ``share``, a
        collective that every rank calls once with rank 0's bytes (None elsewhere) and that returns rank 0's
        bytes on every rank (the comm layer's pickle-free ``broadcast_bytes``, under the communication
        timeout). None: one process. A task that reads one large file can read it once on rank 0 and share
        it (``CocoReplayTask``). Ranks must call ``share`` the same number of times, in the same order."""
        self.rank, self.share = rank, share

    def preflight(self, notes: list[str]) -> None:
        """Driver-side checks before any rank starts (files readable, keys consistent, weights fetched once).
        Raises ConfigError / DataError / CheckpointError naming the key or file; appends warnings to
        ``notes``. Default: nothing to check."""

    @abc.abstractmethod
    def dataset(self) -> Dataset:
        """The evaluation dataset (map-style; items ``(input, target, sample_id)``)."""

    @abc.abstractmethod
    def model(self, device: torch.device) -> torch.nn.Module | None:
        """The model in eval mode on ``device``, or None when the outputs come from saved predictions."""

    @abc.abstractmethod
    def metric(self) -> Metric:
        """A fresh metric (one per trial)."""

    def collate_fn(self) -> Callable | None:
        """The DataLoader's collate function (None: torch's default, stacking tensors)."""
        return None

    def step(self, model: torch.nn.Module | None, inputs: Any, device: torch.device) -> Any:
        """One batch's forward: ``inputs`` as the loader yields them -> what ``metric.update`` takes. Runs
        under ``torch.inference_mode`` and the precision policy's autocast. Default: ``model(inputs)`` on
        ``device``, as float32."""
        return model(inputs.to(device, non_blocking=True)).float()

    def after_loop(self, metric: Metric, comm: Any) -> None:
        """Called by the engine in every rank after its loop and before the synchronisation, with this rank's
        metric (local states) and the run's ``Communicator`` (``disteval.comm``): a task whose metric needs
        collectives between the ranks' shards before it can be summed (an exact top-k search over a sharded
        gallery, ``EmbeddingTask``) issues them here and leaves sum/gather-states for the synchronisation.
        Every collective runs under the communication timeout and is counted in results.json ``comm``; ranks
        must issue the same collectives in the same order (ranks without samples too). Default: nothing."""

    def prediction_schema(self) -> Any:
        """The pyarrow schema of this task's prediction store (``eval.save_predictions=true``; builders in
        ``disteval.data.prediction_columns``), called after ``dataset()`` and ``model()``; None (the default):
        the task keeps no Parquet store."""
        return None

    def prediction_columns(self, outputs: Any, targets: Any, ids: torch.Tensor) -> dict[str, Any]:
        """One batch's store columns (numpy arrays or lists of per-sample arrays, in ``prediction_schema``'s
        fields) from the step's outputs, the targets and the global sample ids int64 [B]. Called only when
        ``prediction_schema`` is not None."""
        raise NotImplementedError(f"{type(self).__name__} declares a prediction schema but no columns")

    def sample_columns(self) -> SampleColumns | None:
        """What each sample keeps for the bootstrap intervals (``eval.ci.resamples`` > 0) when they come from
        per-sample rows of logits (``disteval.metrics.bootstrap.per_sample``, gathered to rank 0 by the engine);
        None (default): the task has no such rows (``confidence_intervals`` may give intervals instead)."""
        return None

    def confidence_intervals(self, metric: Metric, resamples: int, level: float, seed: int) -> dict | None:
        """Bootstrap intervals (``eval.ci.resamples`` > 0) from the synchronised ``metric`` on rank 0, for a
        task without per-sample rows (``sample_columns`` None; the others get theirs from the engine's
        gathered rows): {metric: {low, high}, level, resamples, seed, method, samples}, identical at
        every world size. Default None: no intervals."""
        return None

    def main_metric(self, metrics: dict) -> str | None:
        """The key of ``metrics`` that states the run's result in one number (results.json
        ``task.main_metric``; the sweep summary, the trackers and the doctor's sanity check read it). Default:
        by the metric classes' declarations (``Metric.meaning``, ``disteval.metrics.meaning.main_metric``), else
        None."""
        return meaning.main_metric(metrics)

    def lower_is_better(self, metrics: dict) -> list[str]:
        """The keys of ``metrics`` where a smaller value is better (results.json ``task.lower_is_better``: the
        checkpoint table picks the best by it). Default: by the metric classes' declarations."""
        return meaning.lower_is_better(metrics)

    @property
    def streamed(self) -> bool:
        """Whether this job's data are streamed (tar shards planned per rank, no random access): the driver
        refuses a device mesh for them (``dist.parallel`` splits data by data-parallel rank). Default False."""
        return False

    def run_warnings(self) -> list[str]:
        """What this rank's task found during the run that the user should know although the run succeeded (e.g.
        some zero embeddings), read on rank 0 after the synchronisation into results.json ``warnings`` and the
        console. A task that decides it from every rank's data gathers it in ``after_loop``. Default: none."""
        return []

    def describe(self) -> dict:
        """Extra ``dataset`` fields for results.json (e.g. ``num_classes``)."""
        return {}

    def identity(self) -> dict:
        """results.json ``task``: ``name`` and ``class`` (``module:QualName``), so records of a plug-in task
        say what ran."""
        return {"name": self.name or type(self).__name__, "class": f"{type(self).__module__}:{type(self).__qualname__}",
                "rank_metric": self.rank_metric}

    @classmethod
    def report_figures(cls, metrics: dict) -> list[Any]:
        """The task's figures and tables for the HTML run report (RUN_DIR/report.html), from results.json
        ``metrics`` alone: ``disteval.common.figures.ReportFigure`` (a matplotlib figure) and ``ReportTable``
        items, leaving out what the metrics lack (``disteval.tasks.figures``). Default: none."""
        return []

    def console_section(self, metrics: dict) -> tuple[list[tuple[str, str]], list[Any], list[str]]:
        """How the console shows this task's metrics: (rows of (label, formatted value) for the main table,
        extra rich renderables such as per-category tables, notes printed after them)."""
        return [(k, fmt(v)) for k, v in metrics.items() if isinstance(v, (int, float)) or v is None], [], []


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make ``cls`` available as ``eval.task=<cls.name>`` and for its ``data_names``.
    Raises ValueError for a missing or taken name."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a class attribute name")
    old = _REGISTRY.get(cls.name)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"task name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def registered_tasks() -> dict[str, type[Task]]:
    """``{name: Task class}`` of every registered task."""
    return dict(_REGISTRY)


def resolve_task(cfg: Any) -> type[Task]:
    """The Task class of a job: ``eval.task`` = a registered name, ``package.module:ClassName`` (imported in
    every rank), or ``auto`` (the registered task whose ``data_names`` holds ``data.name``).
    Raises ConfigError naming ``eval.task`` or ``data.name``."""
    choice = str(cfg.eval.task or "auto")
    if ":" in choice:
        module, _, attr = choice.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError("eval.task", f"cannot import {choice!r}: {type(exc).__name__}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ConfigError("eval.task", f"{choice!r} is not a disteval.tasks.Task subclass")
        if inspect.isabstract(cls):
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            raise ConfigError("eval.task", f"{choice!r} is abstract: implement {missing}")
        return cls
    if choice != "auto":
        if choice not in _REGISTRY:
            raise ConfigError("eval.task", f"unknown task {choice!r}; registered: {sorted(_REGISTRY)} (or "
                              "package.module:ClassName)")
        return _REGISTRY[choice]
    for cls in _REGISTRY.values():
        if cfg.data.name in cls.data_names:
            return cls
    known = sorted(n for c in _REGISTRY.values() for n in c.data_names)
    raise ConfigError("data.name", f"no task evaluates data.name={cfg.data.name!r}; known: {known} (or set eval.task)")
