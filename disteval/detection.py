"""Detection jobs: COCO images through a torchvision detection model (``data.name=coco``), or a COCO results
file replayed against its annotation file (``data.name=coco_replay``). Builds the dataset, the model and the
CocoDetectionMetric; the per-rank loop is the engine's.

Images are sharded in sorted image-id order (the sample id of an image is its index in that order), so each
rank matches exactly the images of its shard.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch.utils.data import Dataset

from disteval.data.coco import CocoDetections, CocoGroundTruth, load_detections, load_ground_truth
from disteval.errors import CheckpointError, ConfigError, DataError
from disteval.metrics.detection import CocoDetectionMetric

DETECTION_DATASETS = ("coco", "coco_replay")


def is_detection(cfg: Any) -> bool:
    return cfg.data.name in DETECTION_DATASETS


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


def replay_forward(model, images):
    """``data.name=coco_replay``: the 'outputs' are the detections read from the results file."""
    return list(images)


def detector_forward(model, images, device):
    return model([im.to(device, non_blocking=True) for im in images])


def detection_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models.detection)


def build_detector(model_cfg: Any, gt: CocoGroundTruth, seed: int = 0) -> torch.nn.Module:
    """A torchvision detection model in eval mode. ``model.weights``: a weights name (e.g. COCO_V1, whose
    labels are COCO category ids) or null for random init with ``model.num_classes`` (default: the largest
    category id + 1, so that labels are category ids). Raises ConfigError / CheckpointError."""
    from disteval.models.checkpoint import check_state_dict, load_state_dict_file

    if model_cfg.name not in detection_models():
        raise ConfigError("model.name", f"{model_cfg.name!r} is not a torchvision detection model; available: "
                          f"{detection_models()}")
    kwargs = dict(model_cfg.kwargs or {})
    torch.manual_seed(seed)
    if model_cfg.weights not in (None, "", "none", "null") and not model_cfg.checkpoint:
        try:
            weights = torchvision.models.get_model_weights(model_cfg.name)[model_cfg.weights]
        except KeyError:
            raise ConfigError("model.weights", f"{model_cfg.weights!r} is not a weights name of {model_cfg.name}")
        return torchvision.models.get_model(model_cfg.name, weights=weights, **kwargs).eval()
    num_classes = model_cfg.num_classes or int(gt.category_ids.max(initial=0)) + 1
    net = torchvision.models.get_model(model_cfg.name, weights=None, weights_backbone=None, num_classes=num_classes,
                                       **kwargs)
    if model_cfg.checkpoint:
        state = load_state_dict_file(model_cfg.checkpoint)
        check_state_dict(net, state, str(model_cfg.checkpoint))
        try:
            net.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{model_cfg.checkpoint}: {exc}") from None
    return net.eval()


def check_detection_config(cfg: Any) -> None:
    """Preflight for detection jobs: keys present, files readable and valid (parsed once here so that a bad
    entry fails before any rank starts). Raises ConfigError or DataError naming the key / file / entry."""
    d = cfg.data
    if not d.annotations:
        raise ConfigError("data.annotations", f"data.name={d.name} needs data.annotations=PATH (COCO JSON)")
    if cfg.eval.iou_type not in ("bbox", "segm"):
        raise ConfigError("eval.iou_type", f"must be bbox or segm, got {cfg.eval.iou_type!r}")
    if list(cfg.eval.metrics) != ["coco"]:
        raise ConfigError("eval.metrics", f"detection data takes eval.metrics=[coco], got {list(cfg.eval.metrics)}")
    gt = load_ground_truth(d.annotations)
    if d.name == "coco_replay":
        if not d.predictions:
            raise ConfigError("data.predictions", "data.name=coco_replay needs data.predictions=PATH "
                              "(a COCO results JSON)")
        load_detections(d.predictions, gt, cfg.eval.iou_type)
    else:
        if not d.root or not Path(d.root).is_dir():
            raise ConfigError("data.root", f"data.name=coco needs data.root=DIR holding the images, got {d.root!r}")
        if cfg.eval.iou_type != "bbox":
            raise ConfigError("eval.iou_type", "live models are evaluated with iou_type bbox in this version")
        if cfg.model.name not in detection_models():
            raise ConfigError("model.name", f"{cfg.model.name!r} is not a torchvision detection model; "
                              f"available: {detection_models()}")
        if cfg.model.weights not in (None, "", "none", "null") and not cfg.model.checkpoint:
            try:  # download once here, not in every rank
                torchvision.models.get_model_weights(cfg.model.name)[cfg.model.weights].get_state_dict(progress=False)
            except KeyError:
                raise ConfigError("model.weights", f"{cfg.model.weights!r} is not a weights name of "
                                  f"{cfg.model.name}") from None
            except Exception as exc:  # noqa: BLE001 - offline machines land here
                raise ConfigError("model.weights", f"cannot fetch {cfg.model.name} {cfg.model.weights} "
                                  f"({type(exc).__name__}: {exc}); offline? pass model.checkpoint=PATH") from None


def build_detection_metric(cfg: Any, gt: CocoGroundTruth | None = None) -> CocoDetectionMetric:
    """The COCO metric of a detection job (reads ``data.annotations`` unless ``gt`` is given)."""
    gt = gt if gt is not None else load_ground_truth(cfg.data.annotations)
    return CocoDetectionMetric(gt, cfg.eval.iou_type, keep_predictions=bool(cfg.eval.save_predictions))


def build_detection_task(cfg: Any):
    """``(dataset, model or None, metric, ground truth)`` of a detection job."""
    gt = load_ground_truth(cfg.data.annotations)
    metric = build_detection_metric(cfg, gt)
    if cfg.data.name == "coco_replay":
        dets = load_detections(cfg.data.predictions, gt, cfg.eval.iou_type)
        return ReplayImages(gt, dets, cfg.data.limit), None, metric, gt
    dataset = CocoImages(cfg.data.root, cfg.data.annotations, gt, cfg.data.limit)
    return dataset, build_detector(cfg.model, gt, seed=cfg.seed), metric, gt
