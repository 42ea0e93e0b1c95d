"""Independent references for the segmentation tests: COCO label/prediction maps rasterised with pycocotools'
own COCO API (``annToMask``, ``loadRes``), confusion matrices from scikit-learn, metric values from the
confusion matrix in plain numpy, and generated VOC-format folders."""
from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.metrics import confusion_matrix

from conftest import SHARED

COCO_DIR = SHARED / "data" / "coco" / "fce_cocoapi"
COCO_GT = COCO_DIR / "instances_val2014_100.json"
COCO_SEGM = COCO_DIR / "instances_val2014_fakesegm100_results.json"
IGNORE = 255


def coco_maps() -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """(label maps, predicted maps, C) of the shared files, in sorted image-id order: labels = background 0 and
    category k (sorted ids) = k + 1, every annotation painted in file order (a later one on top), crowds as
    255; predictions painted lowest score first (ties: file order), uncovered pixels 0."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(COCO_GT))
        dt = gt.loadRes(str(COCO_SEGM))
    cats = sorted(gt.getCatIds())
    index = {c: k + 1 for k, c in enumerate(cats)}
    labels, preds = [], []
    for img in sorted(gt.getImgIds()):
        info = gt.imgs[img]
        lab = np.zeros((info["height"], info["width"]), dtype=np.int64)
        for ann in gt.dataset["annotations"]:  # file order
            if ann["image_id"] == img:
                lab[gt.annToMask(ann) == 1] = IGNORE if ann["iscrowd"] else index[ann["category_id"]]
        pred = np.zeros_like(lab)
        entries = [a for a in dt.dataset["annotations"] if a["image_id"] == img]
        for ann in sorted(entries, key=lambda a: a["score"]):  # sorted() is stable: ties keep file order
            pred[dt.annToMask(ann) == 1] = index[ann["category_id"]]
        labels.append(lab)
        preds.append(pred)
    return labels, preds, len(cats) + 1


def sklearn_confusion(labels, preds, num_classes: int, ignore=IGNORE) -> np.ndarray:
    """scikit-learn's confusion_matrix over every pixel of every image whose label is not ``ignore``."""
    lab = np.concatenate([np.asarray(x).reshape(-1) for x in labels]).astype(np.int64)
    pred = np.concatenate([np.asarray(x).reshape(-1) for x in preds]).astype(np.int64)
    keep = lab != ignore
    return confusion_matrix(lab[keep], pred[keep], labels=list(range(num_classes))).astype(np.int64)


def numpy_confusion(labels, preds, num_classes: int, ignore=IGNORE) -> np.ndarray:
    """The same with numpy's bincount of label * C + pred (scikit-learn's coo_matrix path takes seconds on the
    2^24-pixel set)."""
    c, cm = num_classes, np.zeros((num_classes, num_classes), dtype=np.int64)
    for lab, pred in zip(labels, preds):
        lab, pred = np.asarray(lab).reshape(-1).astype(np.int64), np.asarray(pred).reshape(-1).astype(np.int64)
        keep = lab != ignore
        cm += np.bincount(lab[keep] * c + pred[keep], minlength=c * c).reshape(c, c)
    return cm


def metrics_from_confusion(cm: np.ndarray) -> dict:
    """Per-class IoU / accuracy / Dice (None where undefined) and their means over defined values (an exactly
    rounded sum / count), pixel accuracy and fwIoU, from a confusion matrix in numpy."""
    tp, support, predicted = np.diag(cm), cm.sum(1), cm.sum(0)
    union = support + predicted - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, tp / union, np.nan)
        acc = np.where(support > 0, tp / support, np.nan)
        dice = np.where(union > 0, 2 * tp / (support + predicted), np.nan)

    def mean(v):
        kept = [x for x in v.tolist() if not math.isnan(x)]
        return math.fsum(kept) / len(kept) if kept else None

    total = int(support.sum())
    return {"mIoU": mean(iou), "mean_accuracy": mean(acc), "mean_dice": mean(dice),
            "pixel_accuracy": int(tp.sum()) / total, "num_pixels": total,
            "fwIoU": math.fsum((support[union > 0] * iou[union > 0]).tolist()) / total,
            "per_class_IoU": [None if math.isnan(x) else x for x in iou.tolist()],
            "per_class_accuracy": [None if math.isnan(x) else x for x in acc.tolist()],
            "per_class_dice": [None if math.isnan(x) else x for x in dice.tolist()],
            "per_class_support": support.tolist(), "per_class_predicted": predicted.tolist()}


def write_voc(root: Path, images: list[np.ndarray] | None, labels: list[np.ndarray], split: str = "val",
              predictions: list[np.ndarray] | None = None) -> list[str]:
    """A VOC-format folder: ROOT/ImageSets/Segmentation/<split>.txt, JPEGImages/<name>.png (RGB uint8; a grey
    placeholder when ``images`` is None), SegmentationClass/<name>.png (greyscale class indices) and, when given,
    ROOT/pred/<name>.png. Returns the names."""
    names = [f"img{i:03d}" for i in range(len(labels))]
    for sub in ("ImageSets/Segmentation", "JPEGImages", "SegmentationClass", "pred"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(names) + "\n")
    for i, name in enumerate(names):
        image = images[i] if images is not None else np.full((*labels[i].shape, 3), 128, np.uint8)
        Image.fromarray(image).save(root / "JPEGImages" / f"{name}.png")
        Image.fromarray(labels[i].astype(np.uint8), mode="L").save(root / "SegmentationClass" / f"{name}.png")
        if predictions is not None:
            Image.fromarray(predictions[i].astype(np.uint8), mode="L").save(root / "pred" / f"{name}.png")
    return names
