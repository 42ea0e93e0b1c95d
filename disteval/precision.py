"""Precision policy: model compute dtype via autocast, TF32 and determinism switches.

Metric state dtypes are fixed by the metrics (int64 counts, float64 sums); ``check_metric_dtypes`` refuses
a configuration that asks for narrower ones (a float32 counter stops at 2^24 = 16,777,216 samples, fp16 at
2,048, bf16 at 256).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Any

import torch

from disteval.errors import ConfigError

log = logging.getLogger(__name__)
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_metric_dtypes(precision: Any) -> None:
    """Raise ConfigError unless precision.count_dtype is int64 and precision.sum_dtype float64."""
    if str(precision.count_dtype) != "int64":
        raise ConfigError("precision.count_dtype", f"metric counts are always int64; {precision.count_dtype!r} "
                          "is refused (float32 counts stop at 2^24 = 16,777,216, int32 at 2^31 - 1)")
    if str(precision.sum_dtype) != "float64":
        raise ConfigError("precision.sum_dtype", f"metric sums are always float64; {precision.sum_dtype!r} "
                          "is refused (an fp16 sum of 8 x 10,000 is inf)")


def model_dtype_name(precision: Any) -> str:
    return str(getattr(precision.model_dtype, "value", precision.model_dtype))


def use_deterministic_algorithms(warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=...)`` for eager evaluation. torch's function also
    sets torch._inductor's config, and importing that (with torch._dynamo) costs about 1.5-2 s per process;
    nothing here compiles, so unless inductor is already loaded only the eager switch is set (the same one
    ``torch.are_deterministic_algorithms_enabled()`` reads)."""
    set_eager = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_eager is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
    else:
        set_eager(True, warn_only=warn_only)


def apply_global_switches(precision: Any, device: torch.device, bitwise: bool = False) -> None:
    """Set TF32 (off unless precision.tf32) and determinism (precision.deterministic, or ``bitwise`` for
    ``eval.mode=bitwise``: deterministic algorithms, cuDNN benchmark off, CUBLAS_WORKSPACE_CONFIG; in bitwise
    mode an op without a deterministic implementation warns instead of failing). Warns when the model runs in
    bf16/fp16 on CPU: measured here about 25x slower than fp32."""
    torch.backends.cuda.matmul.allow_tf32 = bool(precision.tf32)
    torch.backends.cudnn.allow_tf32 = bool(precision.tf32)
    if precision.deterministic or bitwise:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        use_deterministic_algorithms(warn_only=not precision.deterministic)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    name = model_dtype_name(precision)
    if name not in _AUTOCAST:
        raise ConfigError("precision.model_dtype", f"{name!r} is not one of {list(_AUTOCAST)}")
    if device.type == "cpu" and name != "fp32":
        warnings.warn(f"precision.model_dtype={name} on CPU: autocast to {name} was measured about 25x slower "
                      "than fp32 on CPU; use precision=fp32 unless you study low-precision effects", stacklevel=2)


def autocast(precision: Any, device: torch.device):
    """Context manager for the model's forward pass: autocast to bf16/fp16, or nothing for fp32."""
    dtype = _AUTOCAST[model_dtype_name(precision)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
