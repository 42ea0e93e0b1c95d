"""Per-shard sample-count index of a WebDataset tar shard set: ``python -m disteval.data.index URLS -o index.json``.

A WebDataset shard is a POSIX tar whose consecutive members sharing a *key* (the name up to the first dot
of the base name, webdataset's ``base_plus_ext``) form one sample. The index records, per shard, in shard
order: ``url``, ``size`` (bytes) and ``mtime_ns`` (local files; None for remote URLs, which are therefore not
checked for staleness), ``num_samples``, ``keys`` (one per sample, in tar order) and ``offsets`` (byte offset of
the tar header of each sample's first member): the streaming reader seeks there (local files) or asks for
that byte range (http/https) instead of reading the shard's prefix. Keys are grouped by webdataset's own rule
(``base_plus_ext``, metadata ``__*__`` members
skipped, lower-cased suffixes) so that the index and the reader agree on what a sample is.

The index is written once and validated on load against the shard list and the shards' current sizes and
mtimes: a stale or mismatching index is a DataError naming the shard, never silently reused. A truncated or
unreadable shard is a DataError naming it. A key that appears twice in a shard (webdataset would yield two
samples with one id) is a DataError: sample ids are ``(shard, key)`` and must be unique.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from disteval.errors import DataError

INDEX_FORMAT = "disteval-wds-index"
INDEX_VERSION = 1
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator default skip_meta

__all__ = ["ShardInfo", "build_index", "expand_urls", "is_local", "load_index", "local_path", "main",
           "read_index", "scan_shard", "write_index"]


@dataclass(frozen=True)
class ShardInfo:
    """One shard of the index. ``offsets[i]`` is the byte offset (int) of sample i's first tar header
    (``offsets`` None: unknown, the reader then reads a shard's prefix to reach a range)."""
    url: str
    size: int | None
    mtime_ns: int | None
    num_samples: int
    keys: tuple[str, ...]
    offsets: tuple[int, ...] | None


def expand_urls(urls: str | Sequence[str], allow_pipe: bool = False) -> list[str]:
    """Shard URLs in order: a brace pattern (``shard-{000..009}.tar``, webdataset's ``expand_urls``, which
    also splits on ``::``) or a list of paths/URLs (each brace-expanded). ``pipe:`` URLs run a shell command
    and are refused unless ``allow_pipe`` (the user's opt-in). Raises DataError for an empty list or a pipe."""
    from webdataset.shardlists import expand_urls as wds_expand

    out: list[str] = []
    for item in ([urls] if isinstance(urls, str) else list(urls)):
        out.extend(wds_expand(str(item)))
    if not out:
        raise DataError(f"data.urls {urls!r} names no shard")
    for u in out:
        if u.startswith("pipe:") and not allow_pipe:
            raise DataError(f"{u!r}: pipe: URLs run shell commands; set data.allow_pipe=true to opt in")
    return out


def local_path(url: str) -> str | None:
    """The file path of a local shard (plain path or ``file:`` URL), else None."""
    if url.startswith("file:"):
        return url[len("file:"):].removeprefix("//")
    return None if re.match(r"^[a-z][a-z0-9+.-]*:", url) else url


def is_local(url: str) -> bool:
    return local_path(url) is not None


def _key_of(name: str) -> str | None:
    """webdataset's grouping key of a member name (``base_plus_ext``), None for names it skips."""
    from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

    if "/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix):
        return None
    if _SKIP_META.match(name):
        return None
    return base_plus_ext(name)[0]


def scan_shard(url: str) -> ShardInfo:
    """Read one shard's tar headers (local files: headers only, data skipped by seeking; remote: streamed
    through webdataset's ``gopen``) and return its ShardInfo. Raises DataError naming the shard when it is
    unreadable, truncated or holds a key twice."""
    path = local_path(url)
    keys: list[str] = []
    offsets: list[int] = []
    seen: set[str] = set()
    try:
        if path is not None:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime_ns
            tf = tarfile.open(path, mode="r:")  # random access: skips member data by seeking
        else:
            from webdataset.gopen import gopen

            size = mtime = None
            tf = tarfile.open(fileobj=gopen(url), mode="r|")
        with tf:
            last = None
            for info in tf:
                if not info.isreg():
                    continue
                key = _key_of(info.name)
                if key is None or key == last:
                    continue
                if key in seen:
                    raise DataError(f"shard {url}: key {key!r} appears twice (not contiguous); sample ids "
                                    "(shard, key) must be unique")
                keys.append(key)
                seen.add(key)
                offsets.append(info.offset)
                last = key
            if path is not None:
                _check_end(url, path, tf.offset, size)
    except DataError:
        raise
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise DataError(f"shard {url} is unreadable or truncated: {type(exc).__name__}: {exc}") from exc
    return ShardInfo(url, size, mtime, len(keys), tuple(keys), tuple(offsets))


def _check_end(url: str, path: str, end: int, size: int) -> None:
    """A complete tar ends after its last member with at least two zero blocks (1024 bytes). Python's tarfile
    treats a missing or short header as the end of the archive, so a shard cut at any point would otherwise
    index as a shorter shard: this check makes a truncated shard a DataError naming it."""
    with open(path, "rb") as f:
        f.seek(min(end, size))
        tail = f.read()
    if end > size or len(tail) < 1024 or tail.count(0) != len(tail):
        raise DataError(f"shard {url} is truncated or has trailing garbage: its members end at byte {end} of "
                        f"{size}, not followed by the tar end-of-archive marker (1024 zero bytes)")


def build_index(urls: Sequence[str], progress: Callable[[int, int, ShardInfo], None] | None = None) -> list[ShardInfo]:
    """Scan every shard in order; ``progress(i, total, info)`` after each. Raises DataError as scan_shard."""
    out = []
    for i, url in enumerate(urls):
        out.append(scan_shard(url))
        if progress is not None:
            progress(i + 1, len(urls), out[-1])
    return out


def write_index(shards: Sequence[ShardInfo], path: str) -> None:
    """Write the index as JSON (atomic: temp file, fsync, rename)."""
    doc = {"format": INDEX_FORMAT, "version": INDEX_VERSION,
           "num_samples": sum(s.num_samples for s in shards), "shards": [asdict(s) for s in shards]}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_index(path: str) -> list[ShardInfo]:
    """Read an index file without validating it against the shards. Raises DataError when malformed."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != INDEX_FORMAT or doc.get("version") != INDEX_VERSION:
            raise DataError(f"{path} is not a {INDEX_FORMAT} v{INDEX_VERSION} file")
        shards = [ShardInfo(s["url"], s["size"], s["mtime_ns"], int(s["num_samples"]), tuple(s["keys"]),
                            None if s["offsets"] is None else tuple(s["offsets"])) for s in doc["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"cannot read shard index {path}: {type(exc).__name__}: {exc}") from exc
    for s in shards:
        if s.num_samples != len(s.keys) or (s.offsets is not None and len(s.offsets) != s.num_samples):
            raise DataError(f"{path}: shard {s.url} has {s.num_samples} samples but {len(s.keys)} keys")
    return shards


def load_index(path: str, urls: Sequence[str]) -> list[ShardInfo]:
    """Read ``path`` and check it describes exactly ``urls`` (same order) with the shards' current sizes and
    mtimes. Raises DataError naming the first mismatching shard ("stale index: rebuild it with
    python -m disteval.data.index")."""
    shards = read_index(path)
    fix = f"; rebuild it: python -m disteval.data.index {' '.join(urls[:1])}{' ...' if len(urls) > 1 else ''} -o {path}"
    if [s.url for s in shards] != list(urls):
        extra = sorted(set(urls) ^ {s.url for s in shards})
        raise DataError(f"shard index {path} lists other shards than data.urls (differing: {extra[:3]} or the "
                        f"order){fix}")
    for s in shards:
        p = local_path(s.url)
        if p is None:
            continue
        try:
            st = os.stat(p)
        except OSError as exc:
            raise DataError(f"shard {s.url} of index {path} is unreadable: {exc}") from exc
        if st.st_size != s.size or st.st_mtime_ns != s.mtime_ns:
            raise DataError(f"stale shard index {path}: shard {s.url} has size {st.st_size} mtime_ns "
                            f"{st.st_mtime_ns}, the index recorded {s.size} / {s.mtime_ns}{fix}")
    return shards


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: scan the shards and write the index, printing progress to stderr. Exit 1 on a DataError."""
    ap = argparse.ArgumentParser(prog="python -m disteval.data.index", description=__doc__.split("\n")[0])
    ap.add_argument("urls", nargs="+", help="shard paths/URLs or brace patterns")
    ap.add_argument("-o", "--output", required=True, help="index JSON to write")
    ap.add_argument("--allow-pipe", action="store_true", help="accept pipe: URLs (runs shell commands)")
    args = ap.parse_args(argv)

    def progress(i: int, n: int, info: ShardInfo) -> None:
        print(f"[{i}/{n}] {info.url}: {info.num_samples} samples", file=sys.stderr)

    try:
        shards = build_index(expand_urls(args.urls, allow_pipe=args.allow_pipe), progress)
        write_index(shards, args.output)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.output}: {len(shards)} shards, {sum(s.num_samples for s in shards)} samples", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
