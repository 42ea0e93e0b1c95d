"""Memory allocator policies (``dist.allocator``) against glibc's default malloc, all measured in one run.

    python benchmarks/allocator.py [--passes 5] [--repeats 2] [--policies system glibc-tuned tcmalloc jemalloc auto]
                                   [--threads 1] [--smoke] [overrides ...]

Per policy, a fresh process is exec'd with the environment ``disteval.common.allocator.resolve`` gives it (the
variables a launcher puts into a rank's environment; LD_PRELOAD, GLIBC_TUNABLES and MALLOC_CONF of this process
are removed first, so ``system`` is glibc as it comes). The process composes the job (default ``+experiment=fashion_mnist``,
the full 10,000-image Fashion-MNIST test set from Debian's dataset-fashion-mnist, batch 256, plus
``overrides``), builds the task's dataset and model as a rank does, and evaluates the whole dataset
``--passes`` times in bitwise mode with ``--threads`` intra-op threads (1: a bitwise rank's default), a fresh
metric per pass. Per pass it measures the minor page faults (``resource.getrusage`` ``ru_minflt`` delta) and
the wall time of the loop. The policies alternate inside each of ``--repeats`` rounds (a new process per
policy and round: an identical process under glibc's malloc was seen to be randomly 1.5x slow or fast, so one
process per policy says little), and the first pass of every process (warm-up) is left out of the figures.

Printed per policy: the allocator in force in its processes (``in_force()``: the libraries mapped, the
tunables it was exec'd with), the median minor page faults per pass, the median images/s, the images/s of the
slowest and fastest process, and both ratios to ``system``; then one JSON line with every number and, last,
the checks' verdict.

Checked (the benchmark exits 1 printing MISMATCH and what differs, never on a speed): every pass of every
process evaluated every sample once; every policy's metric values are identical (==) to ``system``'s, in every
pass and round; the allocator in force in every process is the one its policy resolved to (``auto``: what
``resolve("auto")`` picked). A policy whose library is not installed is listed as skipped.

``--smoke`` (seconds): 2 passes, 1 round, 512 images in batches of 64 (Fashion-MNIST when installed, else the
default digits job).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FASHION_ROOT = Path("/usr/share/datasets/fashion-mnist")
POLICY_ORDER = ("system", "glibc-tuned", "tcmalloc", "jemalloc", "auto")
CLEARED = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF")


def _job(overrides: list[str]):
    """The composed job (``overrides`` on conf/config.yaml) as an OmegaConf node of plain values."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from disteval.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def worker(spec: dict) -> dict:
    """Inside the policy's process: evaluate the job ``spec["passes"]`` times; {in_force, num_samples,
    passes [{seconds, minflt, samples}], metrics [per pass]}."""
    import torch

    from disteval import precision as prec
    from disteval.common.allocator import in_force
    from disteval.rank.loop import ShardSpec, evaluate_shard
    from disteval.metrics import check_coverage
    from disteval.metrics.evaluator import Evaluator
    from disteval.tasks import resolve_task

    torch.set_num_threads(int(spec["threads"]))
    cfg = _job(spec["overrides"])
    device = torch.device("cpu")
    prec.apply_global_switches(cfg.precision, device, bitwise=True)
    task = resolve_task(cfg)(cfg)
    task.join(0, None)
    dataset, model = task.dataset(), task.model(device)

    def step(m, inputs):
        with prec.autocast(cfg.precision, device):
            return task.step(m, inputs, device)

    passes, metrics = [], []
    for _ in range(int(spec["passes"])):
        ev = Evaluator(task.metric(), bitwise=True)
        shard = ShardSpec(0, 1, int(cfg.data.batch_size), aligned=True, collate_fn=task.collate_fn())
        faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        progress = evaluate_shard(model, dataset, ev, shard, step=step)
        seconds = time.perf_counter() - t0
        passes.append({"seconds": seconds, "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                       "samples": int(progress.samples),
                       "coverage_ok": bool(check_coverage(ev.coverage.runs(), len(dataset)).ok)})
        metrics.append(ev.metric.compute())
    return {"in_force": in_force(), "num_samples": len(dataset), "passes": passes, "metrics": metrics}


