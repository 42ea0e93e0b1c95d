"""COCO detection evaluation: pycocotools and faster-coco-eval (the baselines) against disteval, on a synthetic
COCO set, all measured in one run.

    python benchmarks/coco_eval.py [--images 5000] [--categories 80] [--dets-per-image 100] [--seed 0]
                                   [--world-sizes 1 2 4] [--iou-type bbox|segm] [--skip-pycocotools] [--smoke]

The set is made by ``disteval.data.coco_synthetic.make_synthetic_coco`` in a temporary directory (default:
5000 images, 80 categories, ~7 ground-truth boxes and 100 detections per image, seed 0; crowds, empty images,
exact score ties, degenerate boxes, small/medium/large objects). Every method runs in fresh processes: each
baseline library in its own spawned process, disteval in the W rank processes of its own launch (gloo,
torch.distributed.elastic; one rank is one process also at W = 1). Measured the same way for every method:

- load: wall time of reading both JSON files (``COCO(gt_json)`` + ``loadRes(results_json)``; disteval, from
  a barrier: ``load_ground_truth`` on every rank, and the results file parsed by rank 0 alone and broadcast
  to the others as compact arrays (``load_detections_shared``); the slowest rank's);
- eval: wall time of ``evaluate()`` + ``accumulate()`` (faster-coco-eval does both in one C++ call inside
  evaluate(); only their sum is comparable); disteval, timed from a barrier on rank 0's clock: matching its
  shard's images, one gather of the records to rank 0, accumulate and summarize;
- summarize: wall time of ``summarize()`` (its printing silenced; disteval's is inside eval), and the 12 stats;
- peak RSS increase (MiB), the same spans for every method: "load" (the peak while reading the JSON files,
  above the RSS before it), "eval" (the peak while evaluating, accumulating and summarizing, above the RSS
  after loading) and "load+eval" (the peak over both, above the RSS before loading); disteval: the largest of
  its ranks. Peaks are the process's RSS high-water mark (VmHWM, /proc/self/status, reset through
  /proc/self/clear_refs before each phase); without clear_refs only load+eval is given (from ru_maxrss).

Checked, and the benchmark exits 1 naming the mismatch (never on a time): disteval's 12 stats equal
pycocotools' exactly at every W (faster-coco-eval's within 1e-10 where pycocotools is skipped) and
faster-coco-eval's equal pycocotools' within 1e-10.

``--smoke``: 40 images, 4 categories, 15 detections per image, W = 1 and 2 (seconds).
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
FCE_TOL = 1e-10  # faster-coco-eval against pycocotools (its float sums may differ in the last bits)
SMOKE = {"images": 40, "categories": 4, "dets_per_image": 15, "world_sizes": [1, 2]}


def run_disteval(gt_path: Path, dt_path: Path, iou_type: str, world_size: int) -> dict:
    """disteval's COCO evaluation of ``dt_path`` against ``gt_path`` on ``world_size`` real ranks (gloo,
    torch.distributed.elastic; fresh processes, also at W = 1). Times and RSS as the module docstring says;
    the RSS figures are the largest of any rank."""
    from launchers.local import launch

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch(disteval_worker, (str(gt_path), str(dt_path), iou_type), world_size, tmp)
    r0 = per_rank[0]
    out = {"stats": r0["stats"], "eval_seconds": r0["eval_seconds"],
           "load_seconds": max(r["load_seconds"] for r in per_rank.values()),
           "summarize_seconds": 0.0}  # included in eval_seconds (compute() accumulates and summarizes)
    for key in ("load_peak_mib", "eval_peak_mib", "peak_rss_mib"):
        out[key] = max(r[key] for r in per_rank.values())
    return out


def disteval_worker(gt_path: str, dt_path: str, iou_type: str) -> dict:
    """One rank, timed from a barrier: read the annotation file and receive the detections (rank 0 parses the
    results file and broadcasts them, ``load_detections_shared``), then (from a second barrier) evaluate its
    shard, sync, rank 0 computes."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
    from disteval.data.coco import load_ground_truth
    from disteval.data.coco_wire import load_detections_shared
    from disteval.data.sharding import shard_bounds
    from disteval.metrics.coco_eval import STAT_NAMES as NAMES
    from disteval.metrics.detection import CocoDetectionMetric
    from disteval.metrics.evaluator import Evaluator
    from disteval.rank.sync import synchronise

    env = RankEnv.from_env()
    torch.set_num_threads(1)
    init_process_group("gloo", 600, env)
    try:
        comm = Communicator()
        mem = PhasePeaks()
        dist.barrier()
        t0 = time.perf_counter()
        gt = load_ground_truth(gt_path)
        share = comm.broadcast_bytes if env.world_size > 1 else None
        dets = load_detections_shared(dt_path, gt, iou_type, env.rank, share)
        load = time.perf_counter() - t0
        mem.loaded()
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
        return {"stats": stats, "eval_seconds": elapsed, "load_seconds": load, **mem.done()}
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
    """The process's lifetime peak RSS (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhasePeaks:
    """Peak RSS increases of the two phases of every method, measured alike: create it just before loading,
    call ``loaded()`` when the files are read and ``done()`` after summarizing. ``done()`` returns
    {load_peak_mib, eval_peak_mib, peak_rss_mib (load+eval)}; the per-phase ones are NaN without clear_refs."""

    def __init__(self) -> None:
        gc.collect()
        self.resettable = _reset_peak()
        self.start = _status_mib("VmRSS") or _maxrss_mib()

    def loaded(self) -> None:
        """End of the load phase: its peak; the eval phase starts (high-water mark reset)."""
        self.rss_loaded = _status_mib("VmRSS") or _maxrss_mib()
        self.load_peak = (_status_mib("VmHWM") or _maxrss_mib()) - self.start
        _reset_peak()

    def done(self) -> dict:
        """End of the eval phase: the three figures (MiB)."""
        if not self.resettable:  # no per-phase reset: only the process-wide high-water mark is meaningful
            nan = float("nan")
            return {"load_peak_mib": nan, "eval_peak_mib": nan, "peak_rss_mib": _maxrss_mib() - self.start}
        eval_peak = (_status_mib("VmHWM") or _maxrss_mib()) - self.rss_loaded
        return {"load_peak_mib": self.load_peak, "eval_peak_mib": eval_peak,
                "peak_rss_mib": max(self.load_peak, self.rss_loaded - self.start + eval_peak)}


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
    with contextlib.redirect_stdout(io.StringIO()):
        mem = PhasePeaks()
        t0 = time.perf_counter()
        gt = COCO(gt_path)
        dt = gt.loadRes(dt_path)
        t1 = time.perf_counter()
        mem.loaded()
        evaluator = Evaluator(gt, dt, iou_type)
        evaluator.evaluate()
        evaluator.accumulate()
        t2 = time.perf_counter()
        evaluator.summarize()
        t3 = time.perf_counter()
        peaks = mem.done()
    return {"load_seconds": t1 - t0, "eval_seconds": t2 - t1, "summarize_seconds": t3 - t2, **peaks,
            "stats": [float(s) for s in evaluator.stats]}


def _in_fresh_process(fn, *args):
    """fn(*args) in a new spawned interpreter (so its memory figures are its own)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


