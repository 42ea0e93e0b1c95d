"""Streaming WebDataset tar shards: read + decode throughput of disteval's planned reader (``data=webdataset``:
``disteval.data.stream_plan`` + ``wds_stream.ShardStream``) against webdataset's own pipeline
(``wds.WebDataset(urls, shardshuffle=False).decode("l8")``, with ``split_by_worker`` under workers) on the same
shards, measured in one run, plus the bytes disteval reads relative to the shards' bytes.

    python benchmarks/streaming.py [--samples 10000] [--per-shard 1000] [--workers 0 2] [--repeats 3]
                                   [--world-sizes 1 4] [--smoke]

Shards: the Fashion-MNIST test images (``/usr/share/datasets/fashion-mnist``) written by
scripts/make_shards.py's ``write_shards`` (PNG + cls), or seeded random 28x28 images where it is absent.
Throughput: samples/s decoded to float32 [1, 28, 28] through a DataLoader with each worker count (median of
``--repeats``), ratio disteval / webdataset (target >= 0.95x). Bytes: for each W in ``--world-sizes`` and the
largest worker count, every (rank, worker) consumer is run in this process and the bytes it read from the
shard files are summed: ratio to the shards' total bytes (target 1.0x: every sample read once).

Checked (exit 1 naming the mismatch, never on a time): both readers yield every key exactly once with equal
decoded pixels and labels; every consumer grid covers every sample exactly once; disteval's bytes are at
least the bytes of all samples' members and at most the shard bytes plus one 10 KiB tar record per range.

``--smoke``: 600 samples in shards of 250, workers 0 and 2, W 1 and 3, 1 repeat (seconds).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")
SMOKE = {"samples": 600, "per_shard": 250, "workers": [0, 2], "repeats": 1, "world_sizes": [1, 3]}
B = 256


def _images(n: int) -> tuple[np.ndarray, np.ndarray, str]:
    from disteval.data.datasets import _fashion_files, read_idx

    files = _fashion_files(FASHION, "test") if FASHION.is_dir() else None
    if files is not None:
        return read_idx(files[0])[:n], read_idx(files[1])[:n], "fashion-mnist test"
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n), "random 28x28"


def _write(out: str, n: int, per_shard: int) -> tuple[list[str], np.ndarray, np.ndarray, str]:
    spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    images, labels, what = _images(n)
    sizes = [min(per_shard, len(images) - i) for i in range(0, len(images), per_shard)]
    return make.write_shards(out, images, labels, sizes), images, labels, what


def _disteval(shards, workers: int) -> tuple[float, dict]:
    """Seconds and {key: (pixels, label)} of one pass of the planned reader through a DataLoader (W=1)."""
    from torch.utils.data import DataLoader

    from disteval.data.stream_plan import plan_rank
    from disteval.data.wds_stream import SampleFormat, ShardStream

    ds = ShardStream(shards, plan_rank([s.num_samples for s in shards], 1, 0, workers, B), B,
                     SampleFormat(image_mode="l8"))
    t0 = time.perf_counter()
    batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
    seconds = time.perf_counter() - t0
    starts = np.cumsum([0] + [s.num_samples for s in shards])
    out = {}
    for b in batches:  # ids -> keys outside the timed pass
        for j, p in enumerate(b.sample_ids.tolist()):
            s = int(np.searchsorted(starts, p, side="right") - 1)
            key = shards[s].keys[p - starts[s]]
            if key in out:
                out["__duplicate__"] = key
            out[key] = (b.inputs[j], int(b.targets[j]))
    return seconds, out


def _webdataset(urls: list[str], workers: int) -> tuple[float, dict]:
    """The same with webdataset's pipeline: decode l8, the same float conversion, batches of B."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from disteval.data.wds_stream import to_float_chw

    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None,
                         workersplitter=wds.split_by_worker if workers else None)
          .decode("l8").to_tuple("__key__", "png", "cls").map_tuple(None, to_float_chw, None).batched(B))
    t0 = time.perf_counter()
    batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
    seconds = time.perf_counter() - t0
    out = {}
    for keys, x, y in batches:
        for j, key in enumerate(keys):
            if key in out:
                out["__duplicate__"] = key
            out[key] = (x[j], int(y[j]))
    return seconds, out


