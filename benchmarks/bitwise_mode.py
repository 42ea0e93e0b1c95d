"""Cost of ``eval.mode=bitwise`` against ``eval.mode=fast``, and the idle time batch alignment adds, all
measured in one run.

    python benchmarks/bitwise_mode.py [--world-sizes 1 2] [--repeats 3] [--batch-size 256]
                                      [--idle-world-size 8] [--idle-batch-size 64] [--quick] [--smoke]

1. Throughput. Every job is a real ``python -m disteval +experiment=fashion_mnist`` subprocess (its own
   ``hydra.run.dir`` in a temporary directory, ``eval.progress=false``) on the full 10,000-image Fashion-MNIST
   test set at batch 256; the figure is results.json's ``throughput.images_per_s`` (samples / forward seconds
   of the slowest rank), median of ``--repeats`` runs (the variants alternate inside each repeat, so drift of
   the machine hits all of them alike). Per world size W, four variants:

   - ``fast``: sample-even shards, the cores shared among local ranks (cores // W threads), running float sums
     (the baseline of the ratios);
   - ``bitwise``: the default: batch-aligned shards, 1 intra-op thread per rank, float sums in a fixed tree
     over global batch indices, per-sample output digests (``eval.record_batches=true``);
   - ``bitwise, no digests``: the same with ``eval.record_batches=false``: digests on / off is the cost of the
     per-sample digests;
   - ``bitwise, threads=cores/W``: the same threads as fast mode (``dist.threads=cores // W``): bitwise with
     these threads / fast is what batch alignment and the tree sum cost; bitwise / this is what the fixed
     thread count costs. Where cores // W = 1 it is the default bitwise job, not run twice.

   Checked (the benchmark exits 1 naming the mismatch, never on a throughput): every run saw the expected
   samples and ran in the requested mode; the default bitwise metrics are identical at every W of the run, in
   every repeat and with digests off; fast mode reports the same metric names (its values may differ in the
   last bits, they are not compared).

2. Idle time of batch alignment at W = ``--idle-world-size`` (8), N = 10,000, batch ``--idle-batch-size`` (64).
   From the shard plan (``disteval.common.ranges.batch_aligned_bounds`` vs ``shard_bounds``): per-rank samples
   and batches, max / mean samples, and the idle rank-seconds as a fraction of the total,
   sum_r(max - n_r) / (W * max) (ranks forward at equal speed and wait for the slowest). Measured by one real
   bitwise run at that W (``data.limit=N``): per-rank forward seconds from results.json, max / mean and the
   same idle fraction with seconds in place of samples. With more ranks than cores the ranks share the cores,
   so the measured per-rank seconds include scheduler contention (the output says so).

``--quick``: 1 repeat and ``data.limit=2000`` everywhere (also N of part 2), a shorter benchmark. ``--smoke``
(seconds): W = 1 and 2, 520 images in batches of 64, 1 repeat; part 2 at W = 2, N = 520, batch 64 (ranks get
5 and 4 batches), measured by part 1's W = 2 bitwise run (a part 2 run that is the same job as a part 1 run
is never run twice). A failing run prints the tail of its stderr and stdout, and the benchmark exits non-zero. Printed: the
throughput table, a ratio table, the batch-alignment table, one JSON line with every number and, last, the
checks' verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FULL_N = 10_000  # Fashion-MNIST test split


class RunFailed(RuntimeError):
    pass


def _tail(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_job(workdir: Path, tag: str, world_size: int, overrides: list[str], expect_samples: int,
            expect_mode: str, timeout: float) -> dict:
    """One ``python -m disteval`` job; returns its results.json (plus ``_wall_s``, the subprocess's wall time).
    Raises RunFailed (with the tail of stderr/stdout) on a non-zero exit, a timeout, a missing results.json, a
    sample count other than ``expect_samples`` or a mode other than ``expect_mode``."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{tag}_", dir=workdir))
    cmd = [sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", "+experiment=fashion_mnist",
           f"dist.world_size={world_size}", "eval.progress=false", *overrides]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    # its own session, so that a timeout ends the launcher and the rank processes it started (one group)
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RunFailed(f"{' '.join(cmd)}\ntimed out after {timeout:.0f} s\n--- stderr tail ---\n{_tail(stderr)}") from None
    wall = time.perf_counter() - t0
    results_path = run_dir / "results.json"
    problem = None
    if proc.returncode != 0:
        problem = f"exit status {proc.returncode}"
    elif not results_path.is_file():
        problem = f"no {results_path}"
    if problem is None:
        res = json.loads(results_path.read_text())
        samples = sum(int(p["samples"]) for p in res["per_rank"])
        mode = res.get("compute", {}).get("mode")
        if samples != expect_samples:
            problem = f"ranks forwarded {samples} samples, expected {expect_samples}"
        elif mode != expect_mode:
            problem = f"ran in mode {mode!r}, expected {expect_mode!r}"
        elif not res["throughput"].get("images_per_s"):
            problem = "no throughput.images_per_s"
    if problem is not None:
        raise RunFailed(f"{' '.join(cmd)}\n{problem}\n--- stderr tail ---\n{_tail(stderr)}"
                        f"\n--- stdout tail ---\n{_tail(stdout, 15)}")
    res["_wall_s"] = wall
    return res


