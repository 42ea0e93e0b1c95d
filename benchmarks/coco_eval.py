"""COCO detection evaluation: pycocotools and faster-coco-eval (the baselines) against disteval, on a synthetic
COCO set, all measured in one run.

    python benchmarks/coco_eval.py [--images 5000] [--categories 80] [--dets-per-image 100] [--seed 0]
                                   [--world-sizes 1 2 4] [--iou-type bbox|segm] [--skip-pycocotools]

The set is made by ``disteval.data.coco_synthetic.make_synthetic_coco`` in a temporary directory (default:
5000 images, 80 categories, ~7 ground-truth boxes and 100 detections per image, seed 0; crowds, empty images,
exact score ties, degenerate boxes, small/medium/large objects). Each baseline library runs in its own fresh
process (multiprocessing, spawn), which measures:

- load: wall time of ``COCO(gt_json)`` + ``loadRes(results_json)`` (both parse the JSON files);
- eval: wall time of ``evaluate()`` + ``accumulate()`` (faster-coco-eval does both in one C++ call inside
  evaluate(); only their sum is comparable);
- summarize: wall time of ``summarize()`` (its printing silenced), and the 12 ``COCOeval.stats``;
- peak RSS increase (MiB) of each phase: the process's RSS high-water mark (VmHWM, /proc/self/status, reset
  through /proc/self/clear_refs before each phase) above the RSS when the phase began, and the overall peak
  above the RSS before loading. Without clear_refs the overall peak falls back to ru_maxrss.

``run_disteval`` (one call per ``--world-sizes`` entry) is disteval's own COCO evaluation; until it exists the
script prints "disteval: not available yet" and the baselines alone. Printed: one table with the times, the
memory and the time ratios (total and eval, relative to faster-coco-eval and to pycocotools), one table of the
12 stats per method, and the largest absolute difference between the two libraries' stats (and between
disteval's and pycocotools').
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import io
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAT_NAMES = ["AP", "AP50", "AP75", "AP small", "AP medium", "AP large",
              "AR@1", "AR@10", "AR@100", "AR small", "AR medium", "AR large"]
LIBRARIES = ("faster-coco-eval", "pycocotools")


def run_disteval(gt_path: Path, dt_path: Path, iou_type: str, world_size: int) -> dict:
    """disteval's COCO evaluation of ``dt_path`` against ``gt_path`` on ``world_size`` real ranks (gloo,
    torch.distributed.elastic; one rank is one process also at W = 1).

    Each rank reads both JSON files (``load_seconds``), then, timed from a barrier: matches the images of its
    shard, the records go to rank 0 (one gather), rank 0 accumulates and summarizes (``eval_seconds``, rank
    0's clock, which waits for the slowest rank). ``peak_rss_mib``: the largest peak RSS increase of any rank
    during the evaluation (after loading)."""
    from launchers.local import launch

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch(disteval_worker, (str(gt_path), str(dt_path), iou_type), world_size, tmp)
    r0 = per_rank[0]
    return {"stats": r0["stats"], "eval_seconds": r0["eval_seconds"],
            "load_seconds": max(r["load_seconds"] for r in per_rank.values()),
            "summarize_seconds": 0.0,  # included in eval_seconds (compute() accumulates and summarizes)
            "peak_rss_mib": max(r["eval_peak_mib"] for r in per_rank.values())}


def disteval_worker(gt_path: str, dt_path: str, iou_type: str) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
    from disteval.data.coco import load_detections, load_ground_truth
    from disteval.data.sharding import shard_bounds
    from disteval.metrics.evaluator import Evaluator
    from disteval.sync import synchronise
    from disteval.metrics.coco_eval import STAT_NAMES as NAMES
    from disteval.metrics.detection import CocoDetectionMetric

    env = RankEnv.from_env()
    torch.set_num_threads(1)
    init_process_group("gloo", 600, env)
    try:
        t0 = time.perf_counter()
        gt = load_ground_truth(gt_path)
        dets = load_detections(dt_path, gt, iou_type)
        load = time.perf_counter() - t0
        comm = Communicator()
        gc.collect()
        resettable = _reset_peak()
        rss0 = _status_mib("VmRSS") or _maxrss_mib()
        dist.barrier()
        t1 = time.perf_counter()
        start, end = shard_bounds(gt.num_images, env.world_size, env.rank)
        images = np.arange(start, end)
        metric = CocoDetectionMetric(gt, iou_type)
        metric.add_detections(images, dets.select(images))
        ev = Evaluator(metric)
        ev.coverage.update(torch.from_numpy(images))
        synchronise(ev, comm, {})
        stats = None
        if env.rank == 0:
            out = metric.compute()
            stats = [out[k] for k in NAMES]
        elapsed = time.perf_counter() - t1
        peak = ((_status_mib("VmHWM") or _maxrss_mib()) - rss0) if resettable else float("nan")
        return {"stats": stats, "eval_seconds": elapsed, "load_seconds": load, "eval_peak_mib": peak}
    finally:
        destroy_process_group()


# --------------------------------------------------------------------------------------------- memory helpers
def _status_mib(field: str) -> float | None:
    """A 'kB' field of /proc/self/status (VmRSS, VmHWM) in MiB, None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) to the current RSS; False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------- baselines