def _compare(name: str, got: dict, want_keys: list[str], images, labels, problems: list) -> None:
    if "__duplicate__" in got:
        problems.append(f"{name}: key {got['__duplicate__']} read twice")
    if sorted(k for k in got if k != "__duplicate__") != sorted(want_keys):
        problems.append(f"{name}: {len(got)} keys, expected {len(want_keys)}")
        return
    for p, key in enumerate(want_keys):
        x, y = got[key]
        if not torch.equal(x[0], torch.from_numpy(images[p].astype(np.float32) / 255.0)) or y != int(labels[p]):
            problems.append(f"{name}: key {key} pixels or label differ from the source")
            return


def _bytes(shards, paths, w: int, k: int, problems: list) -> tuple[int, int]:
    """Bytes read by every consumer of (W, K) run in this process, and the shards' total bytes."""
    from disteval.data.stream_plan import plan_rank
    from disteval.data.wds_stream import SampleFormat, ShardStream

    counts = [s.num_samples for s in shards]
    read, seen, n_ranges = 0, [], 0
    for r in range(w):
        plans = plan_rank(counts, w, r, k, B)
        ds = ShardStream(shards, plans, B, SampleFormat(image_mode="l8"))
        for j in range(max(1, k)):
            seen += [p for b in ds.iter_worker(j) for p in b.sample_ids.tolist()]
        read += ds.bytes_read[0]
        n_ranges += sum(len(p.ranges) for p in plans)
    total = sum(os.path.getsize(p) for p in paths)
    if sorted(seen) != list(range(sum(counts))):
        problems.append(f"W={w} x {k} workers: consumers did not cover every sample exactly once")
    if not total - 10240 * len(paths) <= read <= total + 10240 * n_ranges:
        problems.append(f"W={w} x {k} workers: read {read:,} bytes of {total:,} ({n_ranges} ranges)")
    return read, total


def main() -> int:
    """Write the shards, time both readers per worker count, measure bytes per W; 1 on a mismatch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--per-shard", type=int, default=1_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--smoke", action="store_true", help="600 samples, workers 0 and 2, W 1 and 3, 1 repeat")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)

    from rich.console import Console
    from rich.table import Table

    from _summary import row, write
    from disteval.data.index import build_index

    torch.set_num_threads(1)
    problems, headline = [], []
    table = Table(title=f"streaming read+decode of WebDataset shards (samples/s, median of {args.repeats})")
    for col in ("loader workers", "disteval planned", "webdataset pipeline", "ratio disteval / webdataset"):
        table.add_column(col, justify="right")
    btable = Table(title="bytes read by disteval's consumers relative to the shards' bytes (target 1.0x)")
    for col in ("W", "workers", "bytes read", "shard bytes", "ratio"):
        btable.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        paths, images, labels, what = _write(tmp, args.samples, args.per_shard)
        shards = build_index(paths)
        keys = [k for s in shards for k in s.keys]
        for k in args.workers:
            times = {"disteval": [], "webdataset": []}
            for _ in range(args.repeats):
                for name, fn in (("disteval", lambda: _disteval(shards, k)), ("webdataset", lambda: _webdataset(paths, k))):
                    sec, got = fn()
                    times[name].append(sec)
                    _compare(f"{name} ({k} workers)", got, keys, images, labels, problems)
            ours, theirs = (len(keys) / statistics.median(times[n]) for n in ("disteval", "webdataset"))
            table.add_row(str(k), f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}x")
            headline.append(row(f"read+decode {what} shards, {k} loader workers (samples/s): disteval vs "
                                "webdataset", f"{ours:,.0f}", f"{theirs:,.0f}", ours / theirs))
        for w in args.world_sizes:
            read, total = _bytes(shards, paths, w, max(args.workers), problems)
            btable.add_row(str(w), str(max(args.workers)), f"{read:,}", f"{total:,}", f"{read / total:.4f}x")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(btable)
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    write("streaming", headline, args.smoke)
    console.print(f"checks passed: both readers yielded all {len(keys)} samples once with equal pixels and labels; "
                  f"every consumer grid covered every sample once within the byte bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
