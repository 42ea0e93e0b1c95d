"""The columns of a prediction store (``eval.save_predictions=true``) for each kind of output, and the pyarrow
table of a rank's batches (``build_table``). A task declares its schema (``Task.prediction_schema``) and turns
each batch into columns (``Task.prediction_columns``) with the functions here; the store's writer
(``disteval.rank.predictions``) knows no task. Classification's columns are ``prediction_store.classification_columns``.

Column values per batch: a 1-D numpy array (one value per sample), a 2-D array (a fixed-size list per sample),
or a list of per-sample arrays of varying length (a list column; 2-D per-sample arrays make lists of fixed-size
lists, e.g. boxes).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from disteval.common.coco_types import xyxy_to_xywh


def detection_schema():
    """sample_id int64, image_id int64 (COCO), and per image what the COCO metric evaluates, in a COCO results
    file's terms: bbox list<fixed_size_list<float64, 4>> (x, y, w, h pixels), scores list<float64>, labels
    list<int64> (category ids), area list<float64> (the area matched against the area ranges). Re-scoring feeds
    these back unchanged, so a detection store re-scores to the writer's bits."""
    import pyarrow as pa

    return pa.schema([("sample_id", pa.int64()), ("image_id", pa.int64()),
                      ("bbox", pa.list_(pa.list_(pa.float64(), 4))), ("scores", pa.list_(pa.float64())),
                      ("labels", pa.list_(pa.int64())), ("area", pa.list_(pa.float64()))])


def detection_columns(outputs: list[dict], image_ids: np.ndarray, ids: torch.Tensor) -> dict[str, Any]:
    """One batch of detections: ``outputs`` B dicts with ``boxes`` [n, 4] xyxy (torchvision detectors) or
    ``bbox`` [n, 4] xywh (a results file), ``scores`` [n], ``labels`` [n], optionally ``area`` [n]; boxes
    converted to xywh in float64 and the area taken (or computed as w * h) as ``CocoDetectionMetric`` does;
    ``image_ids`` int64 [B] (COCO ids); ``ids`` int64 [B] global sample ids."""
    boxes, scores, labels, areas = [], [], [], []
    for out in outputs:
        b = (np.asarray(out["bbox"], dtype=np.float64).reshape(-1, 4) if "bbox" in out
             else xyxy_to_xywh(_np(out["boxes"])))
        boxes.append(b)
        scores.append(_np(out["scores"]).astype(np.float64).reshape(-1))
        labels.append(_np(out["labels"]).astype(np.int64).reshape(-1))
        areas.append(np.asarray(out["area"], dtype=np.float64).reshape(-1) if "area" in out else b[:, 2] * b[:, 3])
    return {"sample_id": _np(ids).astype(np.int64), "image_id": np.asarray(image_ids, dtype=np.int64),
            "bbox": boxes, "scores": scores, "labels": labels, "area": areas}


def segmentation_schema(num_classes: int, label_maps: bool):
    """sample_id int64, confusion fixed_size_list<int64, C*C> (row-major [true class, predicted class] pixel
    counts of the image, ignored pixels left out), and with ``label_maps`` height int32, width int32,
    label_map list<uint16> (the predicted classes, row-major)."""
    import pyarrow as pa

    fields = [("sample_id", pa.int64()), ("confusion", pa.list_(pa.int64(), num_classes * num_classes))]
    if label_maps:
        fields += [("height", pa.int32()), ("width", pa.int32()), ("label_map", pa.list_(pa.uint16()))]
    return pa.schema(fields)


