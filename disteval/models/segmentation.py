"""torchvision semantic segmentation models by name (fcn, deeplabv3, lraspp): random init, torchvision weights
or a local checkpoint; the evaluation reads their ``out`` head."""
from __future__ import annotations

from typing import Any

import torch

from disteval.errors import ConfigError
from disteval.models.checkpoint import load_checkpoint_into


def segmentation_models() -> list[str]:
    """torchvision's segmentation model names (fcn_resnet50, deeplabv3_resnet50, lraspp_mobilenet_v3_large, ...)."""
    import torchvision.models.segmentation

    return torchvision.models.list_models(module=torchvision.models.segmentation)


def has_weights(model_cfg: Any) -> bool:
    """Whether ``model.weights`` names torchvision weights (and no checkpoint replaces them)."""
    return model_cfg.weights not in (None, "", "none", "null") and not model_cfg.checkpoint


def build_segmenter(model_cfg: Any, num_classes: int, seed: int = 0) -> torch.nn.Module:
    """A torchvision segmentation model in eval mode, without the auxiliary head. ``model.weights``: a weights
    name (e.g. COCO_WITH_VOC_LABELS_V1, 21 VOC classes) or null for random init with ``num_classes`` outputs
    (backbone random too; seeded by ``seed``); ``model.checkpoint``: a plain state dict (weights_only).
    Raises ConfigError for an unknown name/weights or a class count the weights do not have, CheckpointError
    for a checkpoint that does not fit."""
    import torchvision

    if model_cfg.name not in segmentation_models():
        raise ConfigError("model.name", f"{model_cfg.name!r} is not a torchvision segmentation model; available: "
                          f"{segmentation_models()}")
    kwargs = dict(model_cfg.kwargs or {})
    torch.manual_seed(seed)
    if has_weights(model_cfg):
        try:
            weights = torchvision.models.get_model_weights(model_cfg.name)[model_cfg.weights]
        except KeyError:
            raise ConfigError("model.weights", f"{model_cfg.weights!r} is not a weights name of {model_cfg.name}") from None
        classes = len(weights.meta["categories"])
        if classes != num_classes:
            raise ConfigError("model.num_classes", f"{model_cfg.name} {model_cfg.weights} predicts {classes} classes "
                              f"but the data has {num_classes}")
        return torchvision.models.get_model(model_cfg.name, weights=weights, **kwargs).eval()
    if not model_cfg.name.startswith("lraspp"):  # lraspp has no auxiliary head
        kwargs.setdefault("aux_loss", False)
    net = torchvision.models.get_model(model_cfg.name, weights=None, weights_backbone=None, num_classes=num_classes,
                                       **kwargs)
    if model_cfg.checkpoint:
        load_checkpoint_into(net, model_cfg.checkpoint, drop_prefixes=("aux_classifier.",))
    return net.eval()
