"""COCO keypoints (OKS AP/AR, ``iouType="keypoints"``): a live path (torchvision's Keypoint R-CNN on the images
of a keypoint annotation file, random init, a local checkpoint or torchvision's weights) and a replay path (a
COCO keypoint results file). Matching is sharded by image like boxes; the metric is
``disteval.metrics.coco_keypoints`` (pycocotools' 10 statistics, bit for bit).

``+experiment=coco_keypoints_replay data.annotations=GT.json data.predictions=RESULTS.json`` or
``data=coco_keypoints model=keypointrcnn_resnet50_fpn data.root=IMAGES data.annotations=GT.json``.
"""
from __future__ import annotations

from typing import Any

import torch

from disteval.common.formatting import fmt
from disteval.data.coco_datasets import CocoImages
from disteval.data.coco_keypoints import KeypointReplay, collate_keypoints, load_keypoint_ground_truth
from disteval.errors import ConfigError
from disteval.metrics.coco_keypoints import STAT_NAMES, CocoKeypointMetric
from disteval.models.builders import prefetch_torchvision_weights
from disteval.models.checkpoint import load_checkpoint_into
from disteval.tasks.base import Task, register_task

_AREA = {"": "all", "m": "medium", "l": "large"}
LABELS = {k: f"{k[:2]} @[OKS={'0.50:0.95' if k[2:] in ('', 'm', 'l') else '0.' + k[2:]} | area="
             f"{_AREA.get(k[2:], 'all')} | maxDets=20]" for k in STAT_NAMES}


class _KeypointTask(Task):
    """The annotation file, the metric, the collate and the console, shared by the live and replay paths."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self._gt = None

    @property
    def gt(self):
        if self._gt is None:
            self._gt = load_keypoint_ground_truth(self.cfg.data.annotations)
        return self._gt

    def preflight(self, notes: list[str]) -> None:
        d = self.cfg.data
        if not d.annotations:
            raise ConfigError("data.annotations", f"data.name={d.name} needs data.annotations=PATH (COCO keypoints JSON)")
        if list(self.cfg.eval.metrics) != ["keypoints"]:
            raise ConfigError("eval.metrics", f"keypoint data takes eval.metrics=[keypoints], got {list(self.cfg.eval.metrics)}")
        self.metric()  # parses the file (a bad entry fails here) and checks the OKS sigmas against it

    def metric(self) -> CocoKeypointMetric:
        return CocoKeypointMetric(self.gt)

    def collate_fn(self):
        return collate_keypoints

    def describe(self) -> dict:
        return {"num_classes": self.gt.num_categories, "keypoints_per_instance": self.gt.num_parts}

    @classmethod
    def report_figures(cls, metrics: dict) -> list:
        """OKS AP by threshold and object size (``disteval.tasks.figures``)."""
        from disteval.tasks.figures import coco_figures

        return coco_figures(metrics)

    def console_section(self, metrics: dict):
        rows = [(label, fmt(metrics[k])) for k, label in LABELS.items() if k in metrics]
        rows.append(("images", fmt(metrics.get("num_images"))))
        return rows, [], []


@register_task
class KeypointReplayTask(_KeypointTask):
    """The keypoint detections of ``data.predictions`` (a COCO keypoint results file) against
    ``data.annotations``; no model."""

    name = "keypoints_replay"
    data_names = ("coco_keypoints_replay",)

    def preflight(self, notes: list[str]) -> None:
        super().preflight(notes)
        if not self.cfg.data.predictions:
            raise ConfigError("data.predictions", "data.name=coco_keypoints_replay needs data.predictions=PATH "
                              "(a COCO keypoint results JSON)")
        KeypointReplay(self.gt, self.cfg.data.predictions)  # a malformed file fails before any rank starts

    def dataset(self):
        return KeypointReplay(self.gt, self.cfg.data.predictions, self.cfg.data.limit)

    def model(self, device: torch.device) -> None:
        return None

    def step(self, model, inputs, device):
        """The 'outputs' are the detections read from the results file."""
        return list(inputs)


@register_task
class KeypointTask(_KeypointTask):
    """Keypoint R-CNN (``model.name=keypointrcnn_resnet50_fpn``) on the images of ``data.root`` listed by
    ``data.annotations``: ``model.weights`` (torchvision's, fetched once by the driver), ``model.checkpoint``
    (a local state dict) or neither (random initialisation, seeded)."""

    name = "keypoints"
    data_names = ("coco_keypoints",)

    def preflight(self, notes: list[str]) -> None:
        super().preflight(notes)
        if not self.cfg.data.root:
            raise ConfigError("data.root", "data.name=coco_keypoints needs data.root=IMAGES (the image folder)")
        if self.cfg.model.name != "keypointrcnn_resnet50_fpn":
            raise ConfigError("model.name", f"keypoints are evaluated with keypointrcnn_resnet50_fpn, not {self.cfg.model.name}")
        if not self.cfg.model.checkpoint:
            prefetch_torchvision_weights(self.cfg.model)

    def dataset(self):
        return CocoImages(self.cfg.data.root, self.cfg.data.annotations, self.gt, self.cfg.data.limit)

    def model(self, device: torch.device) -> torch.nn.Module:
        from torchvision.models import detection

        m = self.cfg.model
        torch.manual_seed(int(self.cfg.seed))
        weights = None if m.checkpoint or m.weights in (None, "", "none") else m.weights
        extra = dict(m.kwargs or {}, **({} if weights else {"num_classes": self.gt.num_categories + 1}))
        net = detection.keypointrcnn_resnet50_fpn(weights=weights, weights_backbone=None,
                                                  num_keypoints=self.gt.num_parts, **extra)
        if m.checkpoint:
            load_checkpoint_into(net, m.checkpoint)
        return net.eval().to(device)

    def step(self, model, inputs, device):
        """Images [3, H, W] -> per image {keypoints [n, P, 3], scores [n], labels [n] as category ids} (the
        model's label l is the annotation file's l-th category; the detector pads the batch to its largest
        image, so batch-aligned shards keep each batch the same at every world size)."""
        outs = model([im.to(device, non_blocking=True) for im in inputs])
        ids = torch.as_tensor(self.gt.category_ids)
        return [{"keypoints": o["keypoints"].float().cpu(), "scores": o["scores"].float().cpu(),
                 "labels": ids[(o["labels"].cpu() - 1).clamp(0, len(ids) - 1)]} for o in outs]
