"""Payload compression for gathered states, as pure functions (no torch.distributed here).

Modes (``communication.compression``):

- ``none``: payloads travel as they are.
- ``lossless``: exactly reversible narrowing, chosen from the *global* range (every rank agrees on one wire
  dtype from the exchanged metadata): booleans are bit-packed (8 flags per byte, ``numpy.packbits``);
  integers are sent as ``value - global_min`` in the smallest of uint8 / int16 / int32 that holds
  ``global_max - global_min``; float64 payloads whose every value is exactly a float32 on every rank are sent
  as float32. Anything else is sent unchanged.
- ``fp16`` / ``bf16``: float payloads that a metric declares *compressible* are rounded to half precision
  (round to nearest even, IEEE 754 binary16 or bfloat16). Integer counts and states declared exact are never
  rounded. The error introduced is measured on the real payload (``lossy_error``). fp16 rounds with
  numpy's correctly rounded float64 -> float16 cast (torch's cast goes through float32 and rounds twice, off
  by one unit in the last place for about 1 value in 17,000 here); bf16 uses torch's cast (numpy has no
  bfloat16), which may round twice the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from disteval.common.closed_sets import COMPRESSION_MODES

MODES = COMPRESSION_MODES
LOSSY = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class WirePlan:
    """How one payload travels: ``kind`` is ``raw``, ``bits`` (bool bit-packed), ``offset`` (integers minus
    ``offset`` as ``wire_dtype``), ``f32`` (exact float64 -> float32) or ``lossy`` (rounded to ``wire_dtype``)."""

    kind: str
    wire_dtype: torch.dtype
    offset: int = 0


def local_range(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of an integer tensor as Python ints; ``(0, 0)`` when empty or not an integer tensor."""
    if t.numel() == 0 or t.dtype not in _INT_DTYPES:
        return 0, 0
    return int(t.min()), int(t.max())


def exact_in_float32(t: torch.Tensor) -> bool:
    """True when ``t`` (float64) survives float64 -> float32 -> float64 unchanged (NaN and inf included)."""
    if t.dtype != torch.float64:
        return False
    back = t.to(torch.float32).to(torch.float64)
    return bool(((back == t) | (torch.isnan(back) & torch.isnan(t))).all())


def plan(mode: str, dtype: torch.dtype, compressible: bool, global_min: int = 0, global_max: int = 0,
         all_exact_f32: bool = False) -> WirePlan:
    """The wire plan of a payload of ``dtype`` under ``mode``, from the globally agreed facts (integer range
    over all ranks, whether every rank's float64 values are exact in float32). Lossy modes touch only float
    payloads with ``compressible=True``; every other payload keeps its dtype."""
    if mode in LOSSY:
        if compressible and dtype.is_floating_point:
            return WirePlan("lossy", LOSSY[mode])
        return WirePlan("raw", dtype)
    if mode != "lossless":
        return WirePlan("raw", dtype)
    if dtype == torch.bool:
        return WirePlan("bits", torch.uint8)
    if dtype in _INT_DTYPES:
        span = global_max - global_min
        for wire, top in ((torch.uint8, 255), (torch.int16, 2 ** 15 - 1), (torch.int32, 2 ** 31 - 1)):
            if span <= top and wire.itemsize < dtype.itemsize:
                return WirePlan("offset", wire, global_min)
        return WirePlan("raw", dtype)
    if dtype == torch.float64 and all_exact_f32:
        return WirePlan("f32", torch.float32)
    return WirePlan("raw", dtype)


def encode(t: torch.Tensor, p: WirePlan) -> torch.Tensor:
    """The wire form of ``t``: shape ``[rows, *trailing]`` except ``bits`` (1-D uint8 of ceil(numel/8))."""
    if p.kind == "bits":
        return torch.from_numpy(np.packbits(t.reshape(-1).numpy().astype(np.uint8)))
    if p.kind == "offset":
        return (t.to(torch.int64) - p.offset).to(p.wire_dtype)
    if p.kind == "lossy":
        return _quantise(t, p.wire_dtype)
    if p.kind == "f32":
        return t.to(p.wire_dtype)
    return t


def _quantise(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    if wire == torch.float16:
        return torch.from_numpy(t.detach().cpu().numpy().astype(np.float16)).to(t.device)
    return t.to(wire)


def encoded_rows(p: WirePlan, rows: int, row_numel: int) -> int:
    """First-dimension size of the wire form of a ``[rows, ...]`` payload with ``row_numel`` elements per row."""
    return math.ceil(rows * row_numel / 8) if p.kind == "bits" else rows


def decode(w: torch.Tensor, p: WirePlan, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``encode`` back to ``dtype`` and ``shape`` (lossy: the rounded values in ``dtype``)."""
    if p.kind == "bits":
        n = math.prod(shape)
        flat = np.unpackbits(w.numpy().astype(np.uint8), count=n) if n else np.zeros(0, np.uint8)
        return torch.from_numpy(flat.astype(bool)).reshape(shape)
    if p.kind == "offset":
        return (w.to(torch.int64) + p.offset).to(dtype)
    return w.to(dtype)


def lossy_error(t: torch.Tensor, p: WirePlan, encoded: torch.Tensor | None = None) -> tuple[float, float]:
    """``(max_abs_error, max_rel_error)`` that ``p`` introduces on ``t`` (0, 0 for exact plans and empty
    payloads). Relative error is |x - q(x)| / |x| over x != 0; an overflow to inf counts as inf.
    ``encoded``: ``encode(t, p)`` when already computed (saves a second rounding pass)."""
    if p.kind != "lossy" or t.numel() == 0:
        return 0.0, 0.0
    x = t.to(torch.float64)
    q = encoded if encoded is not None else _quantise(t, p.wire_dtype)
    err = (x - q.to(torch.float64)).abs()
    nz = x != 0
    rel = (err[nz] / x[nz].abs()).max().item() if bool(nz.any()) else 0.0
    return float(err.max().item()), float(rel)
