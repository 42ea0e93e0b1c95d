"""open_clip models for embedding evaluation: ``model.name=open_clip:ARCH`` (an open_clip architecture name)
with ``model.kwargs`` overriding its config (e.g. a tiny ``vision_cfg``/``text_cfg`` for offline tests).
Only random weights (``model.weights: null``) are built here: nothing is downloaded."""
from __future__ import annotations

from typing import Any, Callable

import torch

from disteval.errors import ConfigError

PREFIX = "open_clip:"


def is_open_clip(name: str) -> bool:
    """Whether ``model.name`` names an open_clip architecture."""
    return str(name).startswith(PREFIX)


def build_open_clip(model: Any, seed: int = 0) -> tuple[torch.nn.Module, Callable[[list[str]], torch.Tensor]]:
    """(model in eval mode on CPU with random weights drawn from ``seed``, tokenizer: list of str -> int64
    [n, context_length]). Raises ConfigError naming model.name / model.weights / model.checkpoint."""
    import open_clip

    arch = str(model.name)[len(PREFIX):]
    if arch not in open_clip.list_models():
        raise ConfigError("model.name", f"unknown open_clip architecture {arch!r}; e.g. ViT-B-32 "
                          "(open_clip.list_models())")
    if model.weights not in (None, "", "none", "null") or model.checkpoint:
        raise ConfigError("model.weights", "open_clip models are built with random weights here (weights: null, "
                          "checkpoint: null): pretrained weights would be a download")
    torch.manual_seed(seed)
    kwargs = {k: (dict(v) if hasattr(v, "items") else v) for k, v in dict(model.kwargs or {}).items()}
    net = open_clip.create_model(arch, pretrained=None, **kwargs).eval()
    context = int(net.context_length) if hasattr(net, "context_length") else 77
    tok = open_clip.get_tokenizer(arch, context_length=context)
    return net, lambda texts: tok(list(texts)).to(torch.int64)