def run_policy(policy: str, spec: dict, base_env: dict) -> dict:
    """One fresh process exec'd with ``policy``'s environment; its ``worker`` record plus ``expected`` (the
    allocator the policy resolved to). Raises RuntimeError with the process's stderr when it fails."""
    from disteval.common.allocator import resolve

    choice = resolve(policy, base_env)
    env = dict(base_env, **choice.env, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{policy}: the process exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(out, policy=policy, expected=choice.name, library=choice.library)


def _same(a, b) -> bool:
    """== on numbers (NaN equals NaN), recursively through dicts and lists."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def check(runs: dict[str, list[dict]]) -> list[str]:
    """The problems of a finished benchmark (empty: all good): coverage of every pass, metrics identical to
    ``system``'s (or to the first policy's), the allocator in force the one resolved."""
    problems = []
    reference = None
    ref_name = "system" if "system" in runs else next(iter(runs), None)
    if ref_name is not None and runs[ref_name]:
        reference = runs[ref_name][0]["metrics"][0]
    for policy, records in runs.items():
        for r, rec in enumerate(records):
            n = rec["num_samples"]
            for p, ps in enumerate(rec["passes"]):
                if ps["samples"] != n or not ps["coverage_ok"]:
                    problems.append(f"{policy} round {r} pass {p}: {ps['samples']} samples of {n}, coverage "
                                    f"{'ok' if ps['coverage_ok'] else 'not ok (ids missing or twice)'}")
            for p, m in enumerate(rec["metrics"]):
                if reference is not None and not _same(m, reference):
                    diff = sorted(k for k in set(m) | set(reference) if not _same(m.get(k), reference.get(k)))
                    problems.append(f"{policy} round {r} pass {p}: metrics differ from {ref_name}'s in {diff}")
            if rec["in_force"]["in_force"] != rec["expected"]:
                problems.append(f"{policy} round {r}: {rec['expected']} resolved but {rec['in_force']['in_force']} "
                                f"in force ({rec['in_force']})")
    return problems


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per policy: medians over every process's passes after its first (all passes when there is one)."""
    out = {}
    for policy, records in runs.items():
        faults, rates, per_process = [], [], []
        for rec in records:
            kept = rec["passes"][1:] or rec["passes"]
            faults += [p["minflt"] for p in kept]
            rates += [p["samples"] / p["seconds"] for p in kept if p["seconds"] > 0]
            per_process.append(statistics.median(p["samples"] / p["seconds"] for p in kept if p["seconds"] > 0))
        out[policy] = {"in_force": sorted({r["in_force"]["in_force"] for r in records}),
                       "library": records[0]["in_force"]["library"],
                       "minflt_per_pass": statistics.median(faults), "images_per_s": statistics.median(rates),
                       "process_images_per_s": [min(per_process), max(per_process)],
                       "first_pass_minflt": statistics.median(r["passes"][0]["minflt"] for r in records)}
    base = out.get("system")
    for row in out.values():
        row["speed_vs_system"] = row["images_per_s"] / base["images_per_s"] if base else None
        row["faults_vs_system"] = (row["minflt_per_pass"] / base["minflt_per_pass"]
                                   if base and base["minflt_per_pass"] else None)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=5, help="evaluations of the dataset per process (default 5)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds: a fresh process per policy in each (default 2)")
    ap.add_argument("--policies", nargs="+", default=list(POLICY_ORDER), choices=POLICY_ORDER)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1, as a bitwise rank)")
    ap.add_argument("--smoke", action="store_true", help="2 passes, 1 round, 512 images in batches of 64")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="job overrides (default +experiment=fashion_mnist)")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from rich.console import Console
    from rich.table import Table

    from disteval.common.allocator import find_library
    from disteval.errors import ConfigError

    console = Console()
    fashion = any(FASHION_ROOT.glob("t10k-*"))
    overrides = list(args.overrides) or (["+experiment=fashion_mnist"] if fashion else [])
    if args.smoke:
        args.passes, args.repeats = 2, 1
        overrides += ["data.limit=512", "data.batch_size=64"]
    spec = {"overrides": overrides, "passes": max(1, args.passes), "threads": args.threads}
    base_env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    policies, skipped = [], {}
    for policy in args.policies:
        if policy in ("tcmalloc", "jemalloc") and find_library(policy) is None:
            try:
                from disteval.common.allocator import resolve

                resolve(policy, base_env)
            except ConfigError as exc:
                skipped[policy] = str(exc)
                continue
        policies.append(policy)
    job = " ".join(overrides) or "the default digits job"
    console.print(f"job: {job}; {spec['passes']} pass(es) per process, {args.repeats} round(s), "
                  f"{args.threads} thread(s); first pass of each process left out", highlight=False)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(args.repeats):
        for policy in policies:
            t0 = time.perf_counter()
            rec = run_policy(policy, spec, base_env)
            runs[policy].append(rec)
            rates = [p["samples"] / p["seconds"] for p in rec["passes"]]
            console.print(f"round {r} {policy:<11} in force {rec['in_force']['in_force']:<11} "
                          f"minflt/pass {[p['minflt'] for p in rec['passes']]} images/s {[round(x) for x in rates]} "
                          f"({time.perf_counter() - t0:.1f} s)", highlight=False)
    table = Table(title=f"allocator policies: {job}, median over passes (images/s of the loop)")
    for col in ("policy", "in force", "minor faults / pass", "faults vs system", "images/s",
                "slowest..fastest process", "speed vs system"):
        table.add_column(col, justify="left" if col in ("policy", "in force") else "right")
    summary = summarize(runs)
    for policy, row in summary.items():
        table.add_row(policy, ", ".join(row["in_force"]), f"{row['minflt_per_pass']:,.0f}",
                      f"{row['faults_vs_system']:.2f}x" if row["faults_vs_system"] is not None else "-",
                      f"{row['images_per_s']:,.0f}",
                      f"{row['process_images_per_s'][0]:,.0f}..{row['process_images_per_s'][1]:,.0f}",
                      f"{row['speed_vs_system']:.2f}x" if row["speed_vs_system"] is not None else "-")
    for policy in skipped:
        table.add_row(policy, "skipped", "-", "-", "-", "-", "-")
    console.print(table)
    for policy, why in skipped.items():
        console.print(f"skipped {policy}: {why}", highlight=False)
    print(json.dumps({"job": overrides, "passes": spec["passes"], "repeats": args.repeats, "threads": args.threads,
                      "summary": summary, "skipped": skipped}))
    problems = check(runs)
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    from _summary import row, write

    base = summary.get("system")
    headline = [row(f"dist.allocator={policy} ({', '.join(r['in_force'])}): images/s of one process's evaluation "
                    f"loop vs glibc's default malloc (system); minor page faults per pass {r['minflt_per_pass']:,.0f} "
                    f"vs {base['minflt_per_pass']:,.0f}", f"{r['images_per_s']:,.0f}", f"{base['images_per_s']:,.0f}",
                    r["speed_vs_system"])
                for policy, r in summary.items() if base is not None and policy != "system"]
    write("allocator", headline, args.smoke or bool(args.overrides))
    console.print(f"checks passed: every pass evaluated every sample once, the metrics of {len(policies)} "
                  "policies are identical, each process ran with the allocator its policy resolved to",
                  highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
