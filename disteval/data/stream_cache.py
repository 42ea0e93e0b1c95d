"""The exact pixel cache of streamed tar shards (``data=webdataset``, ``data.cache=pixels``), keyed by sample.

A shard's image is decoded by webdataset's image handler (``data.image_mode`` ``l8`` / ``rgb8``: uint8) and
becomes ``x / 255`` in float32; that is deterministic, so the uint8 image can be stored once (``PixelCache``'s
parts: ``uint8 [b - a, C, H, W]`` of global positions a .. b-1) and read back as the same floats bit for bit
(``x.to(float32) / 255`` is the same correctly rounded IEEE division). Each part's record also holds the
targets and the positions skipped by ``on_decode_error=skip`` (a reading run with ``raise`` names such a sample
as the streamed run would). The manifest lists the shards (url, samples, size, digest of their keys) and each
shard's mtime; ``check_contents`` reads a shard whose mtime changed and compares each sample's image and target
bytes (``wds_stream.source_bytes``, skipped samples included) with the
digests recorded at build.

Every sample must have the shape of the first sample (the shards of a classification stream do: a batch
stacks them); a build that meets another shape or float inputs that are not ``uint8 / 255`` stops building
(said on the rank's log) and the run goes on streaming."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from disteval.data.index import local_path
from disteval.data.pixel_cache import FORMAT, CachedPixels, PartWriter, PixelCache, _digest, builder, cache_folder
from disteval.data.stream_plan import ConsumerPlan, ShardRange
from disteval.data.wds_stream import ShardStream, StreamBatch, read_range, sample_name, source_bytes
from disteval.errors import DataError

__all__ = ["CachedStream", "StreamPartWriter", "attach_cache", "stream_cache"]


def stream_settings(data: Any) -> dict:
    """What decides a stream's pixels and targets: the image mode, the target field and the libraries."""
    import PIL
    import webdataset

    return {"format": FORMAT, "source": "webdataset", "image_mode": str(data.image_mode),
            "target_field": str(data.target_field), "dtype": "uint8", "layout": "NCHW",
            "libraries": {"webdataset": getattr(webdataset, "__version__", "?"), "pillow": PIL.__version__}}


def stream_cache(data: Any, source: Any) -> PixelCache:
    """The PixelCache of the shards of ``source`` (a ``StreamSource`` without a cache). The sample shape comes
    from the manifest when the cache exists, else from the first sample (one read)."""
    settings = stream_settings(data)
    urls = [s.url for s in source.shards]
    files = [[s.url, s.num_samples, s.size, hashlib.sha256("\n".join(s.keys).encode()).hexdigest()[:16]]
             for s in source.shards]
    first = local_path(urls[0]) if urls else None
    name = (Path(first).parent.name if first else "shards") or "shards"
    folder = cache_folder(data, name, {"urls": urls, "settings": settings})
    shape = None
    with_manifest = folder / "manifest.json"
    if with_manifest.exists():
        import json

        try:
            shape = json.loads(with_manifest.read_text()).get("shape")
        except (OSError, ValueError):
            shape = None
    if shape is None:
        shape = list(source.first_sample_shape() or ())
    manifest = {"settings": settings, "settings_digest": _digest(settings), "root": urls[0] if urls else "",
                "classes": [], "num_samples": len(source), "shape": shape, "dtype": "uint8", "unit": "shard",
                "files_digest": _digest(files), "files": files, "mtimes": [s.mtime_ns for s in source.shards]}

    def sample_bytes(i: int) -> Iterator[tuple[int, bytes]]:
        shard = source.shards[i]
        rng = ShardRange(i, 0, shard.num_samples, source.starts[i])
        for j, raw in enumerate(read_range(shard, rng)):
            yield rng.position + j, source_bytes(raw, str(data.target_field))

    return PixelCache(folder, manifest, sample_bytes)