# --------------------------------------------------------------------------------------------- checks
def _max_diff(a: list[float], b: list[float]) -> float:
    """Largest absolute difference of two stats lists (inf when their lengths differ, NaN when one is)."""
    if len(a) != len(b):
        return float("inf")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return float("nan") if any(d != d for d in diffs) else max(diffs, default=0.0)


def check(rows: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(report lines, mismatches): disteval against pycocotools exactly (faster-coco-eval within FCE_TOL when
    pycocotools is skipped), faster-coco-eval against pycocotools within FCE_TOL."""
    lines, problems = [], []
    ref = "pycocotools" if "pycocotools" in rows else "faster-coco-eval"
    pairs = [(name, ref, 0.0 if ref == "pycocotools" else FCE_TOL) for name in rows if name.startswith("disteval")]
    if all(lib in rows for lib in LIBRARIES):
        pairs.insert(0, ("faster-coco-eval", "pycocotools", FCE_TOL))
    for name, other, tol in pairs:
        diff = _max_diff(rows[name]["stats"], rows[other]["stats"])
        lines.append(f"largest |stats difference| {name} vs {other}: {diff:.3g} (allowed {tol:g})")
        if not diff <= tol:  # also catches NaN
            problems.append(f"{name}'s stats differ from {other}'s by {diff:.3g} (allowed {tol:g})")
    return lines, problems


# --------------------------------------------------------------------------------------------- report
def _fmt(x, spec: str) -> str:
    """``x`` formatted, '-' for None or NaN."""
    return "-" if x is None or x != x else format(x, spec)


def _total(r: dict) -> float:
    """load + eval + summarize seconds of a row."""
    return r.get("load_seconds", 0.0) + r["eval_seconds"] + r.get("summarize_seconds", 0.0)


def _ratio(rows: dict, r: dict, ref: str, key) -> str:
    """key(r) / key(rows[ref]) as 'N.NNx', '-' when ``ref`` was not measured."""
    return f"{key(r) / key(rows[ref]):.2f}x" if ref in rows else "-"


def timing_table(rows: dict, args):
    """Times, time ratios and the three RSS columns of every method."""
    from rich.table import Table

    table = Table(title=f"COCO {args.iou_type} evaluation, {args.images:,} images, {args.categories} categories, "
                        f"{args.dets_per_image} dets/image (every method in fresh processes)")
    table.caption = ("eval = evaluate() + accumulate() (disteval: + summarize); total = load + eval + summarize; "
                     "x/FCE, x/PCT: time relative to faster-coco-eval's, pycocotools'. RSS+ (MiB), the same spans "
                     "for every method: peak RSS increase while loading, while evaluating + accumulating + "
                     "summarizing, and over both (above the RSS before loading); disteval: its largest rank")
    table.add_column("method", no_wrap=True)
    for col in ("load s", "eval s", "summarize s", "total s", "total/FCE", "total/PCT", "eval/FCE",
                "eval/PCT", "RSS+ load", "RSS+ eval", "RSS+ load+eval"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, _fmt(r.get("load_seconds"), ".3f"), _fmt(r["eval_seconds"], ".3f"),
                      _fmt(r.get("summarize_seconds"), ".3f"), _fmt(_total(r), ".3f"),
                      _ratio(rows, r, "faster-coco-eval", _total), _ratio(rows, r, "pycocotools", _total),
                      _ratio(rows, r, "faster-coco-eval", lambda x: x["eval_seconds"]),
                      _ratio(rows, r, "pycocotools", lambda x: x["eval_seconds"]),
                      _fmt(r.get("load_peak_mib"), ".0f"), _fmt(r.get("eval_peak_mib"), ".0f"),
                      _fmt(r.get("peak_rss_mib"), ".0f"))
    return table


def stats_table(rows: dict):
    """The 12 stats of every method."""
    from rich.table import Table

    stats = Table(title="COCOeval.stats")
    stats.add_column("stat")
    for name in rows:
        stats.add_column(name, justify="right")
    for i, stat in enumerate(STAT_NAMES):
        stats.add_row(stat, *(f"{r['stats'][i]:.6f}" if i < len(r["stats"]) else "-" for r in rows.values()))
    return stats


def measure_all(args, console) -> dict[str, dict]:
    """Generate the set, then every method's figures: {method: row}."""
    from disteval.data.coco_synthetic import make_synthetic_coco

    libraries = [lib for lib in LIBRARIES if not (args.skip_pycocotools and lib == "pycocotools")]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="coco_eval_bench_") as tmp:
        t0 = time.perf_counter()
        gt_path, dt_path = make_synthetic_coco(tmp, num_images=args.images, num_categories=args.categories,
                                               gt_per_image=args.gt_per_image, dets_per_image=args.dets_per_image,
                                               seed=args.seed, iou_type=args.iou_type)
        console.print(f"synthetic COCO ({args.iou_type}): {args.images:,} images, {args.categories} categories, "
                      f"generated in {time.perf_counter() - t0:.1f} s; ground truth "
                      f"{gt_path.stat().st_size / 2**20:.1f} MiB, results {dt_path.stat().st_size / 2**20:.1f} MiB")
        for lib in libraries:
            console.print(f"measuring {lib} ...")
            rows[lib] = _in_fresh_process(measure_baseline, lib, str(gt_path), str(dt_path), args.iou_type)
        for w in args.world_sizes:
            console.print(f"measuring disteval W={w} ...")
            rows[f"disteval W={w}"] = run_disteval(gt_path, dt_path, args.iou_type, w)
    return rows