def measure_baseline(library: str, gt_path: str, dt_path: str, iou_type: str) -> dict:
    """Run one library's load / evaluate+accumulate / summarize in this (fresh) process; times and peak RSS."""
    if library == "pycocotools":
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval as Evaluator
    elif library == "faster-coco-eval":
        from faster_coco_eval import COCO
        from faster_coco_eval import COCOeval_faster as Evaluator
    else:
        raise ValueError(library)
    gc.collect()
    sink = io.StringIO()
    resettable = _reset_peak()
    rss_start = _status_mib("VmRSS") or _maxrss_mib()
    with contextlib.redirect_stdout(sink):
        t0 = time.perf_counter()
        gt = COCO(gt_path)
        dt = gt.loadRes(dt_path)
        t1 = time.perf_counter()
        rss_loaded = _status_mib("VmRSS") or _maxrss_mib()
        load_peak = (_status_mib("VmHWM") or _maxrss_mib()) - rss_start
        _reset_peak()
        evaluator = Evaluator(gt, dt, iou_type)
        evaluator.evaluate()
        evaluator.accumulate()
        t2 = time.perf_counter()
        eval_peak = (_status_mib("VmHWM") or _maxrss_mib()) - rss_loaded
        evaluator.summarize()
        t3 = time.perf_counter()
    if resettable:
        overall = max(load_peak, rss_loaded - rss_start + eval_peak)
    else:  # no per-phase reset: only the process-wide high-water mark is meaningful
        overall = _maxrss_mib() - rss_start
        load_peak = eval_peak = float("nan")
    return {"load_seconds": t1 - t0, "eval_seconds": t2 - t1, "summarize_seconds": t3 - t2,
            "load_peak_mib": load_peak, "eval_peak_mib": eval_peak, "peak_rss_mib": overall,
            "loaded_rss_mib": rss_loaded - rss_start, "stats": [float(s) for s in evaluator.stats]}


