"""Cost of durable progress (``eval.journal``, ``disteval.rank.journal``), measured in one run against the same
job with the journal off, and the work a resume saves.

    python benchmarks/journal.py [--data fashion|imagenet] [--world-sizes 1 2] [--repeats 3] [--batch-size 256]
                                 [--kill-at 0.8] [--smoke]

Every job is a real ``python -m disteval`` subprocess (own ``hydra.run.dir`` in a temporary directory,
``eval.progress=false``): ``--data fashion`` the shipped CNN on the 10,000-image Fashion-MNIST test set;
``--data imagenet`` ``--model`` (random weights) on the 1000 ImageNet sample images of
../shared/data/imagenet-sample-224 (decoded from JPEG, resized and cropped in the loader), the ImageFolder view
made by scripts/imagenet_sample_tree.py. The cost figure is results.json's ``throughput.images_per_s``
(samples / forward seconds of the slowest rank, which include the journal's writes), median of ``--repeats``
runs, the variants alternating inside each repeat. Variants per world size: ``off``
(``eval.journal.enabled=false``, the baseline), ``default`` (a window every 50 batches or 30 s) and ``every
batch`` (``every_batches=1``: the most a user can ask for). Printed: images/s, the ratio to ``off``, windows and
bytes written and the seconds spent writing (the slowest rank's).

Work saved (at the first world size): the job killed (SIGKILL of rank 0) when ``--kill-at`` of its batches are
done, with a window every tenth of the batches, then resumed with ``eval.resume``; printed: the resumed run's
forward seconds and wall seconds (the process, start-up included) as ratios to an uninterrupted run's, and the
samples it added from records. One JSON line, then the checks' verdict. Checked (exit 1 naming the mismatch,
never on a time): metrics ``==`` across variants, world sizes and the resumed run, every sample recorded when
the journal is on, the resumed run evaluating only what was not recorded. ``--smoke``: Fashion-MNIST, W = 1,
520 images, 1 repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SAMPLE = REPO.parent / "shared" / "data" / "imagenet-sample-224"

VARIANTS = {"off": ["eval.journal.enabled=false"], "default": [], "every batch": ["eval.journal.every_batches=1"]}


def job_args(args, data_root: Path | None) -> list[str]:
    """The job's overrides (without world size, run directory and variant)."""
    if args.data == "imagenet":
        return ["data=imagefolder", f"data.root={data_root}", f"model.name={args.model}", "model.weights=null",
                "model.num_classes=1000", f"data.batch_size={args.batch_size}", "eval.progress=false",
                "eval.ci.resamples=0"]
    return ["+experiment=fashion_mnist", f"data.batch_size={args.batch_size}", "eval.progress=false",
            *([f"data.limit={args.limit}"] if args.limit else [])]


