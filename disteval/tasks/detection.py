"""COCO detection: a torchvision detector on COCO images (``data.name=coco``), or a COCO results file
replayed against its annotation file (``data.name=coco_replay``); COCO mAP identical to pycocotools
(``disteval.metrics.detection``). Batches are lists of images of different sizes."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from disteval.data.coco import load_detections, load_ground_truth
from disteval.data.coco_wire import load_detections_shared
from disteval.data.coco_datasets import CocoImages, ReplayImages, collate_images
from disteval.data.prediction_columns import detection_columns, detection_schema
from disteval.data.prediction_store import StoredDetections, check_detection_store
from disteval.errors import ConfigError
from disteval.metrics.detection import CocoDetectionMetric
from disteval.models.builders import prefetch_torchvision_weights
from disteval.models.detection import build_detector, detection_models
from disteval.common.formatting import fmt
from disteval.tasks.base import Task, register_task

log = logging.getLogger("disteval.rank")

# COCOeval.summarize's 12 statistics, in its order and wording
COCO_LABELS = {"AP": "AP @[IoU=0.50:0.95 | area=all | maxDets=100]", "AP50": "AP @[IoU=0.50 | area=all | maxDets=100]",
               "AP75": "AP @[IoU=0.75 | area=all | maxDets=100]", "APs": "AP @[IoU=0.50:0.95 | area=small | maxDets=100]",
               "APm": "AP @[IoU=0.50:0.95 | area=medium | maxDets=100]",
               "APl": "AP @[IoU=0.50:0.95 | area=large | maxDets=100]", "AR1": "AR @[IoU=0.50:0.95 | area=all | maxDets=1]",
               "AR10": "AR @[IoU=0.50:0.95 | area=all | maxDets=10]",
               "AR100": "AR @[IoU=0.50:0.95 | area=all | maxDets=100]",
               "ARs": "AR @[IoU=0.50:0.95 | area=small | maxDets=100]",
               "ARm": "AR @[IoU=0.50:0.95 | area=medium | maxDets=100]",
               "ARl": "AR @[IoU=0.50:0.95 | area=large | maxDets=100]"}


class _CocoTask(Task):
    """What both COCO tasks share: the annotation file, the metric, the collate and the console."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self._gt = None

    @property
    def gt(self):
        if self._gt is None:
            self._gt = load_ground_truth(self.cfg.data.annotations)
        return self._gt

    def preflight(self, notes: list[str]) -> None:
        cfg, d = self.cfg, self.cfg.data
        if not d.annotations:
            raise ConfigError("data.annotations", f"data.name={d.name} needs data.annotations=PATH (COCO JSON)")
        if list(cfg.eval.metrics) != ["coco"]:
            raise ConfigError("eval.metrics", f"detection data takes eval.metrics=[coco], got {list(cfg.eval.metrics)}")
        _ = self.gt  # parsed here so that a bad entry fails before any rank starts

    def prediction_schema(self):
        """Each image's boxes (xyxy), scores and category ids (``prediction_columns.detection_schema``)."""
        return detection_schema()

    def prediction_columns(self, outputs, targets, ids):
        """``targets`` are image indices into the annotation file's sorted image ids."""
        return detection_columns(outputs, self.gt.image_ids[torch.as_tensor(targets).long().cpu().numpy()], ids)

    def confidence_intervals(self, metric, resamples, level, seed):
        """The 12 COCO statistics' intervals over images (``disteval.metrics.coco_bootstrap``)."""
        return metric.intervals(resamples, level, seed)

    def metric(self) -> CocoDetectionMetric:
        return CocoDetectionMetric(self.gt, self.cfg.eval.detection.iou_type,
                                   keep_predictions=bool(self.cfg.eval.save_predictions))

    def collate_fn(self):
        return collate_images

    def describe(self) -> dict:
        return {"num_classes": self.gt.num_categories}

    @classmethod
    def report_figures(cls, metrics: dict) -> list:
        """AP by IoU and size, precision-recall curves, per-category AP (``disteval.tasks.figures``)."""
        from disteval.tasks.figures import coco_figures

        return coco_figures(metrics)

    def console_section(self, metrics: dict):
        from rich.table import Table

        rows = [(label, fmt(metrics[k])) for k, label in COCO_LABELS.items() if k in metrics]
        extra = []
        per_cat = metrics.get("per_category_ap")
        if isinstance(per_cat, dict):
            table, columns = Table(title="per-category AP @[IoU=0.50:0.95 | area=all | maxDets=100]"), 4
            for _ in range(columns):
                table.add_column("category")
                table.add_column("AP", justify="right")
            items = list(per_cat.items())
            nrows = (len(items) + columns - 1) // columns
            for r in range(nrows):
                cells = []
                for c in range(columns):
                    i = c * nrows + r
                    cells += [items[i][0], fmt(items[i][1])] if i < len(items) else ["", ""]
                table.add_row(*cells)
            extra.append(table)
        return rows, extra, []