def headline(rows: dict) -> list[dict]:
    """Headline rows: disteval's load + evaluate + summarize time and peak RSS against faster-coco-eval's (issue
    targets: time <= 0.5x at W=1 and <= 0.33x at W=4, RSS no higher) and its evaluation against pycocotools'."""
    from _summary import row

    out = []
    fce, pct = rows.get("faster-coco-eval"), rows.get("pycocotools")
    for name, r in rows.items():
        if not name.startswith("disteval") or fce is None:
            continue
        out.append(row(f"COCO bbox 5k images: load + evaluate + summarize (s), {name} vs faster-coco-eval",
                       f"{_total(r):.2f}", f"{_total(fce):.2f}", _total(r) / _total(fce)))
        if r.get("peak_rss_mib") is not None and fce.get("peak_rss_mib"):
            out.append(row(f"COCO bbox 5k images: peak RSS increase (MiB), {name} largest rank vs faster-coco-eval",
                           f"{r['peak_rss_mib']:.0f}", f"{fce['peak_rss_mib']:.0f}",
                           r["peak_rss_mib"] / fce["peak_rss_mib"]))
    first = rows.get("disteval W=1")
    if first is not None and pct is not None:
        out.append(row("COCO bbox 5k images: evaluate + accumulate (s), disteval W=1 vs pycocotools",
                       f"{first['eval_seconds']:.2f}", f"{pct['eval_seconds']:.2f}",
                       first["eval_seconds"] / pct["eval_seconds"]))
    return out


def main() -> int:
    """Measure every method, print both tables and the checks; 1 on a mismatch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--categories", type=int, default=80)
    ap.add_argument("--gt-per-image", type=float, default=7.0)
    ap.add_argument("--dets-per-image", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iou-type", choices=["bbox", "segm"], default="bbox")
    ap.add_argument("--skip-pycocotools", action="store_true", help="pycocotools is slow on large sets")
    ap.add_argument("--smoke", action="store_true", help="40 images, 4 categories, 15 dets/image, W=1 2 (seconds)")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)

    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    rows = measure_all(args, console)
    console.print(timing_table(rows, args))
    console.print(stats_table(rows))
    lines, problems = check(rows)
    for line in lines:
        console.print(line)
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    from _summary import write

    default = (args.images, args.categories, args.dets_per_image, args.iou_type) == (5000, 80, 100, "bbox")
    write("coco_eval", headline(rows), args.smoke or not default)
    console.print(f"checks passed: the stats of {len(rows)} methods agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
