"""``data=webdataset``: the engine-facing streamed dataset. ``StreamSource`` has ``len() == N`` (the index's
sample count) like a map-style dataset, and builds each rank's ``ShardStream`` from the dp rank and size the
engine gives it (never from RANK/WORLD_SIZE). Sample ids are global positions in ``[0, N)`` (the coverage
check works on them as for map-style data); ``sample_name`` maps one to its ``(shard url, key)``.

Config keys: ``data.urls`` (brace pattern or list of paths/URLs), ``data.index`` (index JSON; None: the
driver builds one into the cache before ranks start), ``data.image_mode`` (``l8`` grey / ``rgb8``),
``data.target_field`` (``cls`` / ``txt``), ``data.on_decode_error`` (``raise`` / ``skip``), ``data.allow_pipe``.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from disteval.data.cache import cache_root
from disteval.data.index import ShardInfo, build_index, expand_urls, load_index, write_index
from disteval.data.stream_cache import CachedStream, attach_cache
from disteval.data.stream_plan import plan_rank, rank_bounds, shard_starts
from disteval.data.wds_stream import SampleFormat, ShardStream, read_range, sample_name
from disteval.errors import ConfigError, DataError

__all__ = ["StreamSource", "default_index_path", "ensure_index", "stream_source"]


class StreamSource:
    """A validated shard index plus the sample format: what every rank builds its stream from."""

    def __init__(self, shards: Sequence[ShardInfo], fmt: SampleFormat):
        self.shards, self.fmt = list(shards), fmt
        self.counts = [s.num_samples for s in self.shards]
        self.starts = shard_starts(self.counts)
        self.pixels: Any = None  # the pixel cache's reader when it is complete (disteval.data.stream_cache)
        self.cache_writer: Any = None  # (start, end) -> a part writer when this run builds the cache

    def __len__(self) -> int:
        return self.starts[-1]

    def bounds(self, world_size: int, rank: int, batch_size: int | None) -> tuple[int, int]:
        """``[start, end)`` positions of the rank (union of its workers' ranges)."""
        return rank_bounds(len(self), world_size, rank, batch_size)

    def stream(self, world_size: int, rank: int, num_workers: int, batch_size: int, aligned: bool,
               resume: int | list[tuple[int, int]] = 0) -> ShardStream:
        """The rank's IterableDataset (one plan per loader worker); ``resume``: the rank's samples already
        evaluated (a checkpoint's resume), or only these position spans, each a batch (a resume around
        recorded windows; ``stream_plan.plan_rank``)."""
        plans = plan_rank(self.counts, world_size, rank, num_workers, batch_size if aligned else None, resume)
        if self.pixels is not None:
            return CachedStream(self, plans, batch_size, self.pixels)
        fmt = replace(self.fmt, source_digests=True) if self.cache_writer is not None else self.fmt
        return ShardStream(self.shards, plans, batch_size, fmt)

    def host_tap(self, start: int, end: int) -> Any:
        """The pixel cache's writer of positions ``[start, end)`` when this run builds the cache, else None."""
        return self.cache_writer(start, end) if self.cache_writer is not None else None

    def sample_name(self, position: int) -> tuple[str, str]:
        """``(shard url, key)`` of a global position."""
        return sample_name(self.shards, self.starts, position)

    def first_sample_shape(self) -> tuple[int, ...] | None:
        """The input shape of the first sample (preflight), None when there is none."""
        s = next((i for i, c in enumerate(self.counts) if c), None)
        if s is None:
            return None
        from disteval.data.stream_plan import ShardRange

        stream = ShardStream(self.shards, [], 1, self.fmt)
        raw = next(iter(read_range(self.shards[s], ShardRange(s, 0, 1, self.starts[s]))))
        return tuple(stream._item(stream._decoder(), raw)[0].shape)


def default_index_path(urls: Sequence[str]) -> Path:
    """Where the driver writes an index for ``data.urls`` when ``data.index`` is unset: the disteval cache
    (``DISTEVAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/disteval`` or ``~/.cache/disteval``), named by a digest of
    the URL list."""
    digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]
    return cache_root() / f"wds-index-{digest}.json"


def _urls(data: Any) -> list[str]:
    if data.urls is None:
        raise ConfigError("data.urls", "data=webdataset needs data.urls (a brace pattern or a list of shards)")
    urls = data.urls if isinstance(data.urls, str) else [str(u) for u in data.urls]
    try:
        return expand_urls(urls, allow_pipe=bool(data.allow_pipe))
    except DataError as exc:
        raise ConfigError("data.urls", str(exc)) from exc


def require_samples(data: Any, shards: Sequence[ShardInfo], index: str) -> None:
    """ConfigError naming ``data.urls`` when the shards of the index hold no sample at all (empty tars, or
    members webdataset groups into no sample): such a run would evaluate nothing and report every metric null."""
    if any(s.num_samples for s in shards):
        return
    given = data.urls if isinstance(data.urls, str) else [str(u) for u in data.urls]
    listed = ", ".join(f"{s.url}: 0" for s in shards[:3]) + (", ..." if len(shards) > 3 else "")
    raise ConfigError("data.urls", f"the {len(shards)} shard{'s' if len(shards) != 1 else ''} of {given} hold no "
                      f"samples ({listed}; index {index}): nothing to evaluate; point data.urls at shards whose tar "
                      "members are named KEY.EXT, e.g. 000001.png and 000001.cls (webdataset groups a sample's "
                      "members by the name before the first dot and skips __*__ members)")


def ensure_index(data: Any, out=None) -> str:
    """Driver-side, before ranks start: ``data.index`` validated against the shards, or (unset) the cached
    index, validated, else built with progress on ``out`` (None: the current ``sys.stderr``) and written.
    Returns the index path. Raises ConfigError (``data.urls`` when the shards hold no sample) / DataError."""
    out = out or sys.stderr
    urls = _urls(data)
    if data.index is not None:
        require_samples(data, load_index(str(data.index), urls), str(data.index))
        return str(data.index)
    path, shards = default_index_path(urls), None
    if path.is_file():
        try:
            shards = load_index(str(path), urls)
        except DataError as exc:
            print(f"rebuilding the shard index: {exc}", file=out)
    if shards is None:
        print(f"indexing {len(urls)} shards into {path} (data.index unset)", file=out)
        shards = build_index(urls, lambda i, n, s: print(f"  [{i}/{n}] {s.url}: {s.num_samples} samples", file=out))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_index(shards, str(path))
    require_samples(data, shards, str(path))
    return str(path)


def stream_source(data: Any) -> StreamSource:
    """In a rank: the validated index (``data.index`` or the driver's cached one) and the sample format, with
    the pixel cache attached when ``data.cache`` is set (``disteval.data.stream_cache.attach_cache``).
    Raises ConfigError / DataError (a stale or missing index names the shard and how to rebuild)."""
    source = plain_source(data)
    if str(getattr(data, "cache", "none")) != "none":
        attach_cache(source, data)
    return source


def plain_source(data: Any) -> StreamSource:
    """``stream_source`` without the pixel cache."""
    urls = _urls(data)
    path = str(data.index) if data.index is not None else str(default_index_path(urls))
    if data.index is None and not Path(path).is_file():
        raise DataError(f"no shard index for data.urls at {path}: the driver builds it (python -m disteval) or "
                        f"set data.index (python -m disteval.data.index ... -o index.json)")
    shards = load_index(path, urls)
    require_samples(data, shards, path)
    fmt = SampleFormat(image_mode=str(data.image_mode), target_field=str(data.target_field),
                       on_decode_error=str(data.on_decode_error))
    return StreamSource(shards, fmt)