def run_job(run_dir: Path, world_size: int, job: list[str], extra: list[str], env: dict | None = None,
            ok: bool = True) -> tuple[dict | None, float]:
    """One ``python -m disteval`` job: (its results.json, None when it failed and ``ok`` is False; its wall
    seconds). Raises SystemExit with the job's output when it fails and ``ok``."""
    args = [sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", f"dist.world_size={world_size}", *job,
            *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=run_dir.parent, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        if ok:
            raise SystemExit(f"job failed ({' '.join(args[3:])}):\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
        return None, wall
    return json.loads((run_dir / "results.json").read_text()), wall


def work_saved(tmp: Path, args, job: list[str], reference: dict, problems: list[str]) -> dict:
    """The job at the first world size uninterrupted, killed at ``--kill-at`` of its batches and resumed: the
    resumed run's forward and wall seconds as ratios to the uninterrupted run's."""
    w = args.world_sizes[0]
    n = int(reference["dataset"]["num_samples"])
    per_rank = -(-n // args.batch_size) // w  # batches of a rank (about)
    every = max(1, per_rank // 10)
    record = [f"eval.journal.every_batches={every}"]
    full, full_wall = run_job(tmp / "saved-full", w, job, record)
    kill = max(1, int(args.kill_at * per_rank)) + 1  # rank 0 dies as its batch `kill` starts
    run_job(tmp / "saved-killed", w, job, record, env={"DISTEVAL_FAULTS": f"kill@0:batch={kill}"}, ok=False)
    resumed, wall = run_job(tmp / "saved-resumed", w, job, [*record, f"eval.resume={tmp / 'saved-killed'}"])
    j = resumed["journal"]
    if resumed["metrics"] != reference["metrics"]:
        problems.append("the resumed run's metrics differ from the uninterrupted run's")
    if j["samples_resumed"] + j["samples_evaluated"] != n or j["samples_resumed"] == 0:
        problems.append(f"the resumed run: {j['samples_resumed']} samples from records, {j['samples_evaluated']} "
                        f"evaluated, of {n}")
    return {"world_size": w, "killed_at_batch": kill - 1, "batches_per_rank": per_rank, "every_batches": every,
            "samples_resumed": j["samples_resumed"], "samples_evaluated": j["samples_evaluated"],
            "forward_ratio": resumed["timings"]["forward"] / full["timings"]["forward"],
            "wall_ratio": wall / full_wall, "wall_s": wall, "full_wall_s": full_wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=["fashion", "imagenet"], default="fashion")
    parser.add_argument("--model", default="resnet18", help="--data imagenet: a torchvision model (random weights)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None, help="default 256 (fashion), 32 (imagenet)")
    parser.add_argument("--kill-at", type=float, default=0.8, help="share of the batches done when the run dies")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.limit = None
    args.batch_size = args.batch_size or (32 if args.data == "imagenet" else 256)
    if args.smoke:
        args.data, args.world_sizes, args.repeats, args.batch_size, args.limit = "fashion", [1], 1, 64, 520
    rows, problems, metrics = [], [], {}
    with tempfile.TemporaryDirectory(prefix="disteval-journal-bench-") as tmp:
        root = None
        if args.data == "imagenet":
            if not SAMPLE.is_dir():
                print(f"problem: --data imagenet needs the ImageNet sample at {SAMPLE}")
                return 1
            sys.path.insert(0, str(REPO / "scripts"))
            from imagenet_sample_tree import make_tree

            root = Path(tmp) / "tree"
            make_tree(SAMPLE, root)
        job = job_args(args, root)
        for w in args.world_sizes:
            seen: dict[str, list] = {name: [] for name in VARIANTS}
            for rep in range(args.repeats):
                for name, extra in VARIANTS.items():
                    res, _ = run_job(Path(tmp) / f"w{w}-{name.replace(' ', '_')}-{rep}", w, job, extra)
                    seen[name].append(res)
                    metrics.setdefault("reference", res)
                    if res["metrics"] != metrics["reference"]["metrics"]:
                        problems.append(f"W={w} {name} repeat {rep}: metrics differ from the first run's")
                    j = res["journal"]
                    if name != "off" and j["samples_recorded"] != res["coverage"]["num_samples"]:
                        problems.append(f"W={w} {name}: {j['samples_recorded']} of {res['num_samples']} samples recorded")
            base = statistics.median(r["throughput"]["images_per_s"] for r in seen["off"])
            for name, runs in seen.items():
                ips = statistics.median(r["throughput"]["images_per_s"] for r in runs)
                j = runs[-1]["journal"]
                rows.append({"world_size": w, "variant": name, "images_per_s": ips, "ratio_to_off": ips / base,
                             "windows": j["windows_recorded"], "seconds_writing": j["seconds_writing"],
                             "bytes": sum(p.stat().st_size for p in (Path(tmp) / f"w{w}-{name.replace(' ', '_')}-"
                                          f"{args.repeats - 1}").glob("ranks/rank*/journal/*.pt"))})
        saved = work_saved(Path(tmp), args, job, metrics["reference"], problems)
    n = metrics["reference"]["dataset"]["num_samples"]
    print(f"journal cost: {args.data} ({args.model + ', ' if args.data == 'imagenet' else ''}{n} images), batch "
          f"{args.batch_size}, median of {args.repeats}")
    print(f"{'W':>3} {'variant':<12} {'images/s':>10} {'/ off':>7} {'windows':>8} {'bytes':>10} {'s writing':>10}")
    for r in rows:
        print(f"{r['world_size']:>3} {r['variant']:<12} {r['images_per_s']:>10,.0f} {r['ratio_to_off']:>7.3f} "
              f"{r['windows']:>8} {r['bytes']:>10,} {r['seconds_writing']:>10.4f}")
    print(f"work saved: W={saved['world_size']}, killed after batch {saved['killed_at_batch']} of "
          f"{saved['batches_per_rank']} (a window every {saved['every_batches']} batches); the resume added "
          f"{saved['samples_resumed']} samples from records and evaluated {saved['samples_evaluated']}: forward "
          f"{saved['forward_ratio']:.2f}x, wall {saved['wall_ratio']:.2f}x of the uninterrupted run "
          f"({saved['wall_s']:.1f} s vs {saved['full_wall_s']:.1f} s, start-up included)")
    print(json.dumps({"rows": rows, "work_saved": saved}))
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if problems:
        return 1
    print("checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
