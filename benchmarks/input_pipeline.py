"""Input pipeline: images/s of each way to feed imagefolder data, beside the limits measured in the same run.

    python benchmarks/input_pipeline.py [--n 512] [--crop 224] [--resize 256] [--model resnet18] [--batch 32]
                                        [--workers 1 2] [--repeats 3] [--tree DIR] [--smoke]

On an ImageNet-val-like tree (``scripts/make_imagenet_like.py``, made in a temporary folder unless ``--tree``):

1. Limits: the raw file read rate (bytes only), a bare libjpeg-turbo decode loop (simplejpeg, full size, no
   resize), a memcpy of the cached pixels (numpy copy of the memory-mapped parts).
2. Loader methods, images/s in the process (= per worker) and through a DataLoader with each of ``--workers``:
   ``float-host`` (torchvision ImageFolder with the float eval transform: what disteval shipped before uint8),
   ``pil`` (uint8 pixels, Pillow: the reference pixels), ``turbo`` (uint8, libjpeg-turbo with DCT scaling),
   ``cache`` (the exact pixel cache: ``disteval.data.pixel_cache.CachedPixels``).
3. The whole job (``python -m disteval``, W = 1) from the files and from the cache against a bare forward loop of
   the same model on batches already in memory (the same batch size and threads), loop rates from results.json.
4. Parity: mean absolute pixel difference and top-1 agreement of ``turbo`` against ``pil``.

Targets (printed, never the exit code): cache >= 10x pil per worker; the job from the cache >= 0.95x the bare
forward loop. Checks (exit 1 on a failure): the cache's pixels == pil's for every image; the job's metrics from the
cache == from the files. ``--smoke``: 48 images, crop 64, mobilenet_v3_small, 1 repeat (seconds).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO.parent / "shared" / "data" / "imagenet-sample-224"
SMOKE = {"n": 48, "crop": 64, "resize": 72, "model": "mobilenet_v3_small", "batch": 8, "workers": [1], "repeats": 1}
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _generator():
    spec = importlib.util.spec_from_file_location("make_imagenet_like", REPO / "scripts" / "make_imagenet_like.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _through_loader(dataset, workers: int, batch: int) -> None:
    from torch.utils.data import DataLoader

    for _ in DataLoader(dataset, batch_size=batch, num_workers=workers,
                        multiprocessing_context="fork" if workers else None):
        pass


def _job(tree: Path, cache_dir: Path, run_dir: Path, args, cache: str) -> dict:
    cmd = [sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", "data=imagefolder", f"data.root={tree}",
           f"model.name={args.model}", "model.weights=null", f"model.num_classes={args.classes}",
           f"data.resize_size={args.resize}", f"data.crop_size={args.crop}", f"data.batch_size={args.batch}",
           "dist.world_size=1", f"data.cache={cache}", f"data.cache_dir={cache_dir}", "data.num_workers=0"]
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


def _bare_forward(args, threads: int, images: torch.Tensor) -> float:
    """images/s of ``model(x)`` over the batches of ``images`` (float32, normalised, in memory), median."""
    import torchvision

    torch.set_num_threads(threads)
    net = torchvision.models.get_model(args.model, weights=None, num_classes=args.classes).eval()
    batches = list(images.split(args.batch))
    with torch.inference_mode():
        net(batches[0])  # warm-up
        sec = _timed(lambda: [net(b) for b in batches], args.repeats)
    return len(images) / sec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--resize", type=int, default=256)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", type=Path, help="an existing ImageNet-like tree (default: generate --n images)")
    ap.add_argument("--smoke", action="store_true", help="48 images, crop 64, mobilenet_v3_small, 1 repeat")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)

    from rich.console import Console
    from rich.table import Table
    from torchvision.datasets import ImageFolder

    sys.path.insert(0, str(REPO / "benchmarks"))
    from _summary import finish, row
    from disteval.data.datasets import imagenet_eval_transform
    from disteval.data.pixel_cache import CachedPixels, PartWriter, folder_cache
    from disteval.data.pixels import PixelFolder, PixelNormalizer
    from omegaconf import OmegaConf

    console = Console(width=max(Console().width, 120))
    problems: list[str] = []
    headline: list[dict] = []
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as tmp:
        tmp = Path(tmp)
        tree = args.tree
        if tree is None:
            if not SAMPLE.is_dir():
                console.print(f"[red]problem:[/] the generator needs the shipped ImageNet sample at {SAMPLE} (or --tree)")
                return 1
            tree = tmp / "tree"
            _generator().make_tree(tree, args.n, seed=0)
        files = sorted(p for p in tree.rglob("*") if p.is_file())
        args.classes = len({p.parent for p in files})
        n = len(files)
        pil = PixelFolder(str(tree), args.resize, args.crop, "pil")
        turbo = PixelFolder(str(tree), args.resize, args.crop, "turbo")
        ref = ImageFolder(str(tree), transform=imagenet_eval_transform(args.resize, args.crop, MEAN, STD))

        # the cache, built in this process (what the ranks' taps do)
        data = OmegaConf.create({"root": str(tree), "resize_size": args.resize, "crop_size": args.crop,
                                 "decode": "pil", "cache_dir": str(tmp / "cache")})
        cache = folder_cache(data, pil.samples, pil.classes)
        cache.ensure_manifest()
        writer = PartWriter(cache, 0, n, {"benchmark": True})
        pixels = torch.stack([pil[i][0] for i in range(n)])
        writer.write(pixels, torch.arange(n))
        writer.publish()
        cached = CachedPixels(cache, n)
        got = cached.fetch_batch(list(range(n)))[0]
        if not torch.equal(got, pixels):
            problems.append("the cache's pixels differ from PIL's")

        # 1. limits
        nbytes = sum(p.stat().st_size for p in files)
        read_s = _timed(lambda: [p.read_bytes() for p in files], args.repeats)
        import simplejpeg

        blobs = [p.read_bytes() for p in files]
        dec_s = _timed(lambda: [simplejpeg.decode_jpeg(b, colorspace="RGB") for b in blobs], args.repeats)
        arrays = [np.load(p.npy, mmap_mode="r") for p in cache.cover(n)]
        copy_s = _timed(lambda: [np.array(a) for a in arrays], args.repeats)
        limits = Table(title=f"input pipeline limits, {n} images ({nbytes / n / 1e3:.0f} kB each), one process")
        for col in ("limit", "images/s", "MB/s"):
            limits.add_column(col, justify="right")
        limits.add_row("raw file read", f"{n / read_s:,.0f}", f"{nbytes / read_s / 1e6:,.0f}")
        limits.add_row("bare libjpeg-turbo decode (full size)", f"{n / dec_s:,.0f}", "")
        limits.add_row("memcpy of cached pixels", f"{n / copy_s:,.0f}", f"{pixels.numel() / copy_s / 1e6:,.0f}")

        # 2. loader methods
        methods = {"float-host": ref, "pil": pil, "turbo": turbo, "cache": cached}
        table = Table(title=f"input pipeline methods (images/s, median of {args.repeats}; crop {args.crop})")
        for col in ("method", "in process (per worker)", *[f"{k} workers" for k in args.workers], "x pil per worker"):
            table.add_column(col, justify="right")
        rates, loaders = {}, {}
        for name, ds in methods.items():
            if name == "cache":  # whole batches (the loop's fast path without workers)
                rates[name] = n / _timed(lambda: [cached.fetch_batch(list(range(i, min(i + args.batch, n))))
                                                  for i in range(0, n, args.batch)], args.repeats)
            else:
                rates[name] = n / _timed(lambda: [ds[i] for i in range(n)], args.repeats)
            loaders[name] = [n / _timed(lambda: _through_loader(ds, k, args.batch), args.repeats) for k in args.workers]
        for name in methods:
            table.add_row(name, f"{rates[name]:,.0f}", *(f"{r:,.0f}" for r in loaders[name]),
                          f"{rates[name] / rates['pil']:.2f}x")
        ratio_cache = rates["cache"] / rates["pil"]

        # 3. the whole job against a bare forward loop
        res_files = _job(tree, tmp / "cache", tmp / "job-files", args, "none")
        res_cache = _job(tree, tmp / "cache", tmp / "job-cache", args, "pixels")
        if res_files["metrics"] != res_cache["metrics"]:
            problems.append(f"metrics from the cache {res_cache['metrics']} != from the files {res_files['metrics']}")
        threads = int(res_cache["compute"]["threads"])
        norm = PixelNormalizer(MEAN, STD)
        bare = _bare_forward(args, threads, norm(pixels))
        job_files = res_files["throughput"]["images_per_s"]
        job_cache = res_cache["throughput"]["images_per_s"]
        jobs = Table(title=f"the whole job ({args.model}, W=1, batch {args.batch}, {threads} thread(s)), loop images/s")
        for col in ("feed", "images/s", "x bare forward loop"):
            jobs.add_column(col, justify="right")
        jobs.add_row("bare forward loop (batches in memory)", f"{bare:,.1f}", "1.00x")
        jobs.add_row("disteval from the files (pil)", f"{job_files:,.1f}", f"{job_files / bare:.2f}x")
        jobs.add_row("disteval from the pixel cache", f"{job_cache:,.1f}", f"{job_cache / bare:.2f}x")

        # 4. parity of turbo against pil
        t_pixels = torch.stack([turbo[i][0] for i in range(n)])
        mad = (t_pixels.float() - pixels.float()).abs().mean().item()
        same = (t_pixels == pixels).all(dim=(1, 2, 3)).float().mean().item()

    console.print(limits)
    console.print(table)
    console.print(jobs)
    console.print(f"parity of data.decode=turbo against pil: mean absolute difference {mad:.3f} grey levels; "
                  f"{same * 100:.0f} % of images identical")
    console.print(f"targets: cache {ratio_cache:.1f}x pil per worker (target >= 10x: "
                  f"{'met' if ratio_cache >= 10 else 'NOT met'}); job from the cache {job_cache / bare:.2f}x the bare "
                  f"forward loop (target >= 0.95x: {'met' if job_cache / bare >= 0.95 else 'NOT met'})")
    headline += [row(f"pixel cache vs PIL decode, images/s per worker (crop {args.crop})", f"{rates['cache']:,.0f}",
                     f"{rates['pil']:,.0f}", ratio_cache),
                 row(f"job from the pixel cache vs bare forward loop ({args.model}, images/s)", f"{job_cache:,.1f}",
                     f"{bare:,.1f}", job_cache / bare),
                 row("turbo vs PIL decode, images/s per worker", f"{rates['turbo']:,.0f}", f"{rates['pil']:,.0f}",
                     rates["turbo"] / rates["pil"])]
    return finish("input_pipeline", headline, problems, args.smoke, console)


if __name__ == "__main__":
    sys.exit(main())
