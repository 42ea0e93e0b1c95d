"""COCO images as datasets: the images of an annotation file (through torchvision's CocoDetection), or the
detections of a results file replayed image by image. Images are in sorted image-id order and the sample id
of an image is its index in that order, so each rank matches exactly the images of its shard."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from disteval.data.coco import CocoDetections, CocoGroundTruth
from disteval.errors import DataError


def collate_images(batch):
    """Keep images of different sizes as a list: ``(list of [3, H, W] float tensors, image indices int64 [B],
    sample ids int64 [B])``."""
    images, targets, ids = zip(*batch) if batch else ((), (), ())
    return list(images), torch.tensor(targets, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)


class CocoImages(Dataset):
    """The images of a COCO annotation file, read through torchvision's CocoDetection (sorted image ids).
    Items: ``(image float32 [3, H, W] in [0, 1], image index, sample id)``; a file that cannot be read
    raises DataError naming the sample id and the file."""

    def __init__(self, root: str, annotations: str, gt: CocoGroundTruth, limit: int | None = None):
        from torchvision.datasets import CocoDetection
        from torchvision.transforms import v2

        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints while indexing
            self.base = CocoDetection(root, annotations,
                                      transform=v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]))
        if list(self.base.ids) != gt.image_ids.tolist():
            raise DataError(f"{annotations}: torchvision's CocoDetection lists other image ids than the file")
        self.root, self.gt = root, gt
        self.num_samples = len(self.base) if limit is None else min(len(self.base), limit)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        try:
            image, _ = self.base[index]
        except Exception as exc:  # noqa: BLE001 - re-raised naming the sample
            raise DataError(f"cannot load sample id {index} (file {Path(self.root) / self.gt.file_names[index]}): "
                            f"{type(exc).__name__}: {exc}") from exc
        return image, index, index


class ReplayImages(Dataset):
    """The images of an annotation file, each item carrying its detections from a results file:
    ``(detections dict, image index, sample id)``."""

    def __init__(self, gt: CocoGroundTruth, dets: CocoDetections, limit: int | None = None):
        self.gt, self.dets = gt, dets
        self.order = np.argsort(dets.image, kind="stable")
        self.starts = np.searchsorted(dets.image[self.order], np.arange(gt.num_images + 1))
        self.num_samples = gt.num_images if limit is None else min(gt.num_images, limit)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        sel = self.order[self.starts[index]:self.starts[index + 1]]
        d = self.dets
        out = {"bbox": d.box[sel], "area": d.area[sel], "scores": d.score[sel],
               "labels": self.gt.category_ids[d.category[sel]]}  # area as loadRes computed it
        if d.segmentation is not None:
            out["segmentation"] = [d.segmentation[i] for i in sel]
        return out, index, index
