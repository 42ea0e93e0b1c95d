"""The exact decoded-pixel cache (``data.cache=pixels``): decode once, evaluate forever.

An imagefolder dataset's eval transform (decode, resize, center crop; ``disteval.data.pixels``) is deterministic,
so its uint8 output can be stored once and read at memory speed by every later run, sweep job, checkpoint set and
re-score of the same files and transform, bit for bit the pixels the JPEG path makes. Streamed tar shards use the
same parts, keyed by sample position (``disteval.data.stream_cache``); ``disteval.data.pixel_source`` decides which
pixels a run reads and holds the driver's build lock.

Layout, one folder per (dataset root, preprocessing) under ``data.cache_dir`` (default ``CACHE/pixels``)::

    <root name>-<key>/manifest.json           the preprocessing settings and their digest (``key``), the library
                                              versions that make the pixels, the file list (path, class, size)
                                              and each file's mtime (``check_contents``: a file whose mtime
                                              changed has its bytes compared with the parts' digests)
    <root name>-<key>/parts/<a>-<b>.npy       uint8 [b - a, 3, crop, crop] of samples a .. b-1 (numpy .npy,
                                              memory-mapped when read)
    <root name>-<key>/parts/<a>-<b>.json      the part's record: xxh3-128 of each block of BLOCK rows, xxh3-64
                                              of each source file's bytes, who built it; written last: a part
                                              without its record does not exist
    <root name>-<key>/build.lock              flock'd by the driver of the run that builds (``build_lock``)

The ranks of the first run that asks build it: each rank writes the pixels of its own shard as its loop passes
them (``PartWriter``, fed by the loop's host tap: no second decode) into a temporary file and publishes it with
``os.replace`` when the shard is complete. Parts of any world size combine: a reader covers [0, N) with whichever
parts exist (``cover``), so a cache built at W = 3 serves W = 1, 2, 8 alike. A reader checks each block's digest
the first time it touches it; a block that differs is named with both digests, its part moved aside
(``*.corrupt``, rebuilt by the next run) and the rank fails: damaged bytes are never read as pixels."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from disteval.data.cache import cache_root
from disteval.errors import ConfigError, DataError

FORMAT = 1
BLOCK = 256  # rows per digest block


def _xxh3_128(buf: Any) -> str:
    import xxhash

    return xxhash.xxh3_128(buf).hexdigest()


def library_versions(decode: str) -> dict:
    """The versions of what makes the pixels (a different Pillow may resize with other rounding)."""
    import PIL
    import torchvision

    out = {"pillow": PIL.__version__, "torchvision": torchvision.__version__.split("+")[0]}
    if decode == "turbo":
        import simplejpeg

        out["simplejpeg"] = simplejpeg.__version__
    return out


def settings_of(data: Any) -> dict:
    """The preprocessing that decides the pixels: decoder, resize, crop, dtype, layout and library versions."""
    decode = str(data.decode)
    return {"format": FORMAT, "decode": decode, "resize_size": int(data.resize_size), "crop_size": int(data.crop_size),
            "interpolation": "bilinear", "antialias": True, "dtype": "uint8", "layout": "NCHW",
            "libraries": library_versions(decode)}


def cache_folder(data: Any, name: str, identity: Any) -> Path:
    """``data.cache_dir`` (default ``CACHE/pixels``) / ``<name>-<digest of identity>``."""
    base = Path(data.cache_dir) if data.cache_dir else cache_root() / "pixels"
    return base / f"{name or 'root'}-{_digest(identity)[:16]}"


def folder_cache(data: Any, samples: list[tuple[str, int]], classes: list[str]) -> "PixelCache":
    """The PixelCache of imagefolder ``data`` (root, resize_size, crop_size, decode, cache_dir); ``samples``:
    ImageFolder's ``(path, class)`` list in dataset order."""
    root = str(Path(data.root).resolve())
    settings = settings_of(data)
    crop = settings["crop_size"]
    files, mtimes = file_list(samples, root)
    # mtimes are not part of files_digest: a copied tree (new mtimes, same bytes) is the same data, said by
    # the bytes' digests (check_contents), after which the manifest takes the new mtimes
    manifest = {"settings": settings, "settings_digest": _digest(settings), "root": root, "classes": classes,
                "num_samples": len(files), "shape": [3, crop, crop], "dtype": "uint8", "unit": "file",
                "files_digest": _digest(files), "files": files, "mtimes": mtimes}

    def source_bytes(i: int) -> Iterator[tuple[int, bytes]]:
        yield i, (Path(root) / files[i][0]).read_bytes()

    return PixelCache(cache_folder(data, Path(root).name, {"root": root, "settings": settings}), manifest,
                      source_bytes)


