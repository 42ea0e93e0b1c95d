"""COCO keypoint annotation and results files as arrays (``iouType="keypoints"``), and the replay of a results
file image by image. Images are in sorted image-id order and the sample id of an image is its index in that
order, as for boxes (``disteval.data.coco_datasets``).

Ground truth (pycocotools' ``_prepare`` for keypoints): an annotation is *ignored* when it is a crowd or has no
labelled keypoint (``num_keypoints == 0``). Results (pycocotools' ``loadRes`` for keypoints): a detection's
``area`` is the area of its keypoints' extent, (max x - min x) * (max y - min y) over all its keypoints.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from disteval.errors import DataError


@dataclass
class KeypointGroundTruth:
    """A COCO keypoint annotation file: ``image_ids`` int64 [I] and ``category_ids`` int64 [K] sorted,
    ``category_names``; per annotation (file order) ``image`` / ``category`` (indices), ``ann_id``,
    ``keypoints`` float64 [G, P, 3] (x, y, visibility), ``area`` float64 [G], ``bbox`` float64 [G, 4] xywh,
    ``crowd`` bool [G] (iscrowd), ``ignore`` bool [G] (crowd or no labelled keypoint); ``file_names`` per
    image (sorted id order)."""

    path: str
    image_ids: np.ndarray
    category_ids: np.ndarray
    category_names: list[str]
    image: np.ndarray
    category: np.ndarray
    ann_id: np.ndarray
    keypoints: np.ndarray
    area: np.ndarray
    bbox: np.ndarray
    crowd: np.ndarray
    ignore: np.ndarray
    file_names: list[str]

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_categories(self) -> int:
        return len(self.category_ids)

    @property
    def num_parts(self) -> int:
        return self.keypoints.shape[1]


def _index(sorted_ids: np.ndarray, ids: np.ndarray, what: str, path: str) -> np.ndarray:
    pos = np.searchsorted(sorted_ids, ids)
    bad = (pos >= len(sorted_ids)) | (sorted_ids[np.minimum(pos, len(sorted_ids) - 1)] != ids)
    if bad.any():
        raise DataError(f"{path}: {what} id {int(ids[bad][0])} is not in the annotation file")
    return pos


def _read_json(path: str):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as JSON: {exc}") from None


def load_keypoint_ground_truth(path: str) -> KeypointGroundTruth:
    """Parse a COCO keypoint annotation file. Raises DataError naming the file and the annotation for a
    missing key or keypoints whose length is not 3 x the category's keypoint count."""
    doc = _read_json(path)
    try:
        files = {int(im["id"]): str(im.get("file_name", "")) for im in doc["images"]}
        images = np.array(sorted(files), dtype=np.int64)
        cats = sorted(doc["categories"], key=lambda c: int(c["id"]))
        cat_ids = np.array([int(c["id"]) for c in cats], dtype=np.int64)
        parts = max((len(c.get("keypoints") or []) for c in cats), default=0)
        anns = doc["annotations"]
        kps = np.array([a["keypoints"] for a in anns], dtype=np.float64).reshape(len(anns), -1)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a COCO keypoint annotation file ({type(exc).__name__}: {exc})") from None
    if parts == 0 or kps.shape[1] != 3 * parts:
        raise DataError(f"{path}: annotations hold {kps.shape[1]} keypoint values, the categories name {parts} "
                        f"keypoints (3 values each)")
    image = _index(images, np.array([int(a["image_id"]) for a in anns], dtype=np.int64), "image", path)
    category = _index(cat_ids, np.array([int(a["category_id"]) for a in anns], dtype=np.int64), "category", path)
    crowd = np.array([bool(a.get("iscrowd", 0)) for a in anns], dtype=bool)
    labelled = np.array([int(a.get("num_keypoints", 0)) for a in anns])
    return KeypointGroundTruth(str(path), images, cat_ids, [str(c["name"]) for c in cats], image, category,
                               np.array([int(a["id"]) for a in anns], dtype=np.int64), kps.reshape(-1, parts, 3),
                               np.array([float(a["area"]) for a in anns]),
                               np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4),
                               crowd, crowd | (labelled == 0), [files[int(i)] for i in images])


class KeypointReplay(Dataset):
    """The images of ``gt``, each carrying its detections from a COCO keypoint results file: ``({keypoints
    float64 [n, P, 3], scores float64 [n], labels int64 [n] (category ids)}, image index, sample id)``, the
    detections in file order. Raises DataError naming the file for unknown image or category ids or keypoints
    of the wrong length."""

    def __init__(self, gt: KeypointGroundTruth, results: str, limit: int | None = None):
        doc = _read_json(results)
        if not isinstance(doc, list):
            raise DataError(f"{results}: a COCO results file is a JSON list of detections")
        try:
            image = _index(gt.image_ids, np.array([int(d["image_id"]) for d in doc], dtype=np.int64), "image", results)
            labels = np.array([int(d["category_id"]) for d in doc], dtype=np.int64)
            _index(gt.category_ids, labels, "category", results)
            scores = np.array([float(d["score"]) for d in doc], dtype=np.float64)
            kps = np.array([d["keypoints"] for d in doc], dtype=np.float64).reshape(len(doc), -1)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{results}: not a COCO keypoint results file ({type(exc).__name__}: {exc})") from None
        if len(doc) and kps.shape[1] != 3 * gt.num_parts:
            raise DataError(f"{results}: detections hold {kps.shape[1]} keypoint values, the annotations "
                            f"{3 * gt.num_parts}")
        self.keypoints, self.scores, self.labels = kps.reshape(len(doc), gt.num_parts, 3), scores, labels
        self.order = np.argsort(image, kind="stable")
        self.starts = np.searchsorted(image[self.order], np.arange(gt.num_images + 1))
        self.num_samples = gt.num_images if limit is None else min(gt.num_images, limit)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        sel = self.order[self.starts[index]:self.starts[index + 1]]
        return {"keypoints": self.keypoints[sel], "scores": self.scores[sel], "labels": self.labels[sel]}, index, index


def collate_keypoints(batch):
    """``(list of per-image dicts or images, image indices int64 [B], sample ids int64 [B])``."""
    items, targets, ids = zip(*batch) if batch else ((), (), ())
    return list(items), torch.tensor(targets, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)