def _in_fresh_process(fn, *args):
    """fn(*args) in a new spawned interpreter (so its memory figures are its own)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


# --------------------------------------------------------------------------------------------- report
def _fmt(x, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--categories", type=int, default=80)
    ap.add_argument("--gt-per-image", type=float, default=7.0)
    ap.add_argument("--dets-per-image", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iou-type", choices=["bbox", "segm"], default="bbox")
    ap.add_argument("--skip-pycocotools", action="store_true", help="pycocotools is slow on large sets")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from disteval.data.coco_synthetic import make_synthetic_coco

    console = Console(width=max(Console().width, 160))
    libraries = [lib for lib in LIBRARIES if not (args.skip_pycocotools and lib == "pycocotools")]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="coco_eval_bench_") as tmp:
        t0 = time.perf_counter()
        gt_path, dt_path = make_synthetic_coco(tmp, num_images=args.images, num_categories=args.categories,
                                               gt_per_image=args.gt_per_image, dets_per_image=args.dets_per_image,
                                               seed=args.seed, iou_type=args.iou_type)
        gen_seconds = time.perf_counter() - t0
        console.print(f"synthetic COCO ({args.iou_type}): {args.images:,} images, {args.categories} categories, "
                      f"generated in {gen_seconds:.1f} s; ground truth {gt_path.stat().st_size / 2**20:.1f} MiB, "
                      f"results {dt_path.stat().st_size / 2**20:.1f} MiB")
        for lib in libraries:
            console.print(f"measuring {lib} ...")
            rows[lib] = _in_fresh_process(measure_baseline, lib, str(gt_path), str(dt_path), args.iou_type)
        for w in args.world_sizes:
            try:
                rows[f"disteval W={w}"] = run_disteval(gt_path, dt_path, args.iou_type, w)
            except NotImplementedError:
                console.print("disteval: not available yet")
                break

    table = Table(title=f"COCO {args.iou_type} evaluation, {args.images:,} images, {args.categories} categories, "
                        f"{args.dets_per_image} dets/image (each baseline in a fresh process)")
    table.caption = ("eval = evaluate() + accumulate(); total = load + eval + summarize; x/FCE, x/PCT: time "
                     "relative to faster-coco-eval's, pycocotools'; RSS+: peak RSS increase in the phase (MiB)")
    table.add_column("method", no_wrap=True)
    for col in ("load s", "eval s", "summarize s", "total s", "total/FCE", "total/PCT", "eval/FCE",
                "eval/PCT", "RSS+ load", "RSS+ eval", "RSS+ overall"):
        table.add_column(col, justify="right")

    def total(r: dict) -> float:
        return r.get("load_seconds", 0.0) + r["eval_seconds"] + r.get("summarize_seconds", 0.0)

    def ratio(r: dict, ref: str, key) -> str:
        if ref not in rows:
            return "-"
        return f"{key(r) / key(rows[ref]):.2f}x"

    for name, r in rows.items():
        table.add_row(name, _fmt(r.get("load_seconds"), ".3f"), _fmt(r["eval_seconds"], ".3f"),
                      _fmt(r.get("summarize_seconds"), ".3f"), _fmt(total(r), ".3f"),
                      ratio(r, "faster-coco-eval", total), ratio(r, "pycocotools", total),
                      ratio(r, "faster-coco-eval", lambda x: x["eval_seconds"]),
                      ratio(r, "pycocotools", lambda x: x["eval_seconds"]),
                      _fmt(r.get("load_peak_mib"), ".0f"), _fmt(r.get("eval_peak_mib"), ".0f"),
                      _fmt(r.get("peak_rss_mib"), ".0f"))
    console.print(table)

    stats = Table(title="COCOeval.stats")
    stats.add_column("stat")
    for name in rows:
        stats.add_column(name, justify="right")
    for i, stat in enumerate(STAT_NAMES):
        stats.add_row(stat, *(f"{r['stats'][i]:.6f}" for r in rows.values()))
    console.print(stats)

    if all(lib in rows for lib in LIBRARIES):
        diff = max(abs(a - b) for a, b in zip(rows["pycocotools"]["stats"], rows["faster-coco-eval"]["stats"]))
        console.print(f"largest |stats difference| pycocotools vs faster-coco-eval: {diff:.3g}")
    ref = "pycocotools" if "pycocotools" in rows else "faster-coco-eval"
    for name, r in rows.items():
        if name.startswith("disteval"):
            diff = max(abs(a - b) for a, b in zip(rows[ref]["stats"], r["stats"]))
            console.print(f"largest |stats difference| {name} vs {ref}: {diff:.3g}")


if __name__ == "__main__":
    main()
