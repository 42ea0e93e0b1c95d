"""COCO-format inputs: ground truth (annotation JSON) and detections (results JSON, or live model outputs),
read once into arrays, with errors that name the file and the entry.

Conventions follow pycocotools (COCO / COCO.loadRes / COCOeval._prepare): images and categories are
evaluated in sorted id order; a ground truth is ignored when ``iscrowd`` is set; a results-file detection's
area is w*h when the results carry boxes (for segm results without boxes: the mask area); segmentations
become RLEs through pycocotools.mask with the image's height and width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from pathlib import Path

import numpy as np

from disteval.common.coco_types import DetectionShard, GroundTruthShard, detections_from_arrays
from disteval.data.coco_json import (UNSET, BoxDetection, GroundTruthFile, SegmDetection, decode_generic, decode_raw,
                                     decode_typed, read_bytes)
from disteval.common.closed_sets import IOU_TYPES  # noqa: F401 - re-exported for the readers' callers
from disteval.errors import DataError



def _int_ids(entries: list, key: str, where: str) -> np.ndarray:
    """int64 ids of ``entries[i][key]``; DataError naming the entry for anything but an integer (a float,
    a string or a bool would otherwise be converted silently)."""
    values = [e[key] for e in entries]
    for i, v in enumerate(values):
        if type(v) is not int:
            raise DataError(f"{where} entry {i}: {key} must be an integer, got {v!r}")
        if not -2 ** 63 <= v < 2 ** 63:
            raise DataError(f"{where} entry {i}: {key} {v} does not fit a 64-bit integer")
    return np.array(values, dtype=np.int64)


def _column(entries: list, key: str, dtype) -> np.ndarray:
    """``entries[i].key`` of typed entries (coco_json structs) as one array; OverflowError for an integer
    outside int64."""
    return np.fromiter(map(attrgetter(key), entries), dtype, len(entries))


def _box_column(entries: list) -> np.ndarray | None:
    """float64 [n, 4] boxes of typed entries; None when one is non-finite or has a negative size (the
    generic path then names the entry)."""
    n = len(entries)
    box = np.fromiter(chain.from_iterable(map(attrgetter("bbox"), entries)), np.float64, 4 * n).reshape(n, 4)
    return box if np.isfinite(box).all() and (box[:, 2:] >= 0).all() else None


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
    ``ann_segmentation`` objects (decoded JSON, or ``msgspec.Raw`` JSON text from the typed decode; converted
    to RLE on demand, segm only)."""

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
        where = f"{self.path} annotation {i} (id {int(self.ann_id[i])})"
        try:
            segm = decode_raw(self.ann_segmentation[i])
        except Exception as exc:  # noqa: BLE001 - kept raw from a file that decoded: not expected
            raise DataError(f"{where}: invalid segmentation: {exc}") from None
        return to_rle(segm, int(self.heights[img]), int(self.widths[img]), where)


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
    """Read a COCO annotation JSON. Raises DataError naming the file and entry for malformed JSON (with line
    and column), missing keys, duplicate image or category ids, annotations of unknown images or categories,
    negative box sizes.

    A well-formed file is decoded once, typed (``coco_json.GroundTruthFile``: segmentations stay raw JSON
    until ``rle`` needs them); a file that does not fit those types is decoded generically and checked entry
    by entry, so that the error names the entry (``_ground_truth_generic``)."""
    path = str(path)
    data = read_bytes(path, "annotation file")
    typed = decode_typed(data, GroundTruthFile)
    gt = _ground_truth_typed(path, typed) if typed is not None else None
    return gt if gt is not None else _ground_truth_generic(path, decode_generic(data, path, "annotation file"))


def _check_unique(path: str, image_ids: np.ndarray, cat_ids: np.ndarray) -> None:
    """DataError naming the duplicates among sorted image or category ids."""
    for name, ids in (("image", image_ids), ("category", cat_ids)):
        dup = ids[1:][np.diff(ids) == 0]
        if dup.size:
            raise DataError(f"annotation file {path}: duplicate {name} ids {sorted(set(dup.tolist()))[:10]}")