def file_list(samples: list[tuple[str, int]], root: str) -> tuple[list[list], list[int]]:
    """``([[path relative to root, class index, size in bytes], ...], [mtime in ns, ...])`` of ImageFolder
    ``samples`` (one ``stat`` each)."""
    base, files, mtimes = Path(root), [], []
    for p, c in samples:
        st = os.stat(p)
        files.append([str(Path(p).relative_to(base)), int(c), st.st_size])
        mtimes.append(st.st_mtime_ns)
    return files, mtimes


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Part:
    """A published part: samples ``[start, end)`` in ``npy`` with its record ``meta``."""

    start: int
    end: int
    npy: Path
    meta: dict


class PixelCache:
    """The cache of one dataset and preprocessing (see the module's text): ``folder`` and the ``manifest`` it must
    hold (settings and their digest, ``root``, ``classes``, ``num_samples``, ``shape`` [C, H, W] uint8, ``files``
    with ``files_digest``, ``mtimes``; ``unit``: ``file`` (one sample per file: imagefolder) or ``shard`` (a tar
    shard of many samples: ``disteval.data.stream_cache``)). Made by ``folder_cache`` or ``stream_cache``.
    ``source_bytes(i)``: the ``(sample position, bytes)`` pairs of file ``i`` whose digests the parts recorded
    (``check_contents``)."""

    def __init__(self, folder: Path, manifest: dict, source_bytes: Callable[[int], Iterator[tuple[int, bytes]]]):
        self.folder, self.manifest, self.source_bytes = folder, manifest, source_bytes
        self.shape = tuple(int(v) for v in manifest["shape"])
        self.damaged: list[str] = []  # parts set aside by ``parts`` (said by the driver's preflight line)

    @property
    def parts_dir(self) -> Path:
        return self.folder / "parts"

    # --- the manifest ---------------------------------------------------------------------------------------------
    def difference(self) -> str | None:
        """None when the folder's manifest (if any) describes this data and transform; else the first difference,
        named (a setting, a library version, a file added, removed or of another size)."""
        path = self.folder / "manifest.json"
        if not path.exists():
            return None
        try:
            have = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return f"{path} does not load ({type(exc).__name__}: {exc})"
        want = self.manifest
        for k, v in want["settings"].items():
            if have.get("settings", {}).get(k) != v:
                return f"preprocessing {k}: the cache has {have.get('settings', {}).get(k)!r}, this run {v!r}"
        if have.get("classes") != want["classes"]:
            old, new = list(have.get("classes") or []), list(want["classes"])
            gone, added = [c for c in old if c not in new], [c for c in new if c not in old]
            what = (f"{len(gone)} gone (first: {gone[:1]}), {len(added)} new (first: {added[:1]})" if gone or added
                    else "the same names in another order")
            return f"classes: the cache has {len(old)}, {want['root']} has {len(new)}: {what}"
        if have.get("files_digest") != want["files_digest"]:
            old = {f[0]: f for f in have.get("files", [])}
            new = {f[0]: f for f in want["files"]}
            added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
            if added or removed:
                return (f"files: {len(added)} added (first: {added[:1]}), {len(removed)} removed (first: {removed[:1]}) "
                        f"since the cache was built")
            changed = [p for p in new if old[p] != new[p]]
            if changed:
                p = changed[0]
                what = "class/size" if want.get("unit", "file") == "file" else "samples/size"
                return f"file {p}: {what} {old[p][1:]} in the cache, {new[p][1:]} now ({len(changed)} files differ)"
            return "the file list's order differs"
        return None

    def check_contents(self, n: int, everything: bool = False) -> int:
        """Compare the bytes of the files among samples [0, n) whose mtime differs from the manifest's (all of
        them with ``everything``: ``data.cache_verify=content``) with the xxh3-64 digests that the parts recorded
        of the bytes their pixels were decoded from; when all agree, the manifest takes the new mtimes (written
        atomically), so the next run reads no file. Returns the number of files read. Raises ConfigError naming
        data.cache and the first file whose bytes differ (same size, other content: a size change is refused by
        ``difference``). Parts without recorded digests are not checked."""
        path = self.folder / "manifest.json"
        parts = self.cover(n)
        if parts is None or not path.exists():
            return 0
        have = json.loads(path.read_text())
        old, new = have.get("mtimes") or [], self.manifest["mtimes"]
        m = min(n, len(new)) if self.manifest.get("unit", "file") == "file" else len(new)
        todo = [i for i in range(m) if everything or i >= len(old) or old[i] != new[i]]
        if not todo:
            return 0
        import xxhash

        sources: dict[int, str] = {}
        for p in parts:
            for j, h in enumerate(p.meta.get("sources") or []):
                sources[p.start + j] = h
        files, read = self.manifest["files"], 0
        for i in todo:
            for pos, data in self.source_bytes(i):
                want = sources.get(pos)
                if want is None:
                    continue
                got = xxhash.xxh3_64(data).hexdigest()
                if got != want:
                    raise ConfigError("data.cache", f"the pixel cache {self.folder} was built from other bytes of file "
                                      f"{files[i][0]} (sample {pos}): xxh3-64 {want} when it was built, {got} now "
                                      "(same size, changed content). Delete that folder or run with data.cache=rebuild")
            read += 1
        mtimes = list(old) + new[len(old):]
        mtimes[:m] = new[:m]  # only the files just compared (or unchanged) take their new mtime
        _write_atomic(path, json.dumps(dict(have, mtimes=mtimes)).encode())
        return read

    def ensure_manifest(self) -> None:
        """Write manifest.json (atomically) unless it exists. Raises ConfigError naming data.cache when an
        existing one describes other data or another transform (``difference``)."""
        problem = self.difference()
        if problem:
            raise ConfigError("data.cache", f"the pixel cache {self.folder} was built from other data or another "
                              f"transform: {problem}. Delete that folder or run with data.cache=rebuild")
        path = self.folder / "manifest.json"
        if not path.exists():
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, json.dumps(self.manifest).encode())

    def clear(self) -> None:
        """Remove the manifest and every part (``data.cache=rebuild``)."""
        if self.parts_dir.is_dir():
            for p in self.parts_dir.iterdir():
                p.unlink(missing_ok=True)
        (self.folder / "manifest.json").unlink(missing_ok=True)

    # --- parts ----------------------------------------------------------------------------------------------------
    def parts(self) -> list[Part]:
        """The published parts (a record and its .npy), in no particular order. A record that does not load, or
        whose .npy is gone, is moved aside (``*.corrupt``, named in ``damaged``) so that the range is built again."""
        out = []
        if not self.parts_dir.is_dir():
            return out
        for rec in self.parts_dir.glob("*.json"):
            npy = rec.with_suffix(".npy")
            try:
                meta = json.loads(rec.read_text())
                part = Part(int(meta["start"]), int(meta["end"]), npy, meta)
            except (ValueError, KeyError, TypeError) as exc:
                self._set_aside(rec, f"{rec} does not load ({type(exc).__name__}: {exc})")
                continue
            except OSError:  # removed meanwhile (another process set it aside)
                continue
            if not npy.exists():
                self._set_aside(rec, f"{npy} is missing (its record {rec.name} remains)")
                continue
            out.append(part)
        return out

    def _set_aside(self, rec: Path, why: str) -> None:
        for f in (rec, rec.with_suffix(".npy")):
            with contextlib.suppress(OSError):
                os.replace(f, f.with_name(f.name + ".corrupt"))
        if why not in self.damaged:
            self.damaged.append(why)

    def cover(self, n: int) -> list[Part] | None:
        """Parts that cover samples [0, n) end to end (at each position the part reaching furthest), or None
        while some range has no part."""
        parts, pos, out = self.parts(), 0, []
        while pos < n:
            best = max((p for p in parts if p.start <= pos < p.end), key=lambda p: p.end, default=None)
            if best is None:
                return None
            out.append(best)
            pos = best.end
        return out

    def complete(self, n: int) -> bool:
        """Whether the manifest matches and parts cover [0, n)."""
        return (self.folder / "manifest.json").exists() and self.difference() is None and self.cover(n) is not None


