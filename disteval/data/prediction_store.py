"""A run's prediction store (``eval.save_predictions=true``, classification): one Parquet file per rank with its
samples' predictions keyed by global sample id, and a manifest saying what produced them. Read and written with
pyarrow; readable by pandas, polars or DuckDB (docs/predictions.md).

Layout under the run directory::

    predictions/rank{r}.parquet   sample_id int64, target int64, topk_ids list<int32>[k], topk_scores
                                  list<float32>[k] (softmax probabilities), logits list<float32>[C] (with
                                  eval.predictions.logits=true: what re-scoring needs)
    predictions/_manifest.json     schema_version, task, model {name, weights, checkpoint, weights_digest},
                                  data {name, split, num_samples, preprocessing_digest}, settings {topk, logits,
                                  batch_size, mode, model_dtype, num_classes}, files [{rank, path, rows, sha256}]

``load_store`` serves a store back as a dataset of ``(logits, target, sample_id)``: re-scoring runs the same
metrics over the stored outputs, with the run's batch size, so bitwise mode gives the writer's bits.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disteval.common.plain import plain
from disteval.errors import ConfigError, DataError

SCHEMA_VERSION = 1
MANIFEST = "_manifest.json"
# the data settings that decide what the model saw (root and loader settings excluded: the same images elsewhere)
PREPROCESSING_KEYS = ("name", "split", "limit", "resize_size", "crop_size", "mean", "std", "decode_on_device", "decode")


def classification_columns(outputs: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor, topk: int,
                           logits: bool) -> dict[str, np.ndarray]:
    """One batch's columns as numpy arrays: ``outputs`` float32 logits [B, C], ``targets`` int64 [B], ``ids``
    int64 [B] -> sample_id, target, the top-``topk`` class ids (int32 [B, k]) and softmax probabilities (float32
    [B, k]), and the logits themselves (float32 [B, C]) with ``logits``."""
    out = outputs.detach().float().cpu()
    k = min(topk, out.shape[1])
    scores, classes = torch.softmax(out, dim=1).topk(k, dim=1)
    cols = {"sample_id": ids.cpu().numpy().astype(np.int64), "target": torch.as_tensor(targets).cpu().numpy().astype(np.int64),
            "topk_ids": classes.numpy().astype(np.int32), "topk_scores": scores.numpy()}
    if logits:
        cols["logits"] = out.numpy()
    return cols


def preprocessing_values(data_cfg: Any) -> dict:
    """The data settings in ``PREPROCESSING_KEYS`` as plain values (the manifest keeps them, so that a refusal
    names the setting that differs)."""
    return json.loads(json.dumps({k: plain(getattr(data_cfg, k)) for k in PREPROCESSING_KEYS}, default=str))


def preprocessing_digest(data_cfg: Any) -> str:
    """sha256 of the data settings in ``PREPROCESSING_KEYS`` (canonical JSON): equal for the same images
    prepared the same way, wherever their root is."""
    values = preprocessing_values(data_cfg)
    return "sha256:" + hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()



def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def read_manifest(store: str | Path) -> dict:
    """The store's manifest. Raises DataError naming the file when it is missing, unreadable or of another
    schema version."""
    path = Path(store) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no prediction store manifest here (a run with eval.save_predictions=true writes "
                        "RUN_DIR/predictions/_manifest.json)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable manifest: {exc}") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DataError(f"{path}: schema_version {manifest.get('schema_version')!r}, this disteval reads "
                        f"{SCHEMA_VERSION}")
    return manifest


def check_identity(manifest: dict, data_cfg: Any, store: str | Path) -> None:
    """Raise ConfigError naming each difference between the store's data identity and the requested data
    (``data_cfg``: name, split, preprocessing): re-scoring predictions of other images is refused."""
    want = {"name": data_cfg.name, "split": data_cfg.split,
            "preprocessing_digest": preprocessing_digest(data_cfg)}
    have = manifest.get("data") or {}
    diffs = [f"{k}: the store has {have.get(k)!r}, the job asks for {v!r}" for k, v in want.items() if have.get(k) != v]
    if "preprocessing" in have and any(d.startswith("preprocessing_digest") for d in diffs):  # name the settings
        asked = preprocessing_values(data_cfg)
        diffs = [d for d in diffs if not d.startswith("preprocessing_digest")] + [
            f"data.{k}: the store has {have['preprocessing'].get(k)!r}, the job asks for {asked.get(k)!r}"
            for k in PREPROCESSING_KEYS if have["preprocessing"].get(k) != asked.get(k) and k not in ("name", "split")]
    if diffs:
        raise ConfigError("data", f"the prediction store {store} was written for other data: " + "; ".join(diffs)
                          + " (re-score with the data settings of the run that wrote it)")


def read_tables(store: str | Path, manifest: dict, columns: list[str]) -> tuple[list, np.ndarray]:
    """(every rank file's pyarrow Table of ``columns``, the permutation that orders their rows by sample id).
    Each file is checked against its manifest entry (present, sha256, row count) and the ids must be exactly
    0..N-1 once. Raises DataError naming the file or the sample ids."""
    import pyarrow.parquet as pq

    store, tables = Path(store), []
    for entry in manifest["files"]:
        path = store / entry["path"]
        if not path.is_file():
            raise DataError(f"{path}: rank {entry['rank']}'s prediction file is missing")
        if file_sha256(path) != entry["sha256"]:
            raise DataError(f"{path}: rank {entry['rank']}'s prediction file does not match its manifest entry "
                            "(sha256 differs: corrupt or replaced)")
        try:
            table = pq.read_table(path, columns=columns)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"{path}: unreadable Parquet file: {exc}") from None
        if table.num_rows != entry["rows"]:
            raise DataError(f"{path}: {table.num_rows} rows, the manifest says {entry['rows']}")
        tables.append(table)
    ids = np.concatenate([t.column("sample_id").to_numpy() for t in tables]) if tables else np.zeros(0, np.int64)
    n = int(manifest["data"]["num_samples"])
    order = np.argsort(ids, kind="stable")
    if len(ids) != n or not np.array_equal(ids[order], np.arange(n)):
        missing = np.setdiff1d(np.arange(n), ids)[:8].tolist()
        raise DataError(f"{store}: the rank files hold {len(ids)} predictions for {n} samples (missing ids "
                        f"{missing}, or duplicates)")
    return tables, order


def load_store(store: str | Path) -> tuple[Any, dict]:
    """(dataset, manifest): the stored predictions as an ``IndexedDataset`` of ``(logits float32 [C], target
    int64, sample_id)`` in sample-id order 0..N-1 (batches are cut straight out of the tensors), and the
    manifest. Raises DataError naming a missing, corrupt or short rank file or missing sample ids
    (``read_tables``), or a store without logits."""
    from torch.utils.data import TensorDataset

    from disteval.data.datasets import IndexedDataset

    store = Path(store)
    manifest = read_manifest(store)
    if not manifest["settings"].get("logits"):
        raise DataError(f"{store / MANIFEST}: the store holds top-{manifest['settings']['topk']} classes only; "
                        "re-scoring needs the logits (write it with eval.predictions.logits=true)")
    tables, order = read_tables(store, manifest, ["sample_id", "target", "logits"])
    c = int(manifest["settings"]["num_classes"])
    logits = np.concatenate([t.column("logits").combine_chunks().flatten().to_numpy() for t in tables])
    targets = np.concatenate([t.column("target").to_numpy() for t in tables])
    base = TensorDataset(torch.from_numpy(np.ascontiguousarray(logits.reshape(-1, c)[order], dtype=np.float32)),
                         torch.from_numpy(np.ascontiguousarray(targets[order], dtype=np.int64)))
    return IndexedDataset(base, None), manifest


class StoredDetections:
    """A detection store (``prediction_columns.detection_schema``) as the replay's dataset: item i is ``(dict
    bbox float64 [n, 4] xywh, scores float64 [n], labels int64 [n], area float64 [n]; image index i; sample id
    i)``, exactly what the writer's metric evaluated. Raises DataError as ``read_tables``, or when the store
    is not of detections."""

    def __init__(self, store: str | Path):
        manifest = read_manifest(store)
        if manifest.get("task") not in ("detection", "replay"):
            raise DataError(f"{Path(store) / MANIFEST}: a {manifest.get('task')} store, not detections")
        tables, order = read_tables(store, manifest, ["sample_id", "bbox", "scores", "labels", "area"])
        rows = [r for t in tables for r in t.to_pylist()]
        self.rows = [rows[i] for i in order]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        r = self.rows[index]
        out = {"bbox": np.asarray(r["bbox"], dtype=np.float64).reshape(-1, 4),
               "scores": np.asarray(r["scores"], dtype=np.float64), "labels": np.asarray(r["labels"], dtype=np.int64),
               "area": np.asarray(r["area"], dtype=np.float64)}
        return out, index, index


def check_detection_store(store: str | Path, annotations: str, iou_type: str) -> None:
    """A detection store re-scored against ``annotations``: it must hold detections of boxes (``iou_type``
    bbox: a store keeps no masks) and have been written against the same annotation file (sha256). Raises
    ConfigError naming the key, DataError naming the manifest."""
    manifest = read_manifest(store)
    if manifest.get("task") not in ("detection", "replay"):
        raise DataError(f"{Path(store) / MANIFEST}: a {manifest.get('task')} store, not detections")
    if str(iou_type) != "bbox" or manifest["settings"].get("iou_type") != "bbox":
        raise ConfigError("eval.detection.iou_type", "a prediction store keeps boxes, not masks: re-score segm "
                          "results from the run's COCO results files (ranks/rank*/predictions.json)")
    have = manifest["data"].get("annotations_sha256")
    if have != file_sha256(Path(annotations)):
        raise ConfigError("data.annotations", f"{annotations} is not the annotation file the store was scored "
                          f"against ({manifest['data'].get('annotations')}, {have})")
