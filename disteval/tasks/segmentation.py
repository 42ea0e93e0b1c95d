"""Semantic segmentation: a torchvision segmentation model (fcn, deeplabv3, lraspp; its ``out`` head) on a
VOC-format folder (``data.name=voc``), or saved predicted maps replayed against label maps
(``data.name=semseg_replay``: labels from a VOC-format folder or rasterised from a COCO instances file;
predictions a folder of PNG label maps or a COCO-style results JSON). Metrics from an exact int64 confusion
matrix counted on the model's device (``disteval.metrics.segmentation``), at the label's own resolution."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from disteval.data.prediction_columns import segmentation_columns, segmentation_schema
from disteval.common.formatting import fmt
from disteval.data.coco import load_detections, load_ground_truth
from disteval.data.semseg import (CocoSemanticLabels, PaintedPredictions, PngMaps, ReplayMaps, VocFolder,
                                  check_voc_root, collate_maps)
from disteval.errors import ConfigError
from disteval.metrics.segmentation import ABSENT_RULE, SegmentationMetrics
from disteval.models.builders import prefetch_torchvision_weights
from disteval.models.segmentation import build_segmenter, has_weights, segmentation_models
from disteval.tasks.base import Task, register_task

log = logging.getLogger("disteval.rank")
VOC_CLASSES = 21
_LABELS = {"mIoU": "mIoU (dataset confusion matrix)", "mIoU_per_image": "mIoU_per_image (torchmetrics MeanIoU)",
           "mean_accuracy": "mean class accuracy", "pixel_accuracy": "pixel accuracy", "fwIoU": "frequency-weighted IoU",
           "mean_dice": "mean Dice (F1)", "classes_present": "classes present", "num_pixels": "labelled pixels"}


class _SegmentationTask(Task):
    """What both segmentation tasks share: the metric, the collate and the console."""

    class_names: list[str] | None = None

    @property
    def num_classes(self) -> int:
        return int(self.cfg.model.num_classes or self.cfg.data.num_classes or VOC_CLASSES)

    def _check_common(self) -> None:
        if list(self.cfg.eval.metrics) != ["segmentation"]:
            raise ConfigError("eval.metrics", f"segmentation data takes eval.metrics=[segmentation], got "
                              f"{list(self.cfg.eval.metrics)}")

    def prediction_schema(self):
        """Each image's confusion counts [C*C], its predicted map with ``eval.predictions.label_maps``
        (``prediction_columns.segmentation_schema``)."""
        return segmentation_schema(self.num_classes, bool(self.cfg.eval.predictions.label_maps))

    def prediction_columns(self, outputs, targets, ids):
        return segmentation_columns(outputs, targets, ids, self.num_classes, self.cfg.eval.segmentation.ignore_index,
                                    bool(self.cfg.eval.predictions.label_maps))

    def confidence_intervals(self, metric, resamples, level, seed):
        """mIoU, mean Dice and mIoU_per_image over images (``SegmentationMetrics.intervals``)."""
        return metric.intervals(resamples, level, seed)

    def metric(self) -> SegmentationMetrics:
        return SegmentationMetrics(self.num_classes, self.cfg.eval.segmentation.ignore_index,
                                   keep_predictions=self.cfg.eval.save_predictions)

    def collate_fn(self):
        return collate_maps

    def describe(self) -> dict:
        return {"num_classes": self.num_classes, "ignore_index": self.cfg.eval.segmentation.ignore_index}

    @classmethod
    def report_figures(cls, metrics: dict) -> list:
        """IoU per class (the mIoU's terms) and its table (``disteval.tasks.figures``)."""
        from disteval.tasks.figures import segmentation_figures

        return segmentation_figures(metrics)

    def console_section(self, metrics: dict):
        from rich.table import Table

        rows = [(label, fmt(metrics[k])) for k, label in _LABELS.items() if k in metrics]
        per_class = metrics.get("per_class_IoU")
        extra = []
        if isinstance(per_class, list):
            names = self.class_names or [str(c) for c in range(len(per_class))]
            table = Table(title="per-class IoU / Dice (null: class absent from labels and predictions)")
            for col in ("class", "IoU", "Dice", "label pixels"):
                table.add_column(col, justify="left" if col == "class" else "right")
            for c, iou in enumerate(per_class):
                table.add_row(names[c] if c < len(names) else str(c), fmt(iou), fmt(metrics["per_class_dice"][c]),
                              str(metrics["per_class_support"][c]))
            extra.append(table)
        notes = [f"mIoU: {ABSENT_RULE}; mIoU is the IoU of the dataset-level confusion matrix (mmseg, detectron2, "
                 "torchvision), mIoU_per_image the mean of per-image IoUs over (image, class) pairs present "
                 f"(torchmetrics' MeanIoU); pixels labelled {metrics.get('ignore_index')} are ignored"]
        return rows, extra, notes


@register_task
class SegmentationTask(_SegmentationTask):
    """A torchvision segmentation model (``model.name``) on a VOC-format folder (``data.root``)."""

    name = "segmentation"
    data_names = ("voc",)

    def preflight(self, notes: list[str]) -> None:
        cfg = self.cfg
        self._check_common()
        check_voc_root(cfg.data.root, cfg.data.split)
        if cfg.model.name not in segmentation_models():
            raise ConfigError("model.name", f"{cfg.model.name!r} is not a torchvision segmentation model; available: "
                              f"{segmentation_models()}")
        weights = prefetch_torchvision_weights(cfg.model)
        if weights is not None:
            if len(weights.meta["categories"]) != self.num_classes:
                raise ConfigError("model.num_classes", f"{cfg.model.weights} predicts {len(weights.meta['categories'])} "
                                  f"classes but model.num_classes/data.num_classes say {self.num_classes}")
        if cfg.model.checkpoint:
            build_segmenter(cfg.model, self.num_classes, seed=cfg.seed)  # a checkpoint that does not fit fails here

    def dataset(self):
        d = self.cfg.data
        return VocFolder(d.root, d.split, int(d.resize_size), d.mean, d.std, d.limit)

    def model(self, device: torch.device) -> torch.nn.Module:
        model = build_segmenter(self.cfg.model, self.num_classes, seed=self.cfg.seed).to(device)
        if has_weights(self.cfg.model):
            import torchvision

            self.class_names = list(torchvision.models.get_model_weights(self.cfg.model.name)[
                self.cfg.model.weights].meta["categories"])
        return model

    def step(self, model, inputs, device):
        """A list of B images [3, h, w] -> B logits float32 [C, h, w] (the ``out`` head). Images of one size are
        stacked and forwarded together, in order of first appearance; nothing is padded (batch-aligned shards keep
        each batch's composition the same at every world size)."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        sizes: dict[tuple, list[int]] = {}
        for i, im in enumerate(inputs):
            sizes.setdefault(tuple(im.shape), []).append(i)
        for idx in sizes.values():
            x = torch.stack([inputs[i] for i in idx]).to(device, non_blocking=True)
            logits = model(x)["out"].float()
            for j, i in enumerate(idx):
                out[i] = logits[j]
        return out


@register_task
class SegmentationReplayTask(_SegmentationTask):
    """Saved predicted maps (``data.predictions``: a folder of PNG label maps, or a results JSON) against label
    maps from ``data.annotations`` (a COCO instances file) or ``data.root`` (a VOC-format folder); no model."""

    name = "semseg_replay"
    data_names = ("semseg_replay",)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self._gt = None

    @property
    def gt(self):
        if self._gt is None and self.cfg.data.annotations:
            self._gt = load_ground_truth(self.cfg.data.annotations)
            self.class_names = ["background", *self._gt.category_names]
        return self._gt

    @property
    def num_classes(self) -> int:
        return self.gt.num_categories + 1 if self.gt is not None else super().num_classes

    def preflight(self, notes: list[str]) -> None:
        d = self.cfg.data
        self._check_common()
        if bool(d.annotations) == bool(d.root):
            raise ConfigError("data.annotations", "data.name=semseg_replay needs exactly one source of label maps: "
                              "data.annotations=COCO_INSTANCES.json or data.root=VOC_FOLDER")
        if not d.predictions or not Path(d.predictions).exists():
            raise ConfigError("data.predictions", f"needs a folder of PNG label maps or a results JSON, got "
                              f"{d.predictions!r}")
        if self.gt is not None and Path(d.predictions).is_dir():
            raise ConfigError("data.predictions", "with data.annotations (COCO labels) the predictions are a COCO "
                              "segm results JSON, not a folder")
        self.dataset()  # every file named and parsed here, before any rank starts

    def dataset(self):
        d, ignore = self.cfg.data, self.cfg.eval.segmentation.ignore_index
        if self.gt is not None:
            if ignore is None:
                raise ConfigError("eval.segmentation.ignore_index",
                                  "COCO label maps paint crowd regions as ignore_index: set one")
            labels = CocoSemanticLabels(self.gt, ignore)
            preds = PaintedPredictions.from_coco(load_detections(d.predictions, self.gt, "segm"), self.gt)
            n = self.gt.num_images
        else:
            voc = VocFolder(d.root, d.split)
            labels, n = voc.label, len(voc.names)
            if Path(d.predictions).is_dir():
                preds = PngMaps(d.predictions, voc.names[:n if d.limit is None else min(n, d.limit)])
            else:
                preds = PaintedPredictions.from_json(d.predictions, n, self.num_classes,
                                                     voc.label_shape)
        return ReplayMaps(preds, labels, n if d.limit is None else min(n, d.limit))

    def model(self, device: torch.device) -> None:
        return None

    def step(self, model, inputs, device):
        """The 'outputs' are the predicted maps read from ``data.predictions``, moved to ``device``."""
        return [p.to(device, non_blocking=True) for p in inputs]
