"""COCO-format inputs: ground truth (annotation JSON) and detections (results JSON, or live model outputs),
read once into arrays, with errors that name the file and the entry.

Conventions follow pycocotools (COCO / COCO.loadRes / COCOeval._prepare): images and categories are
evaluated in sorted id order; a ground truth is ignored when ``iscrowd`` is set; a results-file detection's
area is w*h when the results carry boxes (for segm results without boxes: the mask area); segmentations
become RLEs through pycocotools.mask with the image's height and width.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from disteval.errors import DataError
from disteval.common.coco_types import DetectionShard, GroundTruthShard, detections_from_arrays

IOU_TYPES = ("bbox", "segm")


def _read_json(path: str | Path, what: str):
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{what} {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{what} {path} cannot be read: {exc}") from None


def _int_ids(entries: list, key: str, where: str) -> np.ndarray:
    """int64 ids of ``entries[i][key]``; DataError naming the entry for anything but an integer (a float,
    a string or a bool would otherwise be converted silently)."""
    values = [e[key] for e in entries]
    for i, v in enumerate(values):
        if type(v) is not int:
            raise DataError(f"{where} entry {i}: {key} must be an integer, got {v!r}")
    return np.array(values, dtype=np.int64)


def _numbers(entries: list, key: str, where: str, default=None) -> np.ndarray:
    """float64 values of ``entries[i][key]`` (``default(entry)`` when absent); DataError naming the entry for
    a value that is not a finite number (null, a string, a bool)."""
    out = np.empty(len(entries), dtype=np.float64)
    for i, e in enumerate(entries):
        v = e[key] if key in e or default is None else default(e)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise DataError(f"{where} entry {i}: {key} must be a finite number, got {v!r}")
        out[i] = v
    return out


def _check_box(box, where: str) -> None:
    if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
        raise DataError(f"{where}: bbox must be [x, y, width, height] numbers, got {box!r}")
    if not all(math.isfinite(v) for v in box):
        raise DataError(f"{where}: bbox has a non-finite value: {box!r}")
    if box[2] < 0 or box[3] < 0:
        raise DataError(f"{where}: negative box size (width {box[2]}, height {box[3]}) in bbox {box!r}")


@dataclass
class CocoGroundTruth:
    """A COCO annotation file as arrays. ``image_ids`` int64 [I] and ``category_ids`` int64 [K] sorted;
    ``heights``/``widths`` int64 [I]; per annotation (file order) ``ann_image`` (image index), ``ann_category``
    (category index), ``ann_box`` float64 [n, 4] xywh, ``ann_area``, ``ann_crowd``, ``ann_id``, and the raw
    ``ann_segmentation`` objects (converted to RLE on demand, segm only)."""

    path: str
    image_ids: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    file_names: list[str]
    category_ids: np.ndarray
    category_names: list[str]
    ann_image: np.ndarray
    ann_category: np.ndarray
    ann_box: np.ndarray
    ann_area: np.ndarray
    ann_crowd: np.ndarray
    ann_id: np.ndarray
    ann_segmentation: list = field(repr=False, default_factory=list)
    _by_image: np.ndarray | None = field(default=None, repr=False)
    _image_starts: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_categories(self) -> int:
        return len(self.category_ids)

    def image_index(self, image_ids: np.ndarray, where: str) -> np.ndarray:
        """Indices of ``image_ids``; raises DataError naming ``where`` and the first unknown id."""
        idx = np.searchsorted(self.image_ids, image_ids)
        bad = (idx >= len(self.image_ids)) | (self.image_ids[np.minimum(idx, len(self.image_ids) - 1)] != image_ids)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise DataError(f"{where} entry {i}: image_id {int(image_ids[i])} is not an image of {self.path} "
                            f"({int(bad.sum())} such entries)")
        return idx

    def category_index(self, category_ids: np.ndarray, where: str) -> np.ndarray:
        """Indices of ``category_ids``; raises DataError naming ``where`` and the first unknown id."""
        idx = np.searchsorted(self.category_ids, category_ids)
        k = len(self.category_ids)
        bad = (idx >= k) | (self.category_ids[np.minimum(idx, k - 1)] != category_ids)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise DataError(f"{where} entry {i}: category_id {int(category_ids[i])} is not a category of "
                            f"{self.path} ({int(bad.sum())} such entries)")
        return idx

    def shard(self, images: np.ndarray, iou_type: str) -> GroundTruthShard:
        """The ground truths of the image indices ``images`` (file order), with RLEs for segm."""
        if self._by_image is None:
            self._by_image = np.argsort(self.ann_image, kind="stable")
            self._image_starts = np.searchsorted(self.ann_image[self._by_image], np.arange(self.num_images + 1))
        images = np.unique(images)
        parts = [self._by_image[self._image_starts[i]:self._image_starts[i + 1]] for i in images]
        sel = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        rle = [self.rle(int(i)) for i in sel] if iou_type == "segm" else None
        return GroundTruthShard(self.ann_image[sel], self.ann_category[sel], self.ann_box[sel], self.ann_area[sel],
                                self.ann_crowd[sel], self.ann_id[sel], rle)

    def rle(self, i: int):
        """Annotation ``i``'s segmentation as an RLE (pycocotools' annToRLE)."""
        img = int(self.ann_image[i])
        return to_rle(self.ann_segmentation[i], int(self.heights[img]), int(self.widths[img]),
                      f"{self.path} annotation {i} (id {int(self.ann_id[i])})")


def to_rle(segm, h: int, w: int, where: str):
    """Polygons, uncompressed or compressed RLE -> one compressed RLE (pycocotools' annToRLE)."""
    from pycocotools import mask as mask_utils

    try:
        if isinstance(segm, list):
            return mask_utils.merge(mask_utils.frPyObjects(segm, h, w))
        if isinstance(segm, dict) and isinstance(segm.get("counts"), list):
            return mask_utils.frPyObjects(segm, h, w)
        if isinstance(segm, dict) and "counts" in segm and "size" in segm:
            return segm
    except Exception as exc:  # noqa: BLE001 - pycocotools raises plain exceptions
        raise DataError(f"{where}: invalid segmentation: {exc}") from None
    raise DataError(f"{where}: segmentation must be polygons or an RLE dict, got {type(segm).__name__}")


def load_ground_truth(path: str | Path) -> CocoGroundTruth:
    """Read a COCO annotation JSON. Raises DataError naming the file and entry for malformed JSON, missing
    keys, duplicate image or category ids, annotations of unknown images or categories, negative box sizes."""
    path = str(path)
    data = _read_json(path, "annotation file")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "annotations",
                                                                                     "categories")):
        raise DataError(f"annotation file {path} must be an object with lists 'images', 'annotations' and "
                        "'categories'")
    try:
        images = sorted(data["images"], key=lambda im: im["id"])
        image_ids = np.array([im["id"] for im in images], dtype=np.int64)
        heights = np.array([im.get("height", 0) for im in images], dtype=np.int64)
        widths = np.array([im.get("width", 0) for im in images], dtype=np.int64)
        file_names = [str(im.get("file_name", "")) for im in images]
        cats = sorted(data["categories"], key=lambda c: c["id"])
        cat_ids = np.array([c["id"] for c in cats], dtype=np.int64)
    except (KeyError, TypeError) as exc:
        raise DataError(f"annotation file {path}: every image and category needs an integer 'id' ({exc})") from None
    for name, ids in (("image", image_ids), ("category", cat_ids)):
        dup = ids[1:][np.diff(ids) == 0]
        if dup.size:
            raise DataError(f"annotation file {path}: duplicate {name} ids {sorted(set(dup.tolist()))[:10]}")
    anns = data["annotations"]
    for i, a in enumerate(anns):
        missing = [k for k in ("id", "image_id", "category_id", "bbox") if k not in a]
        if missing:
            raise DataError(f"annotation file {path} annotation entry {i}: missing {missing}")
        _check_box(a["bbox"], f"annotation file {path} annotation entry {i} (id {a['id']})")
    gt = CocoGroundTruth(
        path, image_ids, heights, widths, file_names, cat_ids, [str(c.get("name", c["id"])) for c in cats],
        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 4)), np.zeros(0), np.zeros(0, bool),
        np.zeros(0, np.int64), [a.get("segmentation") for a in anns])
    where = f"annotation file {path} annotations"
    gt.ann_image = gt.image_index(_int_ids(anns, "image_id", where), where)
    gt.ann_category = gt.category_index(_int_ids(anns, "category_id", where), where)
    gt.ann_box = np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)
    gt.ann_area = _numbers(anns, "area", where, default=lambda a: a["bbox"][2] * a["bbox"][3])
    gt.ann_crowd = np.array([bool(a.get("iscrowd", 0)) for a in anns], dtype=bool)
    gt.ann_id = np.array([a["id"] for a in anns], dtype=np.int64)
    return gt