def segmentation_columns(outputs: list[torch.Tensor], targets: list[torch.Tensor], ids: torch.Tensor,
                         num_classes: int, ignore_index: int | None, label_maps: bool) -> dict[str, Any]:
    """One batch of label maps: ``outputs`` B logits [C, h, w] or predicted maps [H, W]; ``targets`` B label
    maps [H, W]. Logits are taken as the metric takes them (``SegmentationMetrics``): resized bilinearly
    (``align_corners=False``) to the label's [H, W] when their size differs, then the arg-max (ties to the lowest
    class). Pixels whose label is ``ignore_index`` (or outside [0, C)) are left out of the confusion counts, as the
    metric leaves them out; the stored map is at the label's size."""
    import torch.nn.functional as F

    c = num_classes
    conf, maps, heights, widths = [], [], [], []
    for out, label in zip(outputs, targets):
        size = tuple(label.shape[-2:])
        if out.dtype.is_floating_point:
            if tuple(out.shape[1:]) != size:
                out = F.interpolate(out[None].float(), size=size, mode="bilinear", align_corners=False)[0]
            out = out.argmax(0)
        pred, label = out.detach().cpu().long().reshape(-1), label.detach().cpu().long().reshape(-1)
        keep = (label >= 0) & (label < c) & (pred >= 0) & (pred < c)
        if ignore_index is not None:
            keep &= label != ignore_index
        conf.append(torch.bincount(label[keep] * c + pred[keep], minlength=c * c).numpy())
        if label_maps:
            heights.append(size[0])
            widths.append(size[1])
            maps.append(pred.numpy().astype(np.uint16))
    cols: dict[str, Any] = {"sample_id": _np(ids).astype(np.int64),
                            "confusion": np.stack(conf).astype(np.int64) if conf else np.zeros((0, c * c), np.int64)}
    if label_maps:
        cols.update(height=np.asarray(heights, np.int32), width=np.asarray(widths, np.int32), label_map=maps)
    return cols


def embedding_schema(dim: int):
    """sample_id int64, target int64, embedding fixed_size_list<float32, dim>."""
    import pyarrow as pa

    return pa.schema([("sample_id", pa.int64()), ("target", pa.int64()), ("embedding", pa.list_(pa.float32(), dim))])


def embedding_columns(outputs: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    """One batch of embeddings: ``outputs`` float [B, D] as the metric receives them (normalised when the
    task normalises), ``targets`` int64 [B] class ids, ``ids`` int64 [B]."""
    return {"sample_id": _np(ids).astype(np.int64), "target": _np(targets).astype(np.int64),
            "embedding": outputs.detach().float().cpu().numpy()}


def build_table(parts: list[dict[str, Any]], schema):
    """The pyarrow Table of a rank's batches (columns as the module docstring says) in ``schema``; an empty
    table of that schema without batches. Raises ValueError when a batch lacks a column of the schema."""
    import pyarrow as pa

    if not parts:
        return schema.empty_table()
    missing = [f.name for f in schema if f.name not in parts[0]]
    if missing:
        raise ValueError(f"the batches lack the columns {missing} of the store's schema")
    return pa.Table.from_arrays([_column([p[f.name] for p in parts], f.type) for f in schema], schema=schema)


def _column(values: list, typ):
    import pyarrow as pa

    if pa.types.is_list(typ):  # per-sample arrays of varying length
        rows = [r for v in values for r in v]
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        inner = typ.value_type
        width = inner.list_size if pa.types.is_fixed_size_list(inner) else None
        flat = (np.concatenate(rows) if rows else np.zeros((0, width) if width else (0,)))
        return pa.ListArray.from_arrays(pa.array(offsets), _column([flat], inner))
    a = np.concatenate(values) if len(values) > 1 else np.asarray(values[0])
    if pa.types.is_fixed_size_list(typ):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), type=typ.value_type), typ.list_size)
    return pa.array(a, type=typ)


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def classification_schema(topk: int, logits: bool, num_classes: int):
    """sample_id int64, target int64, topk_ids fixed_size_list<int32, k>, topk_scores fixed_size_list<float32,
    k> (softmax probabilities), and with ``logits`` logits fixed_size_list<float32, C>; k = min(topk, C). The
    columns are ``prediction_store.classification_columns``'s."""
    import pyarrow as pa

    k = min(topk, num_classes)
    fields = [("sample_id", pa.int64()), ("target", pa.int64()), ("topk_ids", pa.list_(pa.int32(), k)),
              ("topk_scores", pa.list_(pa.float32(), k))]
    if logits:
        fields.append(("logits", pa.list_(pa.float32(), num_classes)))
    return pa.schema(fields)