class StreamPartWriter(PartWriter):
    """A rank's part of a stream's cache, fed by the loop's host tap with ``StreamBatch`` es: each batch's float
    inputs back to uint8 (``round(x * 255)``, checked to give ``x`` again: exact for ``uint8 / 255``), its targets,
    skipped positions and source digests. A batch that cannot be stored exactly stops the build (``broken``)."""

    def __init__(self, cache: PixelCache, start: int, end: int, who: dict):
        super().__init__(cache, start, end, who)
        n = end - start
        self.targets: list = [None] * n
        self.digests: list = [None] * n
        self.skipped: list[int] = []
        self.broken: str | None = None

    def __call__(self, batch: Any) -> None:
        if self.broken or not isinstance(batch, StreamBatch):
            return
        skipped_digests = batch.skipped_digests.tolist() if batch.skipped_digests is not None else None
        for j, p in enumerate(batch.skipped.tolist()):
            if self.start <= p < self.end:
                self.skipped.append(p)
                self.written[p - self.start] = True
                self.digests[p - self.start] = skipped_digests[j] if skipped_digests else None
        if batch.inputs is None:
            return
        x, ids = batch.inputs, batch.sample_ids
        first = f"sample {int(ids[0])}"
        if tuple(x.shape[1:]) != self.cache.shape:
            self.broken = f"{first} has shape {tuple(x.shape[1:])}, the cache {self.cache.shape}"
            return
        u = (x.to(torch.float32) * 255.0).round_().clamp_(0, 255).to(torch.uint8)
        if x.dtype != torch.float32 or not torch.equal(u.to(torch.float32) / 255.0, x):
            self.broken = f"the inputs of the batch of {first} are not uint8 pixels / 255"
            return
        self.write(u, ids)
        targets = batch.targets.tolist() if isinstance(batch.targets, torch.Tensor) else list(batch.targets)
        digests = batch.digests.tolist() if batch.digests is not None else [None] * len(targets)
        for p, y, d in zip(ids.tolist(), targets, digests):
            if self.start <= p < self.end:
                self.targets[p - self.start], self.digests[p - self.start] = y, d

    def publish(self) -> Any:
        if self.broken:
            print(f"pixel cache {self.cache.folder}: not built: {self.broken}", file=sys.stderr, flush=True)
            self.discard()
            return None
        return super().publish()

    def sources(self) -> list | None:
        return [None if d is None else format(int(d) + (1 << 63), "016x") for d in self.digests]

    def extra_meta(self) -> dict:
        return {"targets": self.targets, "skipped": sorted(self.skipped)}


class CachedStream(ShardStream):
    """A ``ShardStream`` whose samples come from the cache (``pixels``: CachedPixels over the parts): the same
    plans, batches, skipped positions and targets as streaming the shards, inputs ``uint8 / 255`` in float32."""

    def __init__(self, source: Any, plans: list[ConsumerPlan], batch_size: int, pixels: CachedPixels):
        super().__init__(source.shards, plans, batch_size, source.fmt)
        self.starts, self.pixels = source.starts, pixels
        self.targets: dict[int, Any] = {}
        self.skipped_at: set[int] = set()
        for part in pixels.parts:
            for j, y in enumerate(part.meta.get("targets") or []):
                self.targets[part.start + j] = y
            self.skipped_at.update(int(p) for p in part.meta.get("skipped") or [])

    def items(self, plan: ConsumerPlan) -> Iterator[tuple[int, tuple | None, None]]:
        for rng in plan.ranges:
            lo, hi = rng.position, rng.position + len(rng)
            for pos0, rows in self._chunks(lo, hi):
                floats = torch.from_numpy(np.array(rows)).to(torch.float32) / 255.0
                for j in range(len(rows)):
                    pos = pos0 + j
                    if pos in self.skipped_at:
                        if self.on_decode_error == "raise":
                            url, key = sample_name(self.shards, self.starts, pos)
                            raise DataError(f"shard {url}, key {key!r}: did not decode when the pixel cache "
                                            f"{self.pixels.cache.folder} was built (data.on_decode_error=skip then)")
                        yield pos, None, None
                        continue
                    yield pos, (floats[j], self.targets[pos], sample_name(self.shards, self.starts, pos)), None

    def _chunks(self, lo: int, hi: int, rows: int = 256) -> Iterator[tuple[int, np.ndarray]]:
        pos = lo
        for view in self.pixels._rows(lo, hi):
            for a in range(0, len(view), rows):
                yield pos + a, view[a:a + rows]
            pos += len(view)


def attach_cache(source: Any, data: Any) -> None:
    """With ``data.cache`` set: the cache complete -> ``source.pixels`` (its streams read the cache); else the
    rank builds its part as it streams (``source.cache_writer``). Raises ConfigError (a cache of other data,
    changed bytes) / DataError (a damaged part)."""
    cache, n = stream_cache(data, source), len(source)
    if str(data.cache) == "pixels" and cache.complete(n):
        cache.check_contents(n)
        source.pixels = CachedPixels(cache, n)
        return
    cache.ensure_manifest()

    def writer(start: int, end: int) -> StreamPartWriter | None:
        if start >= end or (cache.parts_dir / f"{start}-{end}.json").exists() or cache.complete(n):
            return None
        return StreamPartWriter(cache, start, end, builder())

    source.cache_writer = writer
