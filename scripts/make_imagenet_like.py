"""Generate an ImageNet-val-like ImageFolder tree for measuring the input pipeline (benchmarks/input_pipeline.py).

The shipped 224 px samples (../shared/data/imagenet-sample-224) decode far faster than real validation images, so
they measure nothing about decoding. This script writes ``N`` JPEGs whose sizes follow ImageNet-val's shape (most
images 500 px on the long side, 4:3 or 3:2, landscape three times in four, a tail of smaller and larger ones; median
about 500x375) at quality 90, each a mosaic of photograph tiles at their native resolution (flipped and shifted per
image), so its entropy, and so its decode cost per pixel, is a photograph's and not a smooth upscale's. Image ``i``
lies in the class folder of its first tile's source (``ROOT/<wnid>/<i>.JPEG``); with N >= 1000 all 1000 classes
are present, as a 1000-class model's preflight requires. Seeded: the same N and seed give the same files.

    python scripts/make_imagenet_like.py /path/to/tree [--n 2000] [--seed 0] [--quality 90] [--sample DIR] [--jobs J]
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "imagenet-sample-224"
# (long side, weight): ImageNet-val is dominated by 500 px long sides; a tail of smaller and larger images
LONG_SIDES = ((500, 0.80), (375, 0.04), (333, 0.03), (640, 0.05), (800, 0.04), (1024, 0.02), (250, 0.02))
ASPECTS = ((4 / 3, 0.60), (3 / 2, 0.25), (1.0, 0.10), (16 / 9, 0.05))


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """``(width, height)`` in pixels drawn from the ImageNet-val-like distribution above."""
    longs, lw = zip(*LONG_SIDES)
    aspects, aw = zip(*ASPECTS)
    long = int(rng.choice(longs, p=np.array(lw) / sum(lw)))
    short = max(1, int(round(long / float(rng.choice(aspects, p=np.array(aw) / sum(aw))))))
    return (long, short) if rng.random() < 0.75 else (short, long)


def _one(job: tuple[int, int, int, list[str], str]) -> tuple[int, int, int]:
    """Write image ``i``; returns ``(i, width, height)``."""
    i, seed, quality, sources, out = job
    rng = np.random.default_rng([seed, i])
    w, h = image_size(rng)
    canvas = np.empty((h, w, 3), dtype=np.uint8)
    tiles = [np.asarray(Image.open(sources[(i + 7919 * k) % len(sources)]).convert("RGB")) for k in range(4)]
    side = min(min(t.shape[:2]) for t in tiles)
    tiles = [t[:side, :side] for t in tiles]  # square tiles of one size: the mosaic has no gaps
    y = 0
    k = 0
    while y < h:
        x = 0
        while x < w:
            t = tiles[k % len(tiles)]
            if rng.random() < 0.5:
                t = t[:, ::-1]
            th, tw = min(t.shape[0], h - y), min(t.shape[1], w - x)
            canvas[y:y + th, x:x + tw] = t[:th, :tw]
            x += tw
            k += 1
        y += side
    shift = (int(rng.integers(0, h)), int(rng.integers(0, w)))
    canvas = np.roll(canvas, shift, axis=(0, 1))
    Image.fromarray(canvas).save(out, quality=quality)
    return i, w, h


def make_tree(root: Path, n: int, seed: int = 0, quality: int = 90, sample: Path = SAMPLE, jobs: int | None = None
              ) -> list[tuple[int, int]]:
    """Write ``n`` JPEGs under ``root`` (see the module's text); returns their ``(width, height)`` in order.
    Raises FileNotFoundError when ``sample`` holds no ``<wnid>_*.jpg``; ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    sources = sorted(str(p) for p in sample.glob("n*_*.jpg"))
    if not sources:
        raise FileNotFoundError(f"no <wnid>_<label>.jpg images in {sample} (the shipped ImageNet sample)")
    work = []
    for i in range(n):
        wnid = Path(sources[i % len(sources)]).name.split("_")[0]
        (root / wnid).mkdir(parents=True, exist_ok=True)
        work.append((i, seed, quality, sources, str(root / wnid / f"{i:08d}.JPEG")))
    if jobs == 1:
        sizes = [_one(job) for job in work]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            sizes = sorted(pool.imap_unordered(_one, work, chunksize=16))
    return [(w, h) for _, w, h in sizes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the tree to write (ROOT/<wnid>/<i>.JPEG)")
    ap.add_argument("--n", type=int, default=2000, help="number of images (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality (ImageNet-val's are about 90)")
    ap.add_argument("--sample", type=Path, default=SAMPLE, help="the shipped 224 px ImageNet sample folder")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: all cores)")
    args = ap.parse_args(argv)
    try:
        sizes = make_tree(args.root, args.n, args.seed, args.quality, args.sample, args.jobs)
    except (FileNotFoundError, ValueError) as exc:
        print(f"make_imagenet_like.py: {exc}", file=sys.stderr)
        return 2
    wh = np.array(sizes)
    print(f"make_imagenet_like.py: {len(sizes)} JPEGs (quality {args.quality}) under {args.root}; median "
          f"{int(np.median(wh[:, 0]))}x{int(np.median(wh[:, 1]))} px, {len({p.parent for p in args.root.glob('*/*.JPEG')})} "
          "classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
