"""Image classification: a dataset of (image, label, sample id), a classifier's logits, and the metric
families of ``eval.metrics`` (classification: top-k, confusion-derived, NLL, ECE; ranking: AUROC/AP)."""
from __future__ import annotations

from typing import Any

import torch

from disteval.data.datasets import (build_dataset, check_data_root, dataset_num_classes, input_shape, is_streamed,
                                    prepare_data)
from disteval.data.prediction_columns import classification_schema
from disteval.data.prediction_store import classification_columns, load_store, read_manifest
from disteval.data.device_decode import DeviceDecoder, EncodedImages, collate_encoded
from disteval.data.pixel_source import preflight_cache
from disteval.data.pixels import PixelNormalizer
from disteval.errors import ConfigError
from disteval.metrics import ClassificationMetrics, MetricCollection, RankingMetrics
from disteval.metrics.bootstrap import CI_PROBS_MAX_CLASSES, SampleColumns
from disteval.models import build_model, preflight_model, resolve_num_classes
from disteval.common.formatting import fmt
from disteval.common.problems import Problems
from disteval.tasks.base import Task, register_task

FAMILIES = ("classification", "ranking")
_LABELS = {"auroc_macro": "AUROC (macro, one-vs-rest)", "ap_macro": "AP (macro, one-vs-rest)",
           "macro_precision": "macro precision", "macro_recall": "macro recall", "macro_f1": "macro F1",
           "nll": "NLL (mean cross-entropy)"}


@register_task
class ClassificationTask(Task):
    """``data.name`` digits | fashion_mnist | imagefolder | webdataset with a classifier of ``model.*``."""

    name = "classification"
    data_names = ("digits", "fashion_mnist", "imagefolder", "webdataset")
    logits_per_sample = True
    rank_metric = "accuracy"  # each rank's local top-1 (ClassificationMetrics.local_summary)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self._num_classes: int | None = None
        data = cfg.data
        self._decoder = (DeviceDecoder(data.resize_size, data.crop_size, data.mean, data.std)
                         if data.decode_on_device else None)
        # imagefolder batches arrive as uint8 pixels (from the files or the pixel cache): normalised on the device
        self._normalize = PixelNormalizer(data.mean, data.std) if data.name == "imagefolder" else None

    @property
    def num_classes(self) -> int:
        """The model's classes (``model.num_classes`` or the dataset's class count)."""
        if self._num_classes is None:
            self._num_classes = resolve_num_classes(self.cfg.model, dataset_num_classes(self.cfg.data))
        return self._num_classes

    @property
    def streamed(self) -> bool:
        return is_streamed(self.cfg.data)

    def preflight(self, notes: list[str]) -> None:
        cfg = self.cfg
        unknown = [m for m in cfg.eval.metrics if m not in FAMILIES]
        if unknown:
            raise ConfigError("eval.metrics", f"{unknown} are not metric families of classification data; "
                              f"available: {list(FAMILIES)}")
        if cfg.eval.exclude_outlier_ranks and "classification" not in cfg.eval.metrics:
            raise ConfigError("eval.exclude_outlier_ranks", "outlier ranks are found from each rank's top-1 accuracy "
                              "(Task.rank_metric): it needs classification in eval.metrics")
        problems = Problems()
        with problems.check():
            check_data_root(cfg.data)
            prepare_data(cfg.data, notes)
            cache_line = preflight_cache(cfg.data)
            if cache_line:
                notes.append(cache_line)
        if problems:  # no data to check the model against: its weights or checkpoint are still checked
            with problems.check():
                try:
                    classes = resolve_num_classes(cfg.model, None)
                except ConfigError:  # its classes come from the data
                    classes = None
                if classes is not None:
                    preflight_model(cfg.model, classes)
            problems.raise_any()
        data_classes = dataset_num_classes(cfg.data)
        if data_classes is not None and self.num_classes != data_classes:
            raise ConfigError("data.root" if cfg.data.name == "imagefolder" else "model.num_classes",
                              f"the dataset {cfg.data.name} ({cfg.data.root or 'bundled'}) has {data_classes} classes "
                              f"but the model {cfg.model.name} has {self.num_classes} outputs: labels would not line "
                              "up with the model's classes (an ImageFolder root must hold every class folder, e.g. "
                              "all 1000 ImageNet wnids)")
        too_big = [k for k in cfg.eval.classification.topk if k > self.num_classes]
        if too_big:
            raise ConfigError("eval.classification.topk", f"k={too_big} exceed the {self.num_classes} classes; e.g. "
                              "eval.classification.topk=[1]")
        preflight_model(cfg.model, self.num_classes, input_shape(cfg.data),
                        "data.image_mode" if cfg.data.name == "webdataset" else None)

    def dataset(self):
        dataset, data_classes = build_dataset(self.cfg.data)
        self._num_classes = resolve_num_classes(self.cfg.model, data_classes)
        return dataset

    def model(self, device: torch.device) -> torch.nn.Module:
        return build_model(self.cfg.model, self.num_classes, seed=self.cfg.seed).to(device)

    def collate_fn(self):
        """Encoded-image batches with ``data.decode_on_device``; torch's default otherwise."""
        return collate_encoded if self._decoder is not None else None

    def step(self, model: torch.nn.Module, inputs: Any, device: torch.device) -> torch.Tensor:
        """``model(inputs)`` on ``device`` as float32; an ``EncodedImages`` batch (``data.decode_on_device``)
        is decoded and transformed on ``device`` first (``DeviceDecoder``), uint8 pixels [B, 3, H, W] (imagefolder)
        are normalised there (``PixelNormalizer``: the floats of the host transform, bit for bit)."""
        if isinstance(inputs, EncodedImages):
            inputs = self._decoder(inputs, device)
        inputs = inputs.to(device, non_blocking=True)
        if self._normalize is not None:
            inputs = self._normalize(inputs)
        return model(inputs).float()

    def metric(self) -> MetricCollection:
        opt = self.cfg.eval.classification
        families = {"classification": lambda: ClassificationMetrics(self.num_classes, topk=list(opt.topk),
                                                                    ece_bins=opt.ece_bins),
                    "ranking": lambda: RankingMetrics(self.num_classes)}
        return MetricCollection({name: families[name]() for name in self.cfg.eval.metrics})

    def describe(self) -> dict:
        return {"num_classes": self.num_classes}

    @classmethod
    def report_figures(cls, metrics: dict) -> list:
        """Confusion matrix, per-class accuracy, reliability diagram (``disteval.tasks.figures``)."""
        from disteval.tasks.figures import classification_figures

        return classification_figures(metrics)

    def console_section(self, metrics: dict):
        rows = [(f"top-{k[3:]} accuracy", fmt(v)) for k, v in metrics.items() if k.startswith("top") and k[3:].isdigit()]
        rows += [(label, fmt(metrics[k])) for k, label in _LABELS.items() if k in metrics]
        if "ece" in metrics:
            rows.append((f"ECE ({metrics.get('ece_bins')} bins)", fmt(metrics["ece"])))
        notes = []
        present = metrics.get("classes_with_samples")
        if present is not None and present < self.num_classes:
            notes.append(f"only {present} of {self.num_classes} classes have samples; macro precision/recall/F1 "
                         "average over all classes (classes without samples count as 0, scikit-learn's "
                         "labels=range(C), zero_division=0)")
        return rows, [], notes


    def sample_columns(self) -> SampleColumns | None:
        """Top-k (``eval.classification.topk``), NLL, macro F1, ECE (``ece_bins``), and the probabilities for the
        AUROC when ``ranking`` is among the metrics and C <= ``CI_PROBS_MAX_CLASSES``; None for a store being
        re-scored."""
        if not self.logits_per_sample:
            return None
        opt, c = self.cfg.eval.classification, int(self.num_classes)
        return SampleColumns(tuple(int(k) for k in opt.topk), c, int(opt.ece_bins),
                             probs="ranking" in self.cfg.eval.metrics and c <= CI_PROBS_MAX_CLASSES)

    def prediction_schema(self):
        """Top-k ids and probabilities (``eval.predictions.topk``), the logits with ``eval.predictions.logits``
        (``disteval.data.prediction_columns.classification_schema``); None for a store being re-scored."""
        if not self.logits_per_sample:
            return None
        p = self.cfg.eval.predictions
        return classification_schema(int(p.topk), bool(p.logits), self.num_classes)

    def prediction_columns(self, outputs, targets, ids):
        p = self.cfg.eval.predictions
        return classification_columns(outputs, targets, ids, int(p.topk), bool(p.logits))


