"""Cheap per-sample digests of model outputs, computed on the outputs' device with no host synchronisation,
so that two runs can be compared sample by sample (``python -m diagnostics compare``)."""
from __future__ import annotations

from typing import Any

import torch


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """int64 [B]: per row of ``t`` [B, ...], ``sum_j bits_j * (j + 1)`` (wrapping int64) where ``bits`` are
    the raw bit patterns of the values (float32/float16/bfloat16/float64/int). Equal rows give equal
    digests; a change of any bit (or a permutation of values) changes it except with negligible chance.
    A 0-d or 1-d tensor counts as one value per row."""
    if t.ndim == 0:
        t = t.reshape(1)
    flat = t.detach().reshape(t.shape[0], -1)
    if flat.dtype.is_floating_point:
        flat = flat.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])
    flat = flat.to(torch.int64)
    weights = torch.arange(1, flat.shape[1] + 1, dtype=torch.int64, device=flat.device)
    return (flat * weights).sum(1)


def outputs_digest(outputs: Any, batch_size: int) -> torch.Tensor:
    """int64 [B] digests of a batch's outputs: a tensor [B, ...] row by row; a list of B per-sample dicts or
    tensors (detection) item by item (the sum over a dict's tensors, in key order, of their whole digest)."""
    if torch.is_tensor(outputs):
        return tensor_digest(outputs) if outputs.ndim else tensor_digest(outputs.reshape(1))
    items = []
    for item in outputs:
        values = [item[k] for k in sorted(item)] if isinstance(item, dict) else [item]
        total = torch.zeros((), dtype=torch.int64)
        for v in values:
            if torch.is_tensor(v) and v.numel():
                total = total + tensor_digest(v.reshape(1, -1)).cpu()[0]
        items.append(total)
    return torch.stack(items) if items else torch.zeros(batch_size, dtype=torch.int64)
