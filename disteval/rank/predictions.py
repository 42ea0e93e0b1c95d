"""Writing a run's prediction store (``eval.save_predictions=true`` on classification data; the format is
``disteval.data.prediction_store``'s): each rank collects its batches' predictions in a loop hook and writes
``predictions/rank{r}.parquet`` atomically after its loop (a temporary file in the same folder, then a rename);
rank 0 writes ``predictions/_manifest.json`` after the synchronisation, from every rank's file entry (rows,
sha256) carried in the synchronised rows, with the model's and the data's identity.

With the journal on (``eval.journal``), the hook is also a source of the evaluator's windows
(``Evaluator.sources``): each window carries its batches' rows as Parquet bytes, and a resumed run adds them back
in sample-id order, so the store of a resumed run holds the rows an uninterrupted run writes."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from disteval.data.prediction_columns import build_table
from disteval.data.prediction_store import (MANIFEST, SCHEMA_VERSION, file_sha256, preprocessing_digest,
                                            preprocessing_values)
from disteval.rank import model_set
from disteval.rank.loop import LoopHook
from disteval.metrics.bootstrap import SampleColumns, per_sample
from disteval.job.records import atomic_write_json

STORE_DIR = "predictions"


class PredictionHook(LoopHook):
    """One rank's predictions: ``after_outputs`` turns each batch into columns with the task's ``columns``
    (``Task.prediction_columns``), ``after_loop`` writes them in ``schema`` (``Task.prediction_schema``) as one
    Parquet file and keeps its manifest entry in ``entry`` {rank, path, rows, sha256, seconds, import_seconds}.
    ``parts``: per batch its columns, or a pyarrow Table of several batches (a window's rows, see ``since``)."""

    def __init__(self, run_dir: str, rank: int, schema: Any, columns: Callable[[Any, Any, torch.Tensor], dict]):
        self.path = Path(run_dir) / STORE_DIR / f"rank{rank}.parquet"
        self.rank, self.schema, self.columns = rank, schema, columns
        self.parts: list = []
        self.entry: dict | None = None
        self.seconds = 0.0  # spent converting batches and writing the file (the store's own cost)
        t0 = time.perf_counter()
        import pyarrow.parquet  # noqa: F401 - once, before the loop (about 35 ms), reported apart from the work
        self.import_seconds = time.perf_counter() - t0

    def after_outputs(self, outputs: Any, targets: Any, ids: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.parts.append(self.columns(outputs, targets, ids))
        self.seconds += time.perf_counter() - t0

    def _table(self, parts: list) -> Any:
        """One Table of ``parts`` in order (runs of batch columns built with ``build_table``)."""
        import pyarrow as pa

        tables, run = [], []
        for part in parts:
            if isinstance(part, dict):
                run.append(part)
                continue
            if run:
                tables.append(build_table(run, self.schema))
                run = []
            tables.append(part)
        if run or not tables:
            tables.append(build_table(run, self.schema))
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    # a source of ``Evaluator.sources``: the store's rows of a journal window (disteval.rank.journal)
    def mark(self) -> int:
        """Where the rows stand (the number of parts)."""
        return len(self.parts)

    def since(self, mark: int) -> torch.Tensor:
        """The rows added after ``mark`` as a Parquet file's bytes, uint8 [bytes]; those parts are replaced
        by their Table (built once: ``after_loop`` reuses it)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        t0 = time.perf_counter()
        table = self._table(self.parts[mark:])
        self.parts[mark:] = [table]
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = torch.frombuffer(bytearray(sink.getvalue().to_pybytes()), dtype=torch.uint8)
        self.seconds += time.perf_counter() - t0
        return data

    def add(self, rows: torch.Tensor) -> None:
        """Append a window's recorded rows (``since``'s bytes) after the rows so far. Raises ValueError when
        they are not rows of this store's schema (a window of another store)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(rows.numpy().tobytes()))
        if not table.schema.equals(self.schema):
            raise ValueError(f"recorded prediction rows of another schema: {table.schema} (want {self.schema})")
        self.parts.append(table)

    def after_loop(self, progress: Any) -> None:
        import pyarrow.parquet as pq

        t0 = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        table = self._table(self.parts)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self.parts = []
        self.seconds += time.perf_counter() - t0
        self.entry = {"rank": self.rank, "path": self.path.name, "rows": table.num_rows,
                      "sha256": file_sha256(self.path), "seconds": self.seconds, "import_seconds": self.import_seconds}


class SampleStatsHook(LoopHook):
    """Per-sample statistics of this rank's samples for the bootstrap intervals (``eval.ci``):
    ``disteval.metrics.bootstrap.per_sample`` rows per batch; ``rows()`` all of them, float64 [n, cols.width]."""

    def __init__(self, cols: SampleColumns):
        self.cols, self.parts = cols, []

    def after_outputs(self, outputs: Any, targets: Any, ids: torch.Tensor) -> None:
        self.parts.append(per_sample(outputs, targets, ids, self.cols))

    def rows(self) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(self.parts) if self.parts else np.zeros((0, self.cols.width)))

    # a source of ``Evaluator.sources``: the rows of a journal window (disteval.rank.journal)
    def mark(self) -> int:
        """Where the rows stand (the number of batch parts)."""
        return len(self.parts)

    def since(self, mark: int) -> torch.Tensor:
        """The rows added after ``mark``, float64 [n, cols.width]."""
        parts = self.parts[mark:]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0, self.cols.width)))

    def add(self, rows: torch.Tensor) -> None:
        """Append recorded rows (a window's) after the rows so far."""
        self.parts.append(rows.numpy())