@dataclass
class CocoDetections:
    """Detections of a results file as arrays (entry order): image index, category index, score, box xywh,
    area, order within the image, and segmentations (segm)."""

    image: np.ndarray
    category: np.ndarray
    score: np.ndarray
    box: np.ndarray
    area: np.ndarray
    segmentation: list | None

    def select(self, images: np.ndarray) -> DetectionShard:
        """The detections of the image indices ``images`` (a shard), with their order inside each image."""
        mask = np.isin(self.image, images)
        sel = np.nonzero(mask)[0]
        return detections_from_arrays(self.image[sel], self.category[sel], self.score[sel], self.box[sel],
                                      self.area[sel], [self.segmentation[i] for i in sel]
                                      if self.segmentation is not None else None)


def load_detections(path: str | Path, gt: CocoGroundTruth, iou_type: str) -> CocoDetections:
    """Read a COCO results JSON (a list of {image_id, category_id, score, bbox and/or segmentation}).
    Raises DataError naming the file and entry for malformed JSON, missing keys, unknown image or category
    ids, non-finite scores and negative box sizes."""
    path = str(path)
    data = _read_json(path, "predictions file")
    if not isinstance(data, list):
        raise DataError(f"predictions file {path} must be a JSON list of detections, got {type(data).__name__}")
    need = ("image_id", "category_id", "score", "bbox" if iou_type == "bbox" else "segmentation")
    for i, d in enumerate(data):
        if not isinstance(d, dict) or any(k not in d for k in need):
            raise DataError(f"predictions file {path} entry {i}: needs keys {list(need)}, got "
                            f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
    where = f"predictions file {path}"
    image = gt.image_index(_int_ids(data, "image_id", where), where)
    category = gt.category_index(_int_ids(data, "category_id", where), where)
    score = _numbers(data, "score", where)
    has_box = bool(data) and "bbox" in data[0] and data[0]["bbox"] != []  # loadRes takes its bbox branch
    segm = None
    if has_box:
        for i, d in enumerate(data):
            _check_box(d.get("bbox"), f"{where} entry {i}")
        box = np.array([d["bbox"] for d in data], dtype=np.float64).reshape(-1, 4)
        area = box[:, 2] * box[:, 3]
    else:
        box = np.zeros((len(data), 4))
        area = np.zeros(len(data))
    if iou_type == "segm":
        from pycocotools import mask as mask_utils

        segm = [to_rle(d["segmentation"], int(gt.heights[image[i]]), int(gt.widths[image[i]]), f"{where} entry {i}")
                for i, d in enumerate(data)]
        if not has_box:
            area = np.array([mask_utils.area(r) for r in segm], dtype=np.float64)
            box = np.array([mask_utils.toBbox(r) for r in segm], dtype=np.float64).reshape(-1, 4)
    return CocoDetections(image, category, score, box, area, segm)
