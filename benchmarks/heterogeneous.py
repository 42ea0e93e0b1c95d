"""Mixed hardware: what the canary costs, and what pinning a mixed fleet to common kernels costs, in one run.

    python benchmarks/heterogeneous.py [--repeats 3] [--smoke]

Every measurement is a real ``python -m disteval`` run at world size 2 on this machine:

1. **The canary's cost**: the default job (digits, 540 samples) and Fashion-MNIST (10,000 samples), each with the
   canary (``dist.canary_samples=32``, the default) and without it (``dist.canary_samples=0``). Printed: the
   canary's own seconds (results.json ``canary.seconds``: the probe's forward and its all_gather) as a share of
   the evaluation (``timings.evaluation_s``), and the evaluation's median seconds with and without the canary.
   Target (issue 27): below 1 % of the evaluation at 10,000 samples.
2. **Pinning**: Fashion-MNIST with rank 1 on torch's DEFAULT CPU kernels (the ``cpu@1:capability=default`` drill,
   a node of older hardware) and rank 0 on this CPU's best: unpinned (``dist.heterogeneous=warn``, each rank on
   its own kernels) and pinned (``=pin``: both on DEFAULT), and a homogeneous fleet on this CPU's best kernels
   for reference. Printed: the forward throughput (results.json ``throughput.images_per_s``) of each and the
   ratio pinned / homogeneous: what bit-identical results on a mixed fleet cost.

Checked (exit 1 naming the mismatch, never on a time): every run completes; the canary finds one class in the
homogeneous runs and two in the unpinned mixed run; the pinned run's canary agrees with every rank on DEFAULT; a
run without the canary gives metrics == the same run with it.

``--smoke``: one repeat on Fashion-MNIST's first 2,000 test images, without the runs that leave the canary out (its
cost is not measured; about half a minute). Needs Fashion-MNIST (apt-get install dataset-fashion-mnist).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import _summary  # noqa: E402

JOBS = {"default": [], "fashion_mnist": ["+experiment=fashion_mnist"]}
DRILL = "cpu@1:capability=default"


def run_job(work: Path, name: str, overrides: list[str], env: dict | None = None) -> dict:
    """One ``python -m disteval`` run at W=2; its results.json. Raises RuntimeError with its stderr on failure."""
    run_dir = work / name
    full = {k: v for k, v in os.environ.items() if k not in ("DISTEVAL_FAULTS", "ATEN_CPU_CAPABILITY")}
    full.update(env or {}, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", "dist.world_size=2",
                           "eval.progress=false", *overrides], env=full, capture_output=True, text=True, timeout=900,
                          cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


def measure(work: Path, repeats: int, smoke: bool) -> dict:
    """{"cost": {job: {"on": [results], "off": [results]}}, "pin": {homogeneous|unpinned|pinned: [results]}}; the
    homogeneous fleet is Fashion-MNIST with the canary on (the same runs). ``smoke``: Fashion-MNIST's run without
    the canary is left out."""
    out: dict = {"cost": {}, "pin": {"unpinned": [], "pinned": []}}
    jobs = {name: [*o, "data.limit=2000"] if smoke and name == "fashion_mnist" else o for name, o in JOBS.items()}
    for job, overrides in jobs.items():
        out["cost"][job] = {"on": [], "off": []}
        for i in range(repeats):
            out["cost"][job]["on"].append(run_job(work, f"{job}_on_{i}", overrides))
            if not smoke:  # smoke: the canary's cost is not measured (its runs are start-up bound anyway)
                out["cost"][job]["off"].append(run_job(work, f"{job}_off_{i}", [*overrides, "dist.canary_samples=0"]))
    out["pin"] = {"homogeneous": out["cost"]["fashion_mnist"]["on"], **out["pin"]}
    fashion = jobs["fashion_mnist"]
    for i in range(repeats):
        out["pin"]["unpinned"].append(run_job(work, f"unpinned_{i}", [*fashion, "dist.heterogeneous=warn"],
                                              {"DISTEVAL_FAULTS": DRILL}))
        out["pin"]["pinned"].append(run_job(work, f"pinned_{i}", [*fashion, "dist.heterogeneous=pin"],
                                            {"DISTEVAL_FAULTS": DRILL}))
    return out


def check(m: dict) -> list[str]:
    """The problems of a finished benchmark (empty: all good)."""
    problems = []
    for job, runs in m["cost"].items():
        for r in runs["on"]:
            if not (r["canary"].get("homogeneous") and len(r["canary"]["classes"]) == 1):
                problems.append(f"{job}: the canary found {r['canary'].get('classes')} on a homogeneous fleet")
        for r in runs["off"]:
            if r["canary"] != {"skipped": "dist.canary_samples=0"}:
                problems.append(f"{job}: dist.canary_samples=0 still ran the canary: {r['canary']}")
            if r["metrics"] != runs["on"][0]["metrics"]:
                problems.append(f"{job}: metrics without the canary differ from those with it")
    for r in m["pin"]["unpinned"]:
        if len(r["canary"].get("classes") or []) != 2:
            problems.append(f"unpinned mixed run: the canary found {r['canary'].get('classes')}, not 2 classes")
    for r in m["pin"]["pinned"]:
        caps = {p["fingerprint"]["cpu_capability"] for p in r["per_rank"]}
        if not r["canary"].get("homogeneous") or caps != {"DEFAULT"}:
            problems.append(f"pinned run: canary homogeneous={r['canary'].get('homogeneous')}, kernels {caps}")
    return problems


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(m: dict, console: Console, smoke: bool) -> list[dict]:
    """Print both tables; return the headline rows for docs/benchmarks.md (``_summary``)."""
    table = Table(title="the canary's cost (W=2, median over repeats)")
    for col in ("job", "samples", "canary s", "evaluation s (canary on)", "evaluation s (off)", "canary share"):
        table.add_column(col, justify="right" if col != "job" else "left")
    rows = []
    for job, runs in m["cost"].items():
        canary = _median([r["canary"]["seconds"] for r in runs["on"]])
        on = _median([r["timings"]["evaluation_s"] for r in runs["on"]])
        off = _median([r["timings"]["evaluation_s"] for r in runs["off"]]) if runs["off"] else float("nan")
        share = _median([r["canary"]["seconds"] / r["timings"]["evaluation_s"] for r in runs["on"]])
        table.add_row(job, f"{runs['on'][0]['metrics']['num_samples']:,}", f"{canary:.4f}", f"{on:.3f}", f"{off:.3f}",
                      f"{share:.2%}")
        rows.append({"measure": f"canary share of the evaluation, {job}", "value": f"{share:.2%}",
                     "baseline": f"evaluation {on:.3f} s", "ratio": share})
    console.print(table)
    pin = Table(title="pinning a mixed fleet (Fashion-MNIST, W=2: rank 1 on DEFAULT kernels)")
    for col in ("fleet", "kernels", "images/s", "ratio to homogeneous", "nll"):
        pin.add_column(col, justify="right" if col not in ("fleet", "kernels") else "left")
    base = _median([r["throughput"]["images_per_s"] for r in m["pin"]["homogeneous"]])
    for name, runs in m["pin"].items():
        ips = _median([r["throughput"]["images_per_s"] for r in runs])
        kernels = "/".join(p["fingerprint"]["cpu_capability"] for p in runs[0]["per_rank"])
        pin.add_row(name, kernels, f"{ips:,.0f}", f"{ips / base:.2f}", repr(runs[0]["metrics"]["nll"]))
        if name == "pinned":
            rows.append({"measure": "pinned mixed fleet throughput (fashion-mnist, W=2)", "value": f"{ips:,.0f} img/s",
                         "baseline": f"homogeneous {base:,.0f} img/s", "ratio": ips / base})
    console.print(pin)
    fashion = m["cost"]["fashion_mnist"]["on"]
    share = _median([r["canary"]["seconds"] / r["timings"]["evaluation_s"] for r in fashion])
    console.print(f"target: canary below 1 % of the evaluation at 10,000 samples: {share:.2%} "
                  f"({'met' if share < 0.01 else 'NOT met'}{', smoke sizes' if smoke else ''})")
    return rows


def main() -> int:
    console = Console()
    args = _summary.fashion_job_args(__doc__, console, world_size=None)
    if args is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="disteval-hetero-") as tmp:
        m = measure(Path(tmp), 1 if args.smoke else args.repeats, args.smoke)
    rows = report(m, console, args.smoke)
    return _summary.finish("heterogeneous", rows, check(m), args.smoke, console)


if __name__ == "__main__":
    sys.exit(main())
