"""Which pixels a run reads, and the driver's part in the pixel cache (``data.cache``): for imagefolder data the
files (``PixelFolder``, building the cache as it goes) or the cache (``CachedPixels``); for streamed tar shards see
``disteval.data.stream_cache``. Driver-side, before any rank starts: ``preflight_cache`` (what the run will do
with the cache, a cache of other data refused, changed files' bytes compared) and ``driver_build_lock`` (one job
builds a cache at a time: ``build_lock``)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from typing import Any, Callable, Iterator

from disteval.data.pixel_cache import CachedPixels, PartWriter, PixelCache, builder, folder_cache
from disteval.data.pixels import PixelFolder
from disteval.data.stream_cache import stream_cache
from disteval.data.streaming import plain_source
from disteval.errors import ConfigError

CACHED_DATA = ("imagefolder", "webdataset")


def pixel_dataset(data: Any) -> Any:
    """The uint8 pixel dataset of imagefolder ``data``: ``CachedPixels`` when ``data.cache=pixels`` and the
    cache covers the samples, else a ``PixelFolder`` (decoding the files) which, with ``data.cache`` set,
    builds the cache as it goes (``PixelFolder.host_tap`` -> ``PartWriter``). Raises ConfigError (bad keys,
    a cache of other data) or DataError (a damaged part)."""
    folder = PixelFolder(data.root, data.resize_size, data.crop_size, str(data.decode))
    mode = str(data.cache)
    if mode == "none":
        return folder
    cache = folder_cache(data, folder.samples, folder.classes)
    n = len(folder) if data.limit is None else min(len(folder), int(data.limit))
    if cache.complete(n):
        cache.check_contents(n)  # the files whose mtime changed (the driver's preflight already compared them)
        return CachedPixels(cache, n)
    cache.ensure_manifest()

    def writer(dataset: Any, start: int, end: int) -> PartWriter | None:
        if start >= end or (cache.parts_dir / f"{start}-{end}.json").exists() or cache.complete(n):
            return None
        w = PartWriter(cache, start, end, builder())
        w.source_digests = dataset.source_digests
        return w

    folder.cache_writer = writer
    return folder


def cache_of(data: Any) -> tuple[PixelCache, int]:
    """The cache of ``data`` (imagefolder or webdataset; the shard index exists: the driver made it) and the
    number of samples it must cover."""
    if data.name == "webdataset":
        source = plain_source(data)
        return stream_cache(data, source), len(source)
    folder = PixelFolder(data.root, data.resize_size, data.crop_size, str(data.decode))
    n = len(folder) if data.limit is None else min(len(folder), int(data.limit))
    return folder_cache(data, folder.samples, folder.classes), n


def preflight_cache(data: Any) -> str | None:
    """Driver-side, before any rank starts, with ``data.cache`` set: a line saying what the run will do with
    the cache (read it, or build it), None without a cache. Raises ConfigError naming data.cache when the
    folder holds a cache of other data or another transform (``data.cache=rebuild`` discards it instead, under
    the build lock), or when a file's bytes differ from those the cache was built from (``check_contents``)."""
    if str(data.cache) == "none" or data.name not in CACHED_DATA:
        return None
    cache, n = cache_of(data)
    what = "images" if data.name == "imagefolder" else "samples of the shards"
    if str(data.cache) == "rebuild":
        return f"data.cache=rebuild: the pixel cache {cache.folder} is discarded and built again by this run"
    cache.ensure_manifest()
    if cache.complete(n):
        read = cache.check_contents(n, everything=str(data.cache_verify) == "content")
        checked = f" ({read} files' bytes compared with the digests recorded at build)" if read else ""
        return f"data.cache=pixels: reading the pixels of {n} {what} from {cache.folder}{checked}"
    aside = f" (damaged parts set aside, built again: {'; '.join(cache.damaged)})" if cache.damaged else ""
    return (f"data.cache=pixels: this run decodes the {n} {what} and builds the pixel cache {cache.folder} "
            f"as it goes{aside}; later runs of the same data and transform read it")


@contextlib.contextmanager
def driver_build_lock(data: Any, say: Callable[[str], None]) -> Iterator[None]:
    """Around the driver's launch: with ``data.cache`` set and the cache incomplete (or ``rebuild``), hold its
    ``build_lock`` for the run (waiting for another job that builds it); ``rebuild`` clears the old parts once the
    lock is held. A no-op otherwise."""
    mode = str(data.cache)
    if mode == "none" or data.name not in CACHED_DATA:
        yield
        return
    cache, n = cache_of(data)
    if mode == "pixels" and cache.complete(n):
        yield
        return
    with build_lock(cache, say):
        if mode == "rebuild":
            cache.clear()
            cache.ensure_manifest()
        yield


@contextlib.contextmanager
def build_lock(cache: PixelCache, say: Callable[[str], None], wait_s: float = 24 * 3600.0) -> Iterator[bool]:
    """The driver's exclusive right to build ``cache`` for the length of its run: ``flock`` on build.lock (the
    kernel drops it when the process ends, however it ends). Another job's driver that finds it held says whose
    it is and waits (up to ``wait_s``) before its ranks start, then finds the cache complete and reads it: two
    jobs never both build. Yields True when this driver holds the lock."""
    cache.folder.mkdir(parents=True, exist_ok=True)
    path = cache.folder / "build.lock"
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "another job"
            say(f"pixel cache {cache.folder} is being built by {owner}: waiting for it")
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ConfigError("data.cache", f"the pixel cache {cache.folder} was still being built by "
                                          f"{owner} after {wait_s:.0f} s") from None
                    time.sleep(0.5)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        yield True
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
