"""Cost of durable progress (``eval.journal``, ``disteval.rank.journal``), measured in one run against the same
job with the journal off.

    python benchmarks/journal.py [--world-sizes 1 2] [--repeats 3] [--batch-size 256] [--smoke]

Every job is a real ``python -m disteval +experiment=fashion_mnist`` subprocess (own ``hydra.run.dir`` in a
temporary directory, ``eval.progress=false``) on the 10,000-image Fashion-MNIST test set; the figure is
results.json's ``throughput.images_per_s`` (samples / forward seconds of the slowest rank, which include the
journal's writes), median of ``--repeats`` runs, the variants alternating inside each repeat. Variants per
world size: ``off`` (``eval.journal.enabled=false``, the baseline), ``default`` (a window every 50 batches or 30
s) and ``every batch`` (``every_batches=1``: the most a user can ask for). Printed: images/s, the ratio to
``off``, windows and bytes written and the seconds spent writing (the slowest rank's), one JSON line, then
the checks' verdict. Checked (exit 1 naming the mismatch, never on a time): metrics ``==`` across variants and
world sizes, and every sample recorded when the journal is on. ``--smoke``: W = 1, 520 images, 1 repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS = {"off": ["eval.journal.enabled=false"], "default": [], "every batch": ["eval.journal.every_batches=1"]}


def run_job(run_dir: Path, world_size: int, batch_size: int, limit: int | None, extra: list[str]) -> dict:
    """One ``python -m disteval`` job; its results.json. Raises SystemExit with the job's output on failure."""
    args = [sys.executable, "-m", "disteval", "+experiment=fashion_mnist", f"hydra.run.dir={run_dir}",
            f"dist.world_size={world_size}", f"data.batch_size={batch_size}", "eval.progress=false", *extra]
    if limit:
        args.append(f"data.limit={limit}")
    proc = subprocess.run(args, cwd=run_dir.parent, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(args[3:])}):\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
    return json.loads((run_dir / "results.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    limit = None
    if args.smoke:
        args.world_sizes, args.repeats, args.batch_size, limit = [1], 1, 64, 520
    rows, problems, metrics = [], [], {}
    with tempfile.TemporaryDirectory(prefix="disteval-journal-bench-") as tmp:
        for w in args.world_sizes:
            seen: dict[str, list] = {name: [] for name in VARIANTS}
            for rep in range(args.repeats):
                for name, extra in VARIANTS.items():
                    res = run_job(Path(tmp) / f"w{w}-{name.replace(' ', '_')}-{rep}", w, args.batch_size, limit, extra)
                    seen[name].append(res)
                    metrics.setdefault("reference", res["metrics"])
                    if res["metrics"] != metrics["reference"]:
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
    print(f"journal cost: fashion-mnist, {limit or 10_000} images, batch {args.batch_size}, median of {args.repeats}")
    print(f"{'W':>3} {'variant':<12} {'images/s':>10} {'/ off':>7} {'windows':>8} {'bytes':>10} {'s writing':>10}")
    for r in rows:
        print(f"{r['world_size']:>3} {r['variant']:<12} {r['images_per_s']:>10,.0f} {r['ratio_to_off']:>7.3f} "
              f"{r['windows']:>8} {r['bytes']:>10,} {r['seconds_writing']:>10.4f}")
    print(json.dumps({"rows": rows}))
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if problems:
        return 1
    print("checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