def weights_digest(model: torch.nn.Module | None) -> str | None:
    """sha256 over the model's state dict (names, dtypes, shapes and bytes, in order): the model's identity."""
    if model is None:
        return None
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def write_manifest(run_dir: str, cfg: Any, identity: dict, entries: list[dict]) -> Path:
    """RUN_DIR/predictions/_manifest.json (atomic): ``identity`` {task, num_samples, num_classes, weights_digest,
    columns (the schema's fields as ``name: type``)}
    from the run, the model and data settings from ``cfg``, ``entries`` the ranks' files in rank order."""
    model, data = cfg.model, cfg.data
    manifest = {
        "schema_version": SCHEMA_VERSION, "task": identity["task"],
        "model": {"name": model.name, "weights": model.weights, "checkpoint": model.checkpoint,
                  "weights_digest": identity["weights_digest"]},
        "data": {"name": data.name, "split": data.split, "num_samples": identity["num_samples"],
                 "preprocessing_digest": preprocessing_digest(data), "preprocessing": preprocessing_values(data),
                 **_annotations(data)},
        "settings": {**({"iou_type": str(cfg.eval.detection.iou_type)} if data.annotations else {}),
                     "topk": int(cfg.eval.predictions.topk), "logits": bool(cfg.eval.predictions.logits),
                     "batch_size": int(data.batch_size), "mode": str(cfg.eval.mode),
                     "model_dtype": str(cfg.precision.model_dtype), "num_classes": identity["num_classes"],
                     "metrics": [str(m) for m in cfg.eval.metrics],
                     "eval_topk": [int(k) for k in cfg.eval.classification.topk]},
        "columns": identity.get("columns"), "files": sorted(entries, key=lambda e: e["rank"]),
    }
    path = Path(run_dir) / STORE_DIR / MANIFEST
    atomic_write_json(path, manifest)
    return path


def _annotations(data: Any) -> dict:
    """{annotations, annotations_sha256} of a task whose ground truth is an annotation file (COCO), else {}:
    re-scoring checks that it scores against the same file."""
    path = data.annotations
    return {"annotations": str(Path(path).resolve()), "annotations_sha256": file_sha256(Path(path))} if path else {}


def store_record(run_dir: str | Path, cfg: Any, identity: dict, entries: list[dict]) -> dict:
    """Write the store's manifest (``write_manifest``) and return results.json ``predictions``: {manifest (path
    relative to ``run_dir``), rows, seconds (the slowest rank's own store time), import_seconds}."""
    path = write_manifest(str(run_dir), cfg, identity, entries)
    return {"manifest": str(path.relative_to(run_dir)), "rows": sum(int(e["rows"]) for e in entries),
            "seconds": max(float(e["seconds"]) for e in entries),
            "import_seconds": max(float(e["import_seconds"]) for e in entries)}


def store_hook(ctx: Any, task: Any, members: list) -> Any:
    """The prediction store's loop hook of a rank (``ctx``: its RankContext) for ``eval.save_predictions=true``
    and a task with a store schema (``Task.prediction_schema``): a ``PredictionHook``, or one per checkpoint of a
    ``model.checkpoints`` job (``members``) under ``checkpoints/<name>/``; None otherwise."""
    schema = task.prediction_schema() if ctx.cfg.eval.save_predictions else None
    if schema is None:
        return None
    if members:
        return model_set.MemberHooks({m.name: PredictionHook(str(model_set.member_dir(ctx.run_dir, m)), ctx.rank,
                                                             schema, task.prediction_columns) for m in members})
    return PredictionHook(ctx.run_dir, ctx.rank, schema, task.prediction_columns)


def store_sources(store: Any) -> dict:
    """The prediction store's keepers whose rows the journal's windows carry (``Evaluator.sources``): {"predictions":
    hook}, or {"predictions:<checkpoint>": hook} per checkpoint of a set; {} without a store (``store`` None)."""
    if store is None:
        return {}
    if isinstance(store, model_set.MemberHooks):
        return {f"predictions:{n}": h for n, h in store.hooks.items()}
    return {"predictions": store}
