"""Semantic segmentation data: label maps at their original resolution, never resized.

Sources of label maps (int [H, W], value = class index, ``ignore_index`` = not evaluated):
- a VOC-format folder (``VocFolder``): ``ROOT/ImageSets/Segmentation/<split>.txt`` (one image name a line),
  ``ROOT/JPEGImages/<name>.jpg`` (or ``.png``) and ``ROOT/SegmentationClass/<name>.png`` (palette or greyscale
  PNG holding class indices; VOC's boundary value 255 is its ignore value);
- a COCO instances file (``CocoSemanticLabels``): class 0 = background, class k = the k-th category in sorted
  category-id order; every annotation (pycocotools' annToRLE) painted in file order, a later one on top, crowd
  annotations painted as ``ignore_index``.

Predicted maps for replay: a folder of PNG label maps ``<name>.png`` (``PngMaps``), or a COCO-style results
JSON (``PaintedPredictions``): each entry's RLE painted with its class, lowest score first so that a higher
score ends on top (ties: file order, a later entry on top); pixels no entry covers are class 0.

Items are ``(input, label map, sample id)`` with the sample id the image's index (split-file order, or sorted
image-id order for COCO); ``collate_maps`` keeps them as lists, so images of different sizes are never padded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from torch.utils.data import Dataset

from disteval.data.coco import CocoDetections, CocoGroundTruth, to_rle
from disteval.errors import ConfigError, DataError


def collate_maps(batch):
    """``(list of B inputs, list of B label maps, sample ids int64 [B])``: nothing is stacked or padded."""
    inputs, labels, ids = zip(*batch) if batch else ((), (), ())
    return list(inputs), list(labels), torch.tensor(ids, dtype=torch.int64)


def label_tensor(array: np.ndarray) -> torch.Tensor:
    """A label map as uint8 when its values fit, else int32 (the metric reads any integer dtype)."""
    array = np.ascontiguousarray(array)
    if array.size and (array.min() < 0 or array.max() > 255):
        return torch.from_numpy(array.astype(np.int32))
    return torch.from_numpy(array.astype(np.uint8))


def read_label_png(path: Path, what: str) -> np.ndarray:
    """Class indices of a palette ('P'), greyscale ('L') or 16-bit ('I;16', 'I') PNG as an int array [H, W].
    Raises DataError naming the file (unreadable, or colour-coded RGB labels)."""
    try:
        with Image.open(path) as im:
            if im.mode not in ("P", "L", "I;16", "I"):
                raise DataError(f"{what} {path}: PNG mode {im.mode} holds colours, not class indices (label maps "
                                "must be palette, greyscale or 16-bit PNGs)")
            return np.asarray(im)
    except (OSError, ValueError) as exc:
        raise DataError(f"{what} {path}: cannot be read ({type(exc).__name__}: {exc})") from None


def check_voc_root(root: Any, split: str, key: str = "data.root") -> list[str]:
    """The image names of a VOC-format folder's split. Raises ConfigError naming ``key`` when the folder,
    its split file or the first listed image/label is missing."""
    if root in (None, ""):
        raise ConfigError(key, "needs the VOC-format folder: data.root=PATH holding ImageSets/Segmentation/"
                          f"{split}.txt, JPEGImages/ and SegmentationClass/ (e.g. VOCdevkit/VOC2012)")
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(key, f"{root!r} {'is not a directory' if base.exists() else 'does not exist'}; it must be a "
                          f"VOC-format folder holding ImageSets/Segmentation/{split}.txt, JPEGImages/ and "
                          "SegmentationClass/ (e.g. VOCdevkit/VOC2012)")
    listing = base / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise ConfigError(key, f"{listing} is missing (data.split={split!r}); a VOC-format folder lists the images "
                          "of each split there")
    names = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    if not names:
        raise ConfigError(key, f"{listing} lists no image")
    if _image_file(base, names[0]) is None or not (base / "SegmentationClass" / f"{names[0]}.png").is_file():
        raise ConfigError(key, f"{root}: the first image of {listing.name}, {names[0]!r}, has no JPEGImages/"
                          f"{names[0]}.jpg|.png or no SegmentationClass/{names[0]}.png")
    return names


def _image_file(root: Path, name: str) -> Path | None:
    for ext in (".jpg", ".png", ".jpeg"):
        path = root / "JPEGImages" / f"{name}{ext}"
        if path.is_file():
            return path
    return None


class VocFolder(Dataset):
    """A VOC-format folder's split. Items ``(image float32 [3, h, w] normalised, label map [H, W], sample id)``;
    the image is resized (bilinear, antialiased) so that its short side is ``resize_size`` when > 0 (the label
    never is). Raises ConfigError (folder) / DataError (a file, naming the sample id)."""

    def __init__(self, root: str, split: str, resize_size: int = 0, mean=(0.485, 0.456, 0.406),
                 std=(0.229, 0.224, 0.225), limit: int | None = None):
        self.root, self.names = Path(root), check_voc_root(root, split)
        self.resize_size, self.mean, self.std = int(resize_size), list(mean), list(std)
        self.num_samples = len(self.names) if limit is None else min(len(self.names), limit)

    def __len__(self) -> int:
        return self.num_samples

    def label(self, index: int) -> torch.Tensor:
        """The label map of sample ``index``."""
        name = self.names[index]
        return label_tensor(read_label_png(self.root / "SegmentationClass" / f"{name}.png", f"sample id {index} label"))

    def label_shape(self, index: int) -> tuple[int, int]:
        """(H, W) of sample ``index``'s label map, from the PNG header."""
        path = self.root / "SegmentationClass" / f"{self.names[index]}.png"
        try:
            with Image.open(path) as im:
                return im.size[1], im.size[0]
        except OSError as exc:
            raise DataError(f"sample id {index} label {path}: cannot be read ({type(exc).__name__}: {exc})") from None

    def __getitem__(self, index: int):
        from torchvision.transforms.v2 import functional as TF

        name = self.names[index]
        path = _image_file(self.root, name)
        if path is None:
            raise DataError(f"sample id {index}: no image JPEGImages/{name}.jpg|.png under {self.root}")
        try:
            with Image.open(path) as im:
                image = TF.to_dtype(TF.pil_to_tensor(im.convert("RGB")), torch.float32, scale=True)
        except OSError as exc:
            raise DataError(f"sample id {index} (file {path}): {type(exc).__name__}: {exc}") from None
        if self.resize_size > 0:
            image = TF.resize(image, [self.resize_size], antialias=True)
        return TF.normalize(image, self.mean, self.std), self.label(index), index


