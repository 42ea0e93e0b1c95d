"""The arrays that COCO loading (data layer) produces and COCO matching (metrics layer) consumes: ground
truths and detections of some images, as numpy columns."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GroundTruthShard:
    """Ground truths of some images, in annotation-file order: ``image`` int64 [n] (global image index in
    sorted image-id order), ``category`` int64 [n] (index into sorted category ids), ``box`` float64 [n, 4]
    xywh, ``area`` float64 [n] (the annotation's area field), ``crowd`` bool [n], ``ann_id`` int64 [n],
    ``rle``: list of n pycocotools RLEs (segm only, else None)."""

    image: np.ndarray
    category: np.ndarray
    box: np.ndarray
    area: np.ndarray
    crowd: np.ndarray
    ann_id: np.ndarray
    rle: list | None = None


@dataclass
class DetectionShard:
    """Detections of some images: ``image`` int64 [n], ``category`` int64 [n], ``score`` float64 [n],
    ``box`` float64 [n, 4] xywh, ``area`` float64 [n] (w*h for bbox, mask area for segm), ``order`` int64
    [n] (position in the image's input order, the tie-break of equal scores), ``rle`` (segm only)."""

    image: np.ndarray
    category: np.ndarray
    score: np.ndarray
    box: np.ndarray
    area: np.ndarray
    order: np.ndarray
    rle: list | None = None


def detections_from_arrays(image, category, score, box, area, rle=None) -> DetectionShard:
    """A DetectionShard whose tie-break order is the given order inside each image."""
    order = np.zeros(len(image), dtype=np.int64)
    if len(image):
        srt = np.argsort(image, kind="stable")
        starts = np.concatenate(([0], np.nonzero(np.diff(image[srt]))[0] + 1))
        counts = np.diff(np.concatenate((starts, [len(srt)])))
        order[srt] = np.arange(len(srt)) - np.repeat(starts, counts)
    return DetectionShard(image.astype(np.int64), category.astype(np.int64), score.astype(np.float64),
                          box.astype(np.float64).reshape(-1, 4), area.astype(np.float64), order, rle)


def xyxy_to_xywh(boxes: np.ndarray) -> np.ndarray:
    """float [n, 4] (x1, y1, x2, y2) pixels -> float64 [n, 4] (x, y, w, h), computed in float64."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.stack([b[:, 0], b[:, 1], b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], axis=1)