@register_task
class PredictionReplayTask(ClassificationTask):
    """Re-scoring a prediction store without the model (``data.name=predictions``, ``data.root`` the store's
    folder, ``python -m disteval.rescore``): the stored float32 logits pass through an identity model into the
    classification task's metrics, batched as the run that wrote them (``data.batch_size``), so bitwise mode
    gives its bits at any world size. Raises DataError naming a missing, corrupt or incomplete rank file."""

    name = "prediction_replay"
    data_names = ("predictions",)
    logits_per_sample = False  # a store re-scored is not stored again, nor resampled

    @property
    def num_classes(self) -> int:
        if self._num_classes is None:
            self._num_classes = int(read_manifest(self.cfg.data.root)["settings"]["num_classes"])
        return self._num_classes

    def preflight(self, notes: list[str]) -> None:
        unknown = [m for m in self.cfg.eval.metrics if m not in FAMILIES]
        if unknown:
            raise ConfigError("eval.metrics", f"{unknown} are not metric families of classification predictions; "
                              f"available: {list(FAMILIES)}")
        if not self.cfg.data.root:
            raise ConfigError("data.root", "data.name=predictions needs data.root=STORE (a run's predictions/ folder)")
        too_big = [k for k in self.cfg.eval.classification.topk if k > self.num_classes]
        if too_big:
            raise ConfigError("eval.classification.topk", f"k={too_big} exceed the store's {self.num_classes} classes")

    def dataset(self):
        dataset, manifest = load_store(self.cfg.data.root)
        self._num_classes = int(manifest["settings"]["num_classes"])
        return dataset

    def model(self, device: torch.device) -> torch.nn.Module:
        return torch.nn.Identity()