class CocoSemanticLabels:
    """Label maps of a COCO instances file (module docstring): ``len(gt.category_ids) + 1`` classes."""

    def __init__(self, gt: CocoGroundTruth, ignore_index: int = 255):
        self.gt, self.ignore_index = gt, ignore_index
        self.by_image = np.argsort(gt.ann_image, kind="stable")  # file order inside each image
        self.starts = np.searchsorted(gt.ann_image[self.by_image], np.arange(gt.num_images + 1))

    @property
    def num_classes(self) -> int:
        return self.gt.num_categories + 1

    def __call__(self, index: int) -> np.ndarray:
        gt = self.gt
        h, w = int(gt.heights[index]), int(gt.widths[index])
        out = np.zeros((h, w), dtype=np.int32)
        for a in self.by_image[self.starts[index]:self.starts[index + 1]]:
            value = self.ignore_index if gt.ann_crowd[a] else int(gt.ann_category[a]) + 1
            out[mask_utils.decode(gt.rle(int(a))).astype(bool)] = value
        return out


class PaintedPredictions:
    """Predicted maps painted from results entries (module docstring). ``image``, ``category`` (class index)
    and ``score`` arrays in entry order, ``segmentation`` the entries' RLEs; ``shape(i)`` the (H, W) of image i."""

    def __init__(self, image: np.ndarray, category: np.ndarray, score: np.ndarray, segmentation: list, shape,
                 where: str):
        self.category, self.segmentation, self.shape, self.where = category, segmentation, shape, where
        order = np.lexsort((np.arange(len(score)), score, image))  # by image, then score, then entry order
        self.order = order
        self.starts = np.searchsorted(image[order], np.arange(int(image.max(initial=-1)) + 2))

    def __call__(self, index: int) -> np.ndarray:
        h, w = self.shape(index)
        out = np.zeros((h, w), dtype=np.int32)
        if index + 1 >= len(self.starts):
            return out
        for e in self.order[self.starts[index]:self.starts[index + 1]]:
            rle = to_rle(self.segmentation[e], h, w, f"{self.where} entry {int(e)}")
            if tuple(rle["size"]) != (h, w):
                raise DataError(f"{self.where} entry {int(e)}: mask of size {list(rle['size'])} for sample id {index} "
                                f"whose label map is {h}x{w}")
            out[mask_utils.decode(rle).astype(bool)] = int(self.category[e])
        return out

    @classmethod
    def from_coco(cls, dets: CocoDetections, gt: CocoGroundTruth) -> "PaintedPredictions":
        """COCO segm detections (``disteval.data.coco.load_detections``): class = category index + 1."""
        return cls(dets.image, dets.category + 1, dets.score, dets.segmentation,
                   lambda i: (int(gt.heights[i]), int(gt.widths[i])), "predictions")

    @classmethod
    def from_json(cls, path: str, num_images: int, num_classes: int, shape) -> "PaintedPredictions":
        """A results JSON whose ``image_id`` is the sample id and ``category_id`` the class index (what
        ``eval.save_predictions=true`` writes). Raises DataError naming the file and entry."""
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"predictions file {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(entries, list):
            raise DataError(f"predictions file {path}: expected a JSON list of results entries")
        image, category, score = (np.zeros(len(entries), np.int64), np.zeros(len(entries), np.int64),
                                  np.ones(len(entries), np.float64))
        for k, e in enumerate(entries):
            if not isinstance(e, dict) or not {"image_id", "category_id", "segmentation"} <= set(e):
                raise DataError(f"predictions file {path} entry {k}: needs image_id, category_id and segmentation")
            image[k], category[k], score[k] = e["image_id"], e["category_id"], e.get("score", 1.0)
            if not 0 <= image[k] < num_images or not 0 <= category[k] < num_classes:
                raise DataError(f"predictions file {path} entry {k}: image_id {image[k]} outside [0, {num_images}) or "
                                f"category_id {category[k]} outside [0, {num_classes}) (ids are sample ids and "
                                "class indices)")
        return cls(image, category, score, [e["segmentation"] for e in entries], shape, f"predictions file {path}")


class PngMaps:
    """Predicted maps from a folder of PNG label maps ``FOLDER/<name>.png``."""

    def __init__(self, folder: str, names: list[str]):
        self.folder, self.names = Path(folder), names
        missing = [n for n in names if not (self.folder / f"{n}.png").is_file()]
        if missing:
            raise ConfigError("data.predictions", f"{folder} lacks {len(missing)} prediction maps, e.g. "
                              f"{missing[0]}.png")

    def __call__(self, index: int) -> np.ndarray:
        return read_label_png(self.folder / f"{self.names[index]}.png", f"sample id {index} prediction")


class ReplayMaps(Dataset):
    """Items ``(predicted map [H, W], label map [H, W], sample id)`` from two callables index -> array."""

    def __init__(self, predictions, labels, num_samples: int):
        self.predictions, self.labels, self.num_samples = predictions, labels, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        label = self.labels(index)
        label = label if torch.is_tensor(label) else label_tensor(label)
        return label_tensor(self.predictions(index)), label, index
