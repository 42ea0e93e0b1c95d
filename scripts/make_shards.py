"""Write an image-classification dataset as WebDataset tar shards (``{key}.png`` + ``{key}.cls``) with
webdataset's ``TarWriter``; the default is the Fashion-MNIST test set in its file order, so that
``data=webdataset`` over these shards evaluates the same images as ``data=fashion_mnist``.

    python scripts/make_shards.py --root /usr/share/datasets/fashion-mnist --out /tmp/fm \
        --samples-per-shard 1000 [--index]

Shard i is ``OUT/{prefix}-{i:06d}.tar``; keys are ``{split}-{position:08d}`` (position in the split). PNG is
lossless, so the decoded pixels are the idx file's bytes. ``--index`` also writes ``OUT/index.json``
(``python -m disteval.data.index``). ``write_shards`` is reusable: sizes per shard may be uneven and zero.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def write_shards(out: str | os.PathLike, images: np.ndarray, labels: np.ndarray, sizes: Sequence[int],
                 prefix: str = "shard", key_prefix: str = "s") -> list[str]:
    """Write ``images`` (uint8 [N, H, W] or [N, H, W, C]) and ``labels`` (int [N]) in order into
    ``len(sizes)`` shards of ``sizes[i]`` samples (sum must be N). Returns the shard paths."""
    import webdataset as wds

    if sum(sizes) != len(images) or len(images) != len(labels):
        raise ValueError(f"shard sizes sum to {sum(sizes)}, images {len(images)}, labels {len(labels)}")
    Path(out).mkdir(parents=True, exist_ok=True)
    paths, pos = [], 0
    for i, n in enumerate(sizes):
        path = str(Path(out) / f"{prefix}-{i:06d}.tar")
        with wds.TarWriter(path) as sink:
            for p in range(pos, pos + n):
                sink.write({"__key__": f"{key_prefix}-{p:08d}", "png": images[p], "cls": int(labels[p])})
        pos += n
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    from disteval.data.datasets import _fashion_files, read_idx
    from disteval.data.index import build_index, write_index

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--split", default="test", choices=("test", "train"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=None, help="first N samples only")
    ap.add_argument("--index", action="store_true", help="also write OUT/index.json")
    args = ap.parse_args(argv)
    files = _fashion_files(Path(args.root), args.split)
    if files is None:
        print(f"error: no Fashion-MNIST {args.split} idx files in {args.root}", file=sys.stderr)
        return 1
    images, labels = read_idx(files[0]), read_idx(files[1])
    if args.limit is not None:
        images, labels = images[:args.limit], labels[:args.limit]
    n, k = len(images), args.samples_per_shard
    sizes = [min(k, n - i) for i in range(0, n, k)]
    paths = write_shards(args.out, images, labels, sizes, prefix=f"fashion-mnist-{args.split}", key_prefix=args.split)
    print(f"{len(paths)} shards, {n} samples in {args.out}", file=sys.stderr)
    if args.index:
        write_index(build_index(paths), str(Path(args.out) / "index.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