def variants(world_size: int, cores: int) -> dict[str, list[str] | None]:
    """Variant name -> overrides (None: the same job as the default bitwise one, reused)."""
    threads = max(1, cores // world_size)
    return {"fast": ["eval.mode=fast"],
            "bitwise": ["eval.mode=bitwise"],
            "bitwise, no digests": ["eval.mode=bitwise", "eval.record_batches=false"],
            "bitwise, threads=cores/W": None if threads == 1 else ["eval.mode=bitwise", f"dist.threads={threads}"]}


def shard_plan(n: int, batch: int, world_size: int) -> dict:
    """Per-rank samples and batches under batch-aligned and sample-even shards, max/mean samples and the idle
    fraction sum(max - n_r) / (W * max) of each."""
    from disteval.common.ranges import batch_aligned_bounds, num_batches, shard_bounds

    plan = {}
    for name, bounds in (("batch_aligned", lambda r: batch_aligned_bounds(n, batch, world_size, r)),
                         ("sample_even", lambda r: shard_bounds(n, world_size, r))):
        samples = [b - a for a, b in map(bounds, range(world_size))]
        assert sum(samples) == n, (name, samples)
        plan[name] = {"samples": samples, "batches": [num_batches(s, batch) for s in samples],
                      **_imbalance(samples)}
    return plan


def _imbalance(values: list[float]) -> dict:
    """max, mean, max/mean and the idle fraction sum(max - v) / (W * max) of per-rank values."""
    top, mean = max(values), statistics.fmean(values)
    idle = sum(top - v for v in values) / (len(values) * top) if top > 0 else 0.0
    return {"max": top, "mean": mean, "max_over_mean": top / mean if mean > 0 else float("nan"),
            "idle_fraction": idle}


SMOKE = {"world_sizes": [1, 2], "repeats": 1, "batch_size": 64, "limit": 520, "idle_world_size": 2,
         "idle_batch_size": 64, "idle_samples": 520}


def parse_args() -> argparse.Namespace:
    """The command line, with ``--quick`` and ``--smoke`` applied; ``limit`` and ``idle_samples`` become the
    sample counts of parts 1 and 2 (at most the 10,000 of the test split)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="data.limit of part 1 (default: all 10,000)")
    ap.add_argument("--idle-world-size", type=int, default=8)
    ap.add_argument("--idle-batch-size", type=int, default=64)
    ap.add_argument("--idle-samples", type=int, default=FULL_N, help="N of part 2")
    ap.add_argument("--skip-idle-run", action="store_true", help="part 2 from the shard plan only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per disteval run")
    ap.add_argument("--quick", action="store_true", help="1 repeat, data.limit=2000 (a shorter benchmark)")
    ap.add_argument("--smoke", action="store_true", help="W=1 2, 520 images in batches of 64, 1 repeat; part 2 "
                                                         "at W=2 from the same runs (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.limit, args.idle_samples = 1, 2000, 2000
    if args.smoke:
        vars(args).update(SMOKE)
    args.limit = min(args.limit, FULL_N) if args.limit else FULL_N
    args.idle_samples = min(args.idle_samples, FULL_N)
    return args


def run_part1(args, workdir: Path, cores: int, console) -> dict[tuple[int, str], list[dict]]:
    """Every variant at every W, ``--repeats`` times (variants alternate): {(W, variant): [results]}.
    Raises RunFailed."""
    n = args.limit
    common = [f"data.batch_size={args.batch_size}", *([f"data.limit={n}"] if n < FULL_N else [])]
    runs: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for w in args.world_sizes:
            for name, overrides in variants(w, cores).items():
                if overrides is None:
                    continue
                mode = "fast" if "eval.mode=fast" in overrides else "bitwise"
                res = run_job(workdir, f"w{w}_{mode}", w, [*common, *overrides], n, mode, args.timeout)
                runs.setdefault((w, name), []).append(res)
                console.print(f"  repeat {rep + 1}/{args.repeats}  W={w}  {name:<26} "
                              f"{res['throughput']['images_per_s']:8.0f} images/s  "
                              f"(threads {res['compute']['threads']}, job {res['_wall_s']:.1f} s)")
    return runs


def run_idle(args, workdir: Path, runs: dict, cores: int, console) -> dict | None:
    """Part 2's measured run: None with --skip-idle-run, part 1's default bitwise run where it is the same
    job (same W, batch and N), else one new bitwise run. Raises RunFailed."""
    iw, ib, idle_n = args.idle_world_size, args.idle_batch_size, args.idle_samples
    if args.skip_idle_run:
        return None
    if (iw, "bitwise") in runs and (ib, idle_n) == (args.batch_size, args.limit):
        console.print(f"  W={iw} bitwise, {idle_n:,} images, batch {ib}: part 1's run")
        return runs[(iw, "bitwise")][0]
    console.print(f"  W={iw} bitwise, {idle_n:,} images, batch {ib} ({iw} ranks on {cores} cores) ...")
    return run_job(workdir, f"w{iw}_idle", iw, ["eval.mode=bitwise", f"data.batch_size={ib}", f"data.limit={idle_n}"],
                   idle_n, "bitwise", args.timeout)


def medians(args, runs: dict, cores: int) -> dict:
    """{W: {variant: {images_per_s (median), runs, threads, same_job_as}, "ratios": {...}}}."""
    out: dict = {}
    for w in args.world_sizes:
        med = out[str(w)] = {}
        for name, overrides in variants(w, cores).items():
            rs = runs[(w, "bitwise" if overrides is None else name)]
            ips = [r["throughput"]["images_per_s"] for r in rs]
            med[name] = {"images_per_s": statistics.median(ips), "runs": ips, "threads": rs[0]["compute"]["threads"],
                         "same_job_as": "bitwise" if overrides is None else None}
        ips = {name: v["images_per_s"] for name, v in med.items()}
        med["ratios"] = {"bitwise/fast": ips["bitwise"] / ips["fast"],
                         "bitwise_threads_cores_over_W/fast": ips["bitwise, threads=cores/W"] / ips["fast"],
                         "bitwise/bitwise_threads_cores_over_W": ips["bitwise"] / ips["bitwise, threads=cores/W"],
                         "digests_on/off": ips["bitwise"] / ips["bitwise, no digests"]}
    return out


def throughput_table(args, med: dict, n: int):
    """Part 1: one row per W and variant: threads, median and range of images/s, ratios to fast and bitwise."""
    from rich.table import Table

    table = Table(title=f"throughput, fashion-mnist {n:,} images, batch {args.batch_size} "
                        f"(median of {args.repeats}, results.json throughput.images_per_s)")
    table.caption = ("x/fast, x/bitwise: throughput relative to fast mode's and default bitwise's at the same W "
                     "(< 1 = slower); threads: intra-op threads per rank")
    for col in ("W", "variant", "threads", "images/s", "min - max", "x/fast", "x/bitwise"):
        table.add_column(col, justify="left" if col == "variant" else "right", no_wrap=True)
    for w in args.world_sizes:
        m = med[str(w)]
        for name, v in m.items():
            if name == "ratios":
                continue
            table.add_row(str(w), name + (" (= bitwise)" if v["same_job_as"] else ""), str(v["threads"]),
                          f"{v['images_per_s']:,.0f}", f"{min(v['runs']):,.0f} - {max(v['runs']):,.0f}",
                          f"{v['images_per_s'] / m['fast']['images_per_s']:.2f}x",
                          f"{v['images_per_s'] / m['bitwise']['images_per_s']:.2f}x")
        if w != args.world_sizes[-1]:
            table.add_section()
    return table


def ratio_table(world_sizes: list[int], med: dict):
    """Part 1: the four ratios of median throughput per W."""
    from rich.table import Table

    ratios = Table(title="ratios of median throughput (< 1: the first is slower)")
    ratios.add_column("W", justify="right")
    for col, what in (("bitwise / fast", "the whole bitwise default"),
                      ("bitwise thr=cores/W / fast", "alignment + tree sum"),
                      ("bitwise / bitwise thr=cores/W", "fixed 1 thread"),
                      ("digests on / off", "per-sample digests")):
        ratios.add_column(f"{col}\n({what})", justify="right")
    for w in world_sizes:
        r = med[str(w)]["ratios"]
        ratios.add_row(str(w), *(f"{r[k]:.2f}x" for k in ("bitwise/fast", "bitwise_threads_cores_over_W/fast",
                                                           "bitwise/bitwise_threads_cores_over_W", "digests_on/off")))
    return ratios


def _metrics(res: dict) -> str:
    """A run's metrics as canonical JSON (compared bit for bit)."""
    return json.dumps(res["metrics"], sort_keys=True)


def check_metrics(world_sizes: list[int], runs: dict) -> list[str]:
    """Mismatches of part 1's metrics: default bitwise identical at every W and in every repeat, digests
    off identical to on, fast mode reporting the same metric names (its float sums may differ in the last
    bits, so its values are not compared)."""
    problems = []
    ref_w = world_sizes[0]
    ref = _metrics(runs[(ref_w, "bitwise")][0])
    for w in world_sizes:
        for name in ("bitwise", "bitwise, no digests"):
            for k, res in enumerate(runs[(w, name)]):
                if _metrics(res) != ref:
                    problems.append(f"W={w} {name} (repeat {k + 1}): metrics differ from W={ref_w} bitwise's: "
                                    f"{_metrics(res)} != {ref}")
        for k, res in enumerate(runs[(w, "fast")]):
            if sorted(res["metrics"]) != sorted(json.loads(ref)):
                problems.append(f"W={w} fast (repeat {k + 1}): metric names {sorted(res['metrics'])} differ from "
                                f"bitwise's {sorted(json.loads(ref))}")
    return problems


def idle_part(args, idle_n: int, idle_res: dict | None, cores: int) -> tuple[dict, list[str]]:
    """Part 2's figures: the shard plan and, from the measured run, per-rank forward seconds and their
    imbalance; mismatches: the run's per-rank samples must be the plan's."""
    iw, ib = args.idle_world_size, args.idle_batch_size
    plan = shard_plan(idle_n, ib, iw)
    part2 = {"world_size": iw, "samples": idle_n, "batch_size": ib, "plan": plan}
    if idle_res is None:
        return part2, []
    per = sorted(idle_res["per_rank"], key=lambda p: p["rank"])
    secs = [float(p["seconds"]["forward"]) for p in per]
    part2["measured"] = {"forward_seconds": secs, "samples": [p["samples"] for p in per],
                         "batches": [p.get("batches") for p in per],
                         "images_per_s": idle_res["throughput"]["images_per_s"],
                         "threads": idle_res["compute"]["threads"], "cores": cores, **_imbalance(secs)}
    want = plan["batch_aligned"]["samples"]
    got = part2["measured"]["samples"]
    return part2, ([] if got == want else [f"W={iw}: ranks evaluated {got} samples, the shard plan says {want}"])


def idle_table(part2: dict, cores: int):
    """Part 2: per rank the plan's samples and batches (aligned, even) and the measured forward seconds."""
    from rich.table import Table

    iw, idle_n, ib, plan = part2["world_size"], part2["samples"], part2["batch_size"], part2["plan"]
    measured = part2.get("measured")
    idle = Table(title=f"batch alignment at W={iw}, N={idle_n:,}, batch {ib}: shard plan"
                       + ("" if measured is None else " and one measured bitwise run"))
    idle.caption = ("idle fraction = sum_r(max - x_r) / (W * max): rank-time spent waiting for the slowest rank, "
                    "x = samples (plan) or forward seconds (measured)"
                    + ("" if measured is None or iw <= cores else
                       f"; the measured run has {iw} ranks on {cores} cores (oversubscribed {iw / cores:g}x): its "
                       "per-rank seconds include waiting for a core, so they are noisy"))
    for col in ("rank", "aligned samples", "aligned batches", "even samples", "even batches"):
        idle.add_column(col, justify="right")
    if measured is not None:
        idle.add_column("measured forward s", justify="right")
    a, e = plan["batch_aligned"], plan["sample_even"]
    rows = [[str(r), str(a["samples"][r]), str(a["batches"][r]), str(e["samples"][r]), str(e["batches"][r])]
            for r in range(iw)]
    tail = [["max/mean", f"{a['max_over_mean']:.4f}", "", f"{e['max_over_mean']:.4f}", ""],
            ["idle", f"{a['idle_fraction']:.2%}", "", f"{e['idle_fraction']:.2%}", ""]]
    if measured is not None:
        for r, row in enumerate(rows):
            row.append(f"{measured['forward_seconds'][r]:.2f}")
        tail[0].append(f"{measured['max_over_mean']:.3f}")
        tail[1].append(f"{measured['idle_fraction']:.2%}")
    for row in rows:
        idle.add_row(*row)
    idle.add_section()
    for row in tail:
        idle.add_row(*row)
    return idle


def main() -> int:
    """Run both parts, print the tables and the JSON line; 1 on a failed run or a mismatch."""
    args = parse_args()
    n, idle_n = args.limit, args.idle_samples

    from rich.console import Console

    console = Console(width=max(Console().width, 150))
    cores = os.cpu_count() or 1
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bitwise_mode_bench_") as tmp:
            console.print(f"fashion-mnist, {n:,} images, batch {args.batch_size}, {cores} cores, "
                          f"world sizes {args.world_sizes}, {args.repeats} repeat(s)")
            runs = run_part1(args, Path(tmp), cores, console)
            idle_res = run_idle(args, Path(tmp), runs, cores, console)
    except RunFailed as e:
        console.print(f"[bold red]disteval run failed[/]: {e}", markup=True, highlight=False)
        return 1

    med = medians(args, runs, cores)
    console.print(throughput_table(args, med, n))
    console.print(ratio_table(args.world_sizes, med))
    problems = check_metrics(args.world_sizes, runs)
    console.print(f"default bitwise metrics identical at W = {args.world_sizes} and with digests off: "
                  f"{'NO' if problems else 'yes'}")
    part2, idle_problems = idle_part(args, idle_n, idle_res, cores)
    problems += idle_problems
    console.print(idle_table(part2, cores))
    if part2.get("measured") and args.idle_world_size > cores:
        console.print(f"note: {args.idle_world_size} ranks on {cores} cores: the measured seconds mix the shard "
                      "imbalance with contention for the cores; the plan's idle fraction is the imbalance alone.")
    summary = {"config": {"samples": n, "batch_size": args.batch_size, "cores": cores, "repeats": args.repeats,
                          "world_sizes": args.world_sizes}, "throughput": med,
               "bitwise_metrics_identical_across_W": not any("metrics differ" in p for p in problems),
               "idle": part2, "seconds": time.perf_counter() - t_start, "problems": problems}
    console.print(f"benchmark wall time {summary['seconds']:.0f} s")
    print(json.dumps(summary, sort_keys=True))
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    from _summary import row, write

    headline = [row(f"bitwise mode at W={w}: images/s vs fast mode (fashion-mnist, batch {args.batch_size})",
                    f"{med[str(w)]['bitwise']['images_per_s']:,.0f}", f"{med[str(w)]['fast']['images_per_s']:,.0f}",
                    med[str(w)]["ratios"]["bitwise/fast"]) for w in args.world_sizes]
    write("bitwise_mode", headline, args.smoke or args.quick or args.limit != FULL_N)
    console.print("checks passed: every run saw its samples in its mode, bitwise metrics identical at every W "
                  "(digests on and off), part 2's ranks evaluated the plan's samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
