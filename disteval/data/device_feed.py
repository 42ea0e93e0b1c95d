"""The loader's batches on the model's device: ``DeviceFeed`` copies the next batch's inputs (and tensor
targets) on a CUDA side stream while the current batch computes; sample ids stay on the host. Used by the
per-rank loop (``disteval.rank.loop``)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from disteval.data.wds_stream import StreamBatch


class DeviceFeed:
    """The loader's batches with their inputs (and tensor targets) already on ``device``: on CUDA the next
    batch is copied on a side stream (``non_blocking`` from the pinned host batch) while the current one
    computes, and the compute stream waits for that copy only (no host synchronisation); elsewhere the
    batches pass through unchanged (the task's step moves them). Sample ids stay on the host: coverage and
    progress count them there. Batches are ``(inputs, targets, ids)`` tuples or ``StreamBatch``es."""

    def __init__(self, loader: Iterable, device: torch.device, tap: Callable[[Any], None] | None = None):
        self.loader, self.device, self.tap = loader, torch.device(device), tap
        self.batches: Iterator | None = None  # the loader's iterator of the pass in progress (its workers)
        # CUDA: a (start, end) event pair around each batch's copy on the side stream, read after the loop
        # (disteval.rank.loop.StageTimer: results.json per_rank[].pipeline.host_to_device)
        self.copies: list = []

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        self.batches = iter(self.loader)
        # the tap sees each host batch before it moves (a pixel cache being built)
        source = _tapped(self.batches, self.tap) if self.tap is not None else self.batches
        if self.device.type != "cuda":
            yield from source
            return
        side = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        ahead = None
        for batch in source:
            side.wait_stream(compute)  # buffers the compute stream freed may be reused by the copy
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record(side)
                moved = _batch_to(batch, self.device)
                end.record(side)
            self.copies.append((start, end))
            if ahead is not None:
                yield ahead
            compute.wait_stream(side)
            _record(moved, compute)
            ahead = moved
        if ahead is not None:
            yield ahead


class _tapped:
    """An iterator of ``batches`` that calls ``tap(batch)`` on each."""

    def __init__(self, batches: Iterator, tap: Callable[[Any], None]):
        self._it, self._tap = batches, tap

    def __iter__(self) -> "_tapped":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._tap(batch)
        return batch


def _batch_to(batch: Any, device: torch.device) -> Any:
    """Inputs and tensor targets of a loader batch copied to ``device`` (non-blocking); sample ids kept."""
    if isinstance(batch, StreamBatch):
        targets = batch.targets.to(device, non_blocking=True) if isinstance(batch.targets, torch.Tensor) else batch.targets
        return batch._replace(inputs=_tree_to(batch.inputs, device), targets=targets)
    inputs, targets, ids = batch
    if isinstance(targets, torch.Tensor):
        targets = targets.to(device, non_blocking=True)
    return _tree_to(inputs, device), targets, ids


def _tree_to(obj: Any, device: torch.device) -> Any:
    """Tensors in nested lists/tuples/dicts copied to ``device`` (non-blocking); an object that says
    ``stays_on_host`` (encoded images that the step decodes on the device) is left as it is."""
    if getattr(obj, "stays_on_host", False):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(_tree_to(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _tree_to(v, device) for k, v in obj.items()}
    return obj


def _record(obj: Any, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses the tensors of ``obj`` (made on another stream)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _record(o, stream)
    elif isinstance(obj, dict):
        for o in obj.values():
            _record(o, stream)