def _shared_mode(path: str | Path) -> None:
    """The mode a plain ``open`` would give (0666 less the umask), not mkstemp's 0600: a cache in a shared
    ``data.cache_dir`` is read by other users' jobs."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    _shared_mode(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class PartWriter:
    """Writes this rank's shard ``[start, end)`` of pixels into a temporary memory-mapped .npy in the cache's
    parts folder as batches pass (``write``), and publishes it (``publish``: block digests, record, two
    ``os.replace``) once every row was written. A pass that ends early (a failure, a resumed shard) publishes
    nothing and removes its temporary file (``discard``)."""

    def __init__(self, cache: PixelCache, start: int, end: int, who: dict):
        self.cache, self.start, self.end, self.who = cache, int(start), int(end), who
        cache.parts_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parts_dir, prefix=f".{start}-{end}.", suffix=".npy.tmp")
        os.close(fd)
        _shared_mode(tmp)
        self.tmp = Path(tmp)
        self.rows = np.lib.format.open_memmap(self.tmp, mode="w+", dtype=np.uint8,
                                              shape=(self.end - self.start, *cache.shape))
        self.written = np.zeros(self.end - self.start, dtype=bool)
        self.source_digests: torch.Tensor | None = None  # int64 [N] shared with the loader workers (PixelFolder)

    def write(self, pixels: torch.Tensor, ids: torch.Tensor) -> None:
        """Rows ``ids`` (global sample ids, int64 [B]) get ``pixels`` (uint8 [B, 3, crop, crop], host)."""
        if pixels.dtype != torch.uint8 or pixels.device.type != "cpu":
            return
        pos = ids.numpy() - self.start
        ok = (pos >= 0) & (pos < len(self.written))
        if not ok.all():
            pos, pixels = pos[ok], pixels[torch.from_numpy(ok)]
        lo = int(pos[0]) if len(pos) else 0
        if len(pos) and int(pos[-1]) - lo + 1 == len(pos):  # one ascending run: one slice assignment
            self.rows[lo:lo + len(pos)] = pixels.numpy()
        else:
            self.rows[pos] = pixels.numpy()
        self.written[pos] = True

    def __call__(self, batch: Any) -> None:
        """The loop's host tap: a loader batch ``(pixels, targets, ids)``."""
        self.write(batch[0], batch[2])

    def finish(self, ok: bool) -> None:
        """After the pass: publish when it ended normally with every row written, else discard."""
        if ok:
            self.publish()
        else:
            self.discard()

    def publish(self) -> Part | None:
        """Publish the part if every row was written; returns it (None otherwise, temporary file removed)."""
        if not self.written.all():
            self.discard()
            return None
        self.rows.flush()
        blocks = [_xxh3_128(np.ascontiguousarray(self.rows[i:i + BLOCK]).data)
                  for i in range(0, len(self.written), BLOCK)]
        del self.rows
        name = f"{self.start}-{self.end}"
        npy, rec = self.cache.parts_dir / f"{name}.npy", self.cache.parts_dir / f"{name}.json"
        meta = {"start": self.start, "end": self.end, "block_rows": BLOCK, "block_digests": blocks,
                "sources": self.sources(), "settings_digest": self.cache.manifest["settings_digest"],
                "files_digest": self.cache.manifest["files_digest"], "built": {**self.who, "time": time.time()},
                **self.extra_meta()}
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, npy)
        _write_atomic(rec, json.dumps(meta).encode())
        return Part(self.start, self.end, npy, meta)

    def sources(self) -> list[str] | None:
        """The xxh3-64 hex digests of the bytes rows [start, end) were decoded from (None: not recorded)."""
        if self.source_digests is None:
            return None
        return [format(int(v) + (1 << 63), "016x") for v in self.source_digests[self.start:self.end].tolist()]

    def extra_meta(self) -> dict:
        """More fields for the part's record (a stream's targets and skipped samples)."""
        return {}

    def discard(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.rows
        self.tmp.unlink(missing_ok=True)


class CachedPixels:
    """A cache's pixels as a dataset: items ``(uint8 [3, crop, crop], class index)`` read from the memory-mapped
    parts that ``cover`` [0, n); ``fetch_batch`` cuts whole batches (one copy per part touched). Each block's
    xxh3-128 is checked the first time this process touches it (``DataError`` naming the part, the rows and both
    digests, the part moved aside as ``*.corrupt`` so that the next run rebuilds it). ``samples``/``classes``/
    ``targets`` as ImageFolder's. Raises DataError when a part's .npy does not open as the recorded shape."""

    def __init__(self, cache: PixelCache, n: int):
        parts = cache.cover(n)
        if parts is None:
            raise DataError(f"the pixel cache {cache.folder} does not cover samples [0, {n})")
        self.cache, self.n = cache, n
        m = cache.manifest
        self.classes = m["classes"]
        if m.get("unit", "file") == "file":  # imagefolder: one file per sample (a stream's targets: stream_cache)
            self.samples = [(str(Path(m["root"]) / p), c) for p, c, _ in m["files"]]
            self.targets = torch.tensor([c for _, c, _ in m["files"]], dtype=torch.int64)
        self.parts = parts
        self.starts = np.array([p.start for p in parts])
        self._arrays: dict[int, np.ndarray] = {}
        self._checked: set[tuple[int, int]] = set()
        self._failed: dict[int, str] = {}  # part index -> why it was set aside (said again on every later read)

    def __len__(self) -> int:
        return self.n

    def _array(self, k: int) -> np.ndarray:
        if k in self._failed:
            raise DataError(self._failed[k])
        arr = self._arrays.get(k)
        if arr is None:
            p = self.parts[k]
            want = (p.end - p.start, *self.cache.shape)
            try:
                arr = np.load(p.npy, mmap_mode="r")
            except FileNotFoundError as exc:
                aside = p.npy.with_name(p.npy.name + ".corrupt").exists()
                self._fail(k, f"pixel cache part {p.npy} is gone" + (
                    ": another process of this run found it damaged and moved it aside (its error says how)"
                    if aside else f" ({exc}); the next run rebuilds it"))
            except (OSError, ValueError) as exc:
                size, need = p.npy.stat().st_size, int(np.prod(want))
                why = (f"is truncated: {size:,} bytes, its record's uint8 {want} needs more than {need:,}"
                       if size < need else f"does not open ({type(exc).__name__}: {exc})")
                self._fail(k, f"pixel cache part {p.npy} {why}: moved aside, the next run rebuilds it")
            if arr.shape != want or arr.dtype != np.uint8:
                self._fail(k, f"pixel cache part {p.npy} holds {arr.dtype} {arr.shape}, its record says uint8 {want}: "
                              "moved aside, the next run rebuilds it")
            self._arrays[k] = arr
        return arr

    def _fail(self, k: int, message: str) -> None:
        """Set part k aside, remember why (a later read of it says the same) and raise DataError."""
        self._failed[k] = message
        self._quarantine(self.parts[k])
        raise DataError(message)

    def _check(self, k: int, row_lo: int, row_hi: int) -> None:
        """Verify the digests of part k's blocks holding local rows [row_lo, row_hi) not yet checked."""
        p, arr = self.parts[k], self._array(k)
        b = int(p.meta["block_rows"])
        for blk in range(row_lo // b, (row_hi - 1) // b + 1):
            if (k, blk) in self._checked:
                continue
            want = p.meta["block_digests"][blk]
            got = _xxh3_128(np.ascontiguousarray(arr[blk * b:(blk + 1) * b]).data)
            if got != want:
                self._fail(k, f"pixel cache part {p.npy}: rows {p.start + blk * b}..{min(p.end, p.start + (blk + 1) * b) - 1}"
                              f" have xxh3-128 {got}, the record says {want} (the file was changed or damaged): "
                              "moved aside, the next run rebuilds it; these bytes were not used as pixels")
            self._checked.add((k, blk))

    def _quarantine(self, p: Part) -> None:
        self._arrays.pop(next((k for k, q in enumerate(self.parts) if q is p), -1), None)
        for f in (p.npy.with_suffix(".json"), p.npy):
            with contextlib.suppress(OSError):
                os.replace(f, f.with_name(f.name + ".corrupt"))

    def _rows(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        """The rows [lo, hi) as views of the parts, checked."""
        while lo < hi:
            k = int(np.searchsorted(self.starts, lo, side="right")) - 1
            p = self.parts[k]
            top = min(hi, p.end)
            self._check(k, lo - p.start, top - p.start)
            yield self._array(k)[lo - p.start:top - p.start]
            lo = top

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        [rows] = list(self._rows(index, index + 1))
        return torch.from_numpy(np.array(rows[0])), int(self.targets[index])

    def fetch_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(uint8 [B, 3, crop, crop], targets int64 [B], ids int64 [B])``, a copy (never a view of the file)."""
        lo, n = indices[0], len(indices)
        if indices[-1] - lo + 1 == n and all(b == a + 1 for a, b in zip(indices, indices[1:])):
            chunks = list(self._rows(lo, lo + n))
            x = torch.from_numpy(np.concatenate(chunks) if len(chunks) > 1 else np.array(chunks[0]))
            ids = torch.arange(lo, lo + n, dtype=torch.int64)
            return x, self.targets[lo:lo + n].clone(), ids
        x = torch.stack([self[i][0] for i in indices])
        idx = torch.tensor(indices, dtype=torch.int64)
        return x, self.targets.index_select(0, idx), idx


def builder() -> dict:
    """Who builds a part (its record's ``built``): pid, host, rank, world size."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "rank": int(os.environ.get("RANK", 0)),
            "world_size": int(os.environ.get("WORLD_SIZE", 1))}
