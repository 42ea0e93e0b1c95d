"""Make an ImageFolder view (``ROOT/<wnid>/<image>.jpg`` symlinks, nothing copied) of the 1000 ImageNet sample
images shipped flat in ../shared/data/imagenet-sample-224 (files ``<wnid>_<label>.jpg``), for
``+experiment=imagenet_vit_tp`` and ``+experiment=imagenet_vit``.

    python scripts/imagenet_sample_tree.py /tmp/imagenet-sample-tree [--sample DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "imagenet-sample-224"


def make_tree(sample: Path, root: Path, limit: int | None = None) -> int:
    """Link every ``<wnid>_*.jpg`` of ``sample`` (or the first ``limit`` in name order: one image per class,
    the shipped folder holding one per class) as ``root/<wnid>/<name>``; returns the number of images linked.
    Raises FileNotFoundError when ``sample`` holds no such image."""
    files = sorted(sample.glob("n*_*.jpg"))[:limit]
    if not files:
        raise FileNotFoundError(f"no <wnid>_<label>.jpg images in {sample}")
    for f in files:
        folder = root / f.name.split("_")[0]
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    return len(files)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="where to make the ImageFolder view")
    parser.add_argument("--sample", type=Path, default=SAMPLE, help=f"the flat image folder (default {SAMPLE})")
    args = parser.parse_args(argv)
    try:
        n = make_tree(args.sample, args.root)
    except FileNotFoundError as exc:
        sys.exit(str(exc))
    print(f"{n} images in {len({p.parent for p in args.root.glob('*/*.jpg')})} class folders under {args.root}")


if __name__ == "__main__":
    main()
