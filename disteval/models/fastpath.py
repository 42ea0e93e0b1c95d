"""What the fast path does to a built model before evaluation: ``channels_last`` memory format for
convolutional models and opt-in ``torch.compile``. Both are recorded in results.json ``compute`` and named by
``python -m diagnostics compare`` when two runs differ in them."""
from __future__ import annotations

import torch
from torch import nn

from disteval.errors import ConfigError


def prepare_model(model: nn.Module, *, channels_last: bool, compile: bool, compile_mode: str = "default",
                  compile_backend: str = "inductor") -> nn.Module:
    """``model`` (already in eval mode on its device) ready for the loop.

    channels_last: parameters with 4 dimensions (convolution weights) in ``torch.channels_last`` memory format
    (values unchanged; cuDNN picks NHWC kernels; the step converts 4-D inputs alike, ``as_channels_last``).
    compile: ``torch.compile(model, mode=compile_mode, backend=compile_backend, dynamic=False)``: static shapes, so every rank compiles
    the same kernel for each batch shape it meets whatever its shard (automatic dynamic shapes would compile
    other kernels on a rank whose first batch is the short last one). Compilation happens at the first batch.
    Raises ConfigError naming ``eval.compile`` when torch.compile is unavailable (e.g. no C++ compiler for
    inductor on CPU shows at the first batch instead, as torch's own error)."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compile:
        if not hasattr(torch, "compile"):
            raise ConfigError("eval.compile", f"torch {torch.__version__} has no torch.compile")
        options = {"mode": compile_mode} if compile_backend == "inductor" else {}
        model = torch.compile(model, backend=compile_backend, dynamic=False, **options)
    return model


def as_channels_last(inputs):
    """4-D tensor inputs [B, C, H, W] in channels_last memory format (same values, same shape); anything else
    unchanged (lists of images of several sizes, token tensors)."""
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs
