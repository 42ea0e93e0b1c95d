"""torchvision detection models by name (random init, torchvision weights or a local checkpoint)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from disteval.errors import ConfigError
from disteval.models.checkpoint import load_checkpoint_into


def detection_models() -> list[str]:
    """torchvision's detection model names (imports torchvision: seconds, so only when a detector is asked for)."""
    import torchvision.models.detection

    return torchvision.models.list_models(module=torchvision.models.detection)


def build_detector(model_cfg: Any, category_ids: np.ndarray, seed: int = 0) -> torch.nn.Module:
    """A torchvision detection model in eval mode. ``model.weights``: a weights name (e.g. COCO_V1, whose
    labels are COCO category ids) or null for random init with ``model.num_classes`` (default: the largest
    category id of ``category_ids`` + 1, so that labels are category ids). Raises ConfigError / CheckpointError."""
    if model_cfg.name not in detection_models():
        raise ConfigError("model.name", f"{model_cfg.name!r} is not a torchvision detection model; available: "
                          f"{detection_models()}")
    import torchvision

    kwargs = dict(model_cfg.kwargs or {})
    torch.manual_seed(seed)
    if model_cfg.weights not in (None, "", "none", "null") and not model_cfg.checkpoint:
        try:
            weights = torchvision.models.get_model_weights(model_cfg.name)[model_cfg.weights]
        except KeyError:
            raise ConfigError("model.weights", f"{model_cfg.weights!r} is not a weights name of {model_cfg.name}") from None
        return torchvision.models.get_model(model_cfg.name, weights=weights, **kwargs).eval()
    num_classes = model_cfg.num_classes or int(category_ids.max(initial=0)) + 1
    net = torchvision.models.get_model(model_cfg.name, weights=None, weights_backbone=None, num_classes=num_classes,
                                       **kwargs)
    if model_cfg.checkpoint:
        load_checkpoint_into(net, model_cfg.checkpoint)
    return net.eval()