def _ground_truth_typed(path: str, f: GroundTruthFile) -> CocoGroundTruth | None:
    """The arrays of a typed annotation file; None where the generic path must judge an entry (a box that
    is non-finite or of negative size, an id outside int64). Same checks and messages as the generic path."""
    images = sorted(f.images, key=attrgetter("id"))
    cats = sorted(f.categories, key=attrgetter("id"))
    anns = f.annotations
    try:
        image_ids, cat_ids = _column(images, "id", np.int64), _column(cats, "id", np.int64)
        heights, widths = _column(images, "height", np.int64), _column(images, "width", np.int64)
        ann_image, ann_category = _column(anns, "image_id", np.int64), _column(anns, "category_id", np.int64)
        ann_id, crowd = _column(anns, "id", np.int64), _column(anns, "iscrowd", np.int64) != 0
    except OverflowError:
        return None
    _check_unique(path, image_ids, cat_ids)
    box = _box_column(anns)
    if box is None:
        return None
    names = [c.name if c.name is not UNSET else str(c.id) for c in cats]
    area = np.fromiter((a.area if a.area is not UNSET else a.bbox[2] * a.bbox[3] for a in anns), np.float64,
                       len(anns))
    gt = CocoGroundTruth(path, image_ids, heights, widths, [im.file_name for im in images], cat_ids, names,
                         ann_image, ann_category, box, area, crowd, ann_id,
                         list(map(attrgetter("segmentation"), anns)))
    where = f"annotation file {path} annotations"
    gt.ann_image = gt.image_index(ann_image, where)
    gt.ann_category = gt.category_index(ann_category, where)
    return gt


def _ground_truth_generic(path: str, data) -> CocoGroundTruth:
    """The arrays of a generically decoded annotation file, checked entry by entry."""
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
    except (KeyError, TypeError, OverflowError) as exc:
        raise DataError(f"annotation file {path}: every image and category needs an integer 'id' ({exc})") from None
    _check_unique(path, image_ids, cat_ids)
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
    Raises DataError naming the file and entry for malformed JSON (with line and column), missing keys,
    unknown image or category ids, non-finite scores and negative box sizes.

    A well-formed file is decoded once, typed (``coco_json.BoxDetection`` / ``SegmDetection``, no dict per
    entry); a file that does not fit those types is decoded generically and checked entry by entry
    (``_detections_generic``), so that the error names the entry."""
    path = str(path)
    kind = list[BoxDetection] if iou_type == "bbox" else list[SegmDetection]
    entries = decode_typed(read_bytes(path, "predictions file"), kind)  # the bytes are freed once decoded
    dets = _detections_typed(path, gt, iou_type, entries) if entries is not None else None
    if dets is not None:
        return dets
    del entries
    data = read_bytes(path, "predictions file")  # only files with a problem or an unusual entry come here
    return _detections_generic(path, gt, iou_type, decode_generic(data, path, "predictions file"))


def _detections_typed(path: str, gt: CocoGroundTruth, iou_type: str, entries: list) -> CocoDetections | None:
    """The arrays of typed results entries; None where the generic path must judge an entry (a box that is
    non-finite, of negative size or missing where the first entry has one, an id outside int64)."""
    where = f"predictions file {path}"
    try:
        image_ids, category_ids = _column(entries, "image_id", np.int64), _column(entries, "category_id", np.int64)
    except OverflowError:
        return None
    score = _column(entries, "score", np.float64)
    has_box = bool(entries) and (iou_type == "bbox" or entries[0].bbox is not UNSET)  # loadRes' bbox branch
    box = None
    if has_box:
        if iou_type == "segm" and any(e.bbox is UNSET for e in entries):
            return None
        box = _box_column(entries)
        if box is None:
            return None
    if not np.isfinite(score).all():
        return None
    image = gt.image_index(image_ids, where)
    category = gt.category_index(category_ids, where)
    segms = list(map(attrgetter("segmentation"), entries)) if iou_type == "segm" else None
    return _detections_from(where, gt, (image, category, score), box, segms)


def _detections_generic(path: str, gt: CocoGroundTruth, iou_type: str, data) -> CocoDetections:
    """The arrays of a generically decoded results file, checked entry by entry."""
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
    box = None
    if has_box:
        for i, d in enumerate(data):
            _check_box(d.get("bbox"), f"{where} entry {i}")
        box = np.array([d["bbox"] for d in data], dtype=np.float64).reshape(-1, 4)
    segms = [d["segmentation"] for d in data] if iou_type == "segm" else None
    return _detections_from(where, gt, (image, category, score), box, segms)


def _detections_from(where: str, gt: CocoGroundTruth, columns: tuple, box: np.ndarray | None,
                     segms: list | None) -> CocoDetections:
    """CocoDetections from checked columns (image index, category index, score), the boxes (None when the
    results carry none) and the raw segmentations (segm only), with pycocotools' loadRes rules: area = w*h
    where boxes are given, else the mask's area and its bounding box."""
    image, category, score = columns
    n = len(image)
    area = box[:, 2] * box[:, 3] if box is not None else np.zeros(n)
    rles = None
    if segms is not None:
        from pycocotools import mask as mask_utils

        rles = [to_rle(s, int(gt.heights[image[i]]), int(gt.widths[image[i]]), f"{where} entry {i}")
                for i, s in enumerate(segms)]
        if box is None:
            area = np.array([mask_utils.area(r) for r in rles], dtype=np.float64)
            box = np.array([mask_utils.toBbox(r) for r in rles], dtype=np.float64).reshape(-1, 4)
    return CocoDetections(image, category, score, box if box is not None else np.zeros((n, 4)), area, rles)
