"""COCO detection mAP (bbox, segm) as a mergeable metric: each rank matches the images it evaluated
(``disteval.metrics.coco_eval.match_shard``), and only compact per-detection records (27 bytes each) and
the [K, 4] ground-truth counts travel; rank 0 accumulates them into the 12 COCOeval statistics and
per-category AP, identical to pycocotools.

States: ``records`` uint8 [n, 27] (RECORD_DTYPE bytes, gathered to rank 0), ``images`` int64 [m] (image
indices evaluated, gathered to rank 0: every image id must be evaluated exactly once), ``npig`` int64 [K, 4]
(non-ignored ground truths per category and area range, summed).
"""
from __future__ import annotations

import numpy as np
import torch

from disteval.common.closed_sets import IOU_TYPES
from disteval.common.coco_types import detections_from_arrays, xyxy_to_xywh
from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.meaning import Meaning
from disteval.metrics.coco_bootstrap import ImageResampler, coco_intervals, image_npig
from disteval.metrics.coco_eval import (AREA_RNG, RECORD_DTYPE, STAT_NAMES, DetectionShard, accumulate, match_shard,
                                        per_category_ap, pr_curves, summarize)


class CocoDetectionMetric(Metric):
    """COCO mAP over images of ``gt`` (a CocoGroundTruth).

    Args:
        gt: the ground truth, a ``disteval.data.coco.CocoGroundTruth`` (every rank reads the same annotation
            file); used through its arrays (``category_ids``, ``image_ids``, ``category_names``) and ``shard``.
        iou_type: ``bbox`` or ``segm``.
        keep_predictions: also keep the detections as COCO results entries (``predictions()``).

    ``update(outputs, targets, sample_ids)``: outputs = per image a dict with ``boxes`` float [n, 4] xyxy
    pixels (torchvision detection models) or ``bbox`` [n, 4] xywh, ``scores`` [n], ``labels`` [n] (category
    ids) and for segm ``segmentation`` (n RLEs), optionally ``area`` [n] (else w*h of the boxes, or the mask
    area for segm outputs without boxes, as pycocotools' loadRes); targets = int64 [B] image indices (sorted image-id order).
    Detections whose label is not a category of ``gt`` are dropped and counted (``dropped_unknown_category``).
    """

    meaning = Meaning(main=("AP",), precedence=10)

    def __init__(self, gt, iou_type: str = "bbox", keep_predictions: bool = False):
        super().__init__()
        if iou_type not in IOU_TYPES:
            raise ValueError(f"iou_type must be one of {IOU_TYPES}, got {iou_type!r}")
        self.gt, self.iou_type, self.keep_predictions = gt, iou_type, keep_predictions
        self.add_state("records", torch.zeros((0, RECORD_DTYPE.itemsize), dtype=torch.uint8), "gather", root=True)
        self.add_state("images", torch.zeros(0, dtype=torch.int64), "gather", root=True)
        self.add_state("npig", torch.zeros((gt.num_categories, len(AREA_RNG)), dtype=torch.int64))
        self._pending: list[tuple[np.ndarray, DetectionShard]] = []
        self._predictions: list[dict] = []
        self.dropped_unknown_category = 0

    def add_detections(self, images: np.ndarray, dets: DetectionShard) -> None:
        """Queue the detections ``dets`` of the image indices ``images`` (all of those images' detections;
        an image without detections is still listed in ``images``)."""
        self._pending.append((np.asarray(images, dtype=np.int64), dets))

    @torch.no_grad()
    def update(self, outputs, targets, sample_ids) -> None:
        """Queue one batch: ``outputs`` a list of B per-image dicts (see the class docstring), ``targets``
        int64 [B] image indices, ``sample_ids`` int64 [B]. Matching happens at the next flush."""
        images = torch.as_tensor(targets).long().cpu().numpy()
        parts = []
        for img, out in zip(images, outputs):
            scores = out["scores"].detach().cpu().numpy() if torch.is_tensor(out["scores"]) else np.asarray(out["scores"])
            labels = out["labels"].detach().cpu().numpy() if torch.is_tensor(out["labels"]) else np.asarray(out["labels"])
            if "bbox" in out:
                box = np.asarray(out["bbox"], dtype=np.float64).reshape(-1, 4)
            else:
                b = out["boxes"].detach().cpu().numpy() if torch.is_tensor(out["boxes"]) else out["boxes"]
                box = xyxy_to_xywh(b)
            k = np.searchsorted(self.gt.category_ids, labels)
            known = (k < self.gt.num_categories) & (self.gt.category_ids[np.minimum(k, self.gt.num_categories - 1)]
                                                    == labels)
            self.dropped_unknown_category += int((~known).sum())
            rle = [out["segmentation"][i] for i in np.nonzero(known)[0]] if self.iou_type == "segm" else None
            area = np.asarray(out["area"], dtype=np.float64)[known] if "area" in out else None
            parts.append((np.full(int(known.sum()), img), k[known], scores[known].astype(np.float64), box[known], rle,
                          area))
            if self.keep_predictions:
                self._keep(int(img), labels[known], scores[known], box[known])
        if not parts:
            return
        box = np.concatenate([p[3] for p in parts]).reshape(-1, 4)
        rle = [r for p in parts for r in p[4]] if self.iou_type == "segm" else None
        if all(p[5] is not None for p in parts):  # given (a results file: loadRes' rule, see data/coco.py)
            area = np.concatenate([p[5] for p in parts])
        elif self.iou_type == "segm" and not any("bbox" in o or "boxes" in o for o in outputs):
            from pycocotools import mask as mask_utils

            area = np.array([mask_utils.area(r) for r in rle], dtype=np.float64)
        else:  # boxes present: w * h, as pycocotools' loadRes
            area = box[:, 2] * box[:, 3]
        dets = detections_from_arrays(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                                      np.concatenate([p[2] for p in parts]), box, area, rle)
        self.add_detections(images, dets)

    def _keep(self, img: int, labels, scores, box) -> None:
        image_id = int(self.gt.image_ids[img])
        for c, s, b in zip(labels.tolist(), scores.tolist(), box.tolist()):
            self._predictions.append({"image_id": image_id, "category_id": int(c), "score": float(s), "bbox": b})

    def predictions(self) -> list[dict]:
        """The detections seen by ``update`` as COCO results entries (with ``keep_predictions``)."""
        return list(self._predictions)

    def _flush(self) -> None:
        """Match every queued image (one vectorised pass) into records."""
        if not self._pending:
            return
        images = np.concatenate([p[0] for p in self._pending])
        dets = _concat([p[1] for p in self._pending])
        self._pending = []
        rec, npig = match_shard(dets, self.gt.shard(images, self.iou_type), self.gt.num_categories, self.iou_type)
        s = self.state_tensors
        s["records"] = torch.cat([s["records"], torch.from_numpy(rec.view(np.uint8).reshape(len(rec), RECORD_DTYPE.itemsize).copy())])
        s["images"] = torch.cat([s["images"], torch.from_numpy(images)])
        s["npig"] = s["npig"] + torch.from_numpy(npig)

    def compute(self) -> dict:
        """``{"AP", "AP50", ..., "ARl"}`` (the 12 COCOeval statistics, -1 where undefined as pycocotools),
        ``per_category_ap`` {category name: AP or None}, ``pr_curve`` (``coco_eval.pr_curves``), ``num_images``, ``detections_evaluated``.
        Raises DataError naming image ids evaluated more than once."""
        self._flush()
        images = self.state_tensors["images"].numpy()
        uniq, counts = np.unique(images, return_counts=True)
        if (counts > 1).any():
            dup = self.gt.image_ids[uniq[counts > 1]][:10].tolist()
            raise DataError(f"image ids {dup} were evaluated more than once ({int((counts > 1).sum())} images): "
                            "each image must belong to exactly one shard")
        rec = self.state_tensors["records"].numpy().copy().view(RECORD_DTYPE).reshape(-1)
        precision, recall = accumulate(rec, self.state_tensors["npig"].numpy(), self.gt.num_categories)
        out: dict = dict(summarize(precision, recall))
        out["per_category_ap"] = dict(zip(self.gt.category_names, per_category_ap(precision)))
        out["pr_curve"] = pr_curves(precision)
        out["num_images"] = int(len(uniq))
        out["detections_evaluated"] = int(len(rec))  # the first 100 per image and category
        out["iou_type"] = self.iou_type
        return out

    def intervals(self, resamples: int, level: float, seed: int) -> dict:
        """Bootstrap intervals of the 12 statistics over the evaluated images (``coco_bootstrap``), from the
        synchronised records (rank 0, after ``compute``)."""
        self._flush()
        images = np.unique(self.state_tensors["images"].numpy())
        rec = self.state_tensors["records"].numpy().copy().view(RECORD_DTYPE).reshape(-1)
        npig = image_npig(self.gt.shard(images, "bbox"), images, self.gt.num_categories)
        return coco_intervals(ImageResampler(rec, images, npig, self.gt.num_categories), len(images), resamples,
                              level, seed)


def _concat(parts: list[DetectionShard]) -> DetectionShard:
    rle = None
    if parts and parts[0].rle is not None:
        rle = [r for p in parts for r in p.rle]
    return DetectionShard(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                            ("image", "category", "score", "box", "area", "order")), rle)


__all__ = ["CocoDetectionMetric", "STAT_NAMES", "xyxy_to_xywh"]