@register_task
class CocoDetectionTask(_CocoTask):
    """A torchvision detection model (``model.name``) on the images of ``data.root`` listed in
    ``data.annotations``; bbox mAP."""

    name = "detection"
    data_names = ("coco",)

    def preflight(self, notes: list[str]) -> None:
        super().preflight(notes)
        cfg, d = self.cfg, self.cfg.data
        if not d.root or not Path(d.root).is_dir():
            raise ConfigError("data.root", f"data.name=coco needs data.root=DIR holding the images, got {d.root!r}")
        if cfg.eval.detection.iou_type != "bbox":
            raise ConfigError("eval.detection.iou_type", "live models are evaluated with iou_type bbox in this version")
        if cfg.model.name not in detection_models():
            raise ConfigError("model.name", f"{cfg.model.name!r} is not a torchvision detection model; "
                              f"available: {detection_models()}")
        prefetch_torchvision_weights(cfg.model)

    def dataset(self):
        return CocoImages(self.cfg.data.root, self.cfg.data.annotations, self.gt, self.cfg.data.limit)

    def model(self, device: torch.device) -> torch.nn.Module:
        return build_detector(self.cfg.model, self.gt.category_ids, seed=self.cfg.seed).to(device)

    def step(self, model, inputs, device):
        """A list of images [3, H, W] -> torchvision's list of {boxes, scores, labels} (the detector pads
        the batch to its largest image, so outputs depend on batch composition: batch-aligned shards keep
        it the same at every world size)."""
        return model([im.to(device, non_blocking=True) for im in inputs])


@register_task
class CocoReplayTask(_CocoTask):
    """The detections of ``data.predictions`` (a COCO results file) against ``data.annotations``; no model."""

    name = "replay"
    data_names = ("coco_replay",)

    def preflight(self, notes: list[str]) -> None:
        super().preflight(notes)
        if not self.cfg.data.predictions:
            raise ConfigError("data.predictions", "data.name=coco_replay needs data.predictions=PATH "
                              "(a COCO results JSON)")
        iou_type = self.cfg.eval.detection.iou_type
        if Path(self.cfg.data.predictions).is_dir():  # a prediction store (python -m disteval.rescore)
            check_detection_store(self.cfg.data.predictions, self.cfg.data.annotations, iou_type)
            return
        if not len(load_detections(self.cfg.data.predictions, self.gt, iou_type).score):
            notes.append(f"data.predictions={self.cfg.data.predictions} holds no detections: every AP and AR is 0 "
                         "(-1 where no ground truth exists); was the right results file passed?")

    def dataset(self):
        """The results file is parsed once, on rank 0, and its detections shared with the other ranks
        (``disteval.data.coco_wire``); a malformed file raises the same DataError on every rank."""
        if Path(self.cfg.data.predictions).is_dir():
            return StoredDetections(self.cfg.data.predictions)
        dets = load_detections_shared(self.cfg.data.predictions, self.gt, self.cfg.eval.detection.iou_type, self.rank,
                                      self.share)
        how = "parsed here" if self.rank == 0 or self.share is None else "received from rank 0"
        log.info("data.predictions: %d detections (%s)", len(dets.score), how)
        return ReplayImages(self.gt, dets, self.cfg.data.limit)

    def model(self, device: torch.device) -> None:
        return None

    def step(self, model, inputs, device):
        """The 'outputs' are the detections read from the results file."""
        return list(inputs)
