"""Compression where it matters: real jobs across a shaped network link, compression off and on, in one run.

    python benchmarks/links.py [--rates 1000 100 10] [--jobs default ranking coco knn] [--smoke]

On the network lab (``disteval.testing.netlab``: 2 nodes, each its own network namespace, joined by a bridge) every
job runs as 2 nodes x 2 ranks through disteval's multi-node launcher, with node n2's link shaped to each rate
(Mbit/s, both ways: tbf), once with ``communication.compression=none`` and once with compression on:

- ``default``: the default job (digits CNN, classification), on = lossless: its states are all sums
  (all_reduce, never compressed), so compression has nothing to act on here: the control;
- ``ranking``: Fashion-MNIST with the ranking family (AUROC/AP: 10,000 x 10 float64 scores gathered), on = fp16
  for the scores (the metric declares them compressible), the compressible payload of this benchmark;
- ``coco``: the COCO replay (bbox; ../shared/data), on = lossless;
- ``knn``: kNN on Fashion-MNIST embeddings (60,000-image gallery, sharded exact top-k), on = lossless.

Printed per (job, rate, compression): the bytes the ranks' comm layers sent (all ranks, status.json ``comm``),
the compressible payloads' bytes before/after (results.json ``comm.compression``), rank 0's sync seconds
(results.json ``timings.sync``), rank 0's seconds in collectives over the whole run (``comm.seconds_by_op``: for
kNN the sharded search's exchanges after the loop, which the sync does not include) and the metric change against
compression off: exactly zero for everything but a
compressed float payload's metrics, whose largest change is printed next to the error results.json measured.
Then, at the slowest rate, the ratios off/on of the compressible payload's bytes and of the sync time.

Target (issue 26): on the 10 Mbit/s link, compression halves the wire bytes of the compressible payloads and
cuts the sync time by >= 1.7x. Checked (exit 1 naming the mismatch, never on a time): every run completes,
compression off and on give == metrics except the compressed scores' family, results.json says compression was
on (and its error) exactly when it was.

``--smoke``: the default and ranking jobs at 10 Mbit/s only (about a minute). Needs root and namespaces (the lab);
elsewhere it says why and exits 0 with nothing measured.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from disteval.testing.netlab import NetLab  # noqa: E402

import _summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COCO = REPO.parent / "shared" / "data" / "coco" / "fce_cocoapi"
FASHION = Path("/usr/share/datasets/fashion-mnist")
JOBS = {
    "default": ([], "lossless"),
    "ranking": (["+experiment=fashion_mnist", "eval.metrics=[classification,ranking]"], "fp16"),
    "coco": (["+experiment=coco_replay", f"data.annotations={COCO / 'instances_val2014_100.json'}",
              f"data.predictions={COCO / 'instances_val2014_fakebbox100_results.json'}"], "lossless"),
    "knn": (["+experiment=fashion_mnist_knn"], "lossless"),
}
LOSSY_FAMILY = ("auroc", "ap")  # the ranking family's metrics, computed from the fp16 scores


def _missing(job: str) -> str | None:
    if job in ("ranking", "knn") and not any(FASHION.glob("t10k-*")):
        return f"Fashion-MNIST not found at {FASHION} (apt-get install dataset-fashion-mnist)"
    if job == "coco" and not COCO.is_dir():
        return f"{COCO} not found (../shared/data)"
    return None


def run_job(lab: NetLab, run_dir: Path, overrides: list[str], port: int) -> dict:
    """One job as 2 nodes x 2 ranks (rendezvous on n1); {results, sent (bytes, all ranks), exit codes}."""
    cmd = [sys.executable, "-m", "disteval", "dist.world_size=4", "dist.nnodes=2",
           f"dist.rdzv_endpoint=198.18.0.1:{port}", f"hydra.run.dir={run_dir}", "communication.timeout_s=300",
           *overrides]
    procs = {n: lab.popen(n, cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in ("n1", "n2")}
    outs = {n: p.communicate(timeout=900) for n, p in procs.items()}
    codes = {n: p.returncode for n, p in procs.items()}
    if any(codes.values()):
        raise SystemExit(f"{run_dir.name}: exit codes {codes}\n{outs['n1'][1][-2000:]}\n{outs['n2'][1][-2000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    sent = sum(json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())["comm"]["bytes"]
               for r in range(4))
    return {"results": results, "sent": sent}


def metric_change(off: dict, on: dict) -> tuple[list[str], float]:
    """(names of metrics outside the lossy family that differ: must be none, largest |change| in the lossy
    family's scalar metrics)."""
    exact_bad = [k for k in off if not k.startswith(LOSSY_FAMILY) and off[k] != on.get(k)]
    lossy = [abs(float(on[k]) - float(off[k])) for k in off
             if k.startswith(LOSSY_FAMILY) and isinstance(off[k], (int, float))]
    return exact_bad, max(lossy, default=0.0)


def check_pair(job: str, mode: str, off: dict, on: dict) -> list[str]:
    """Mismatches of one (job, rate): metrics, and what results.json says about compression."""
    bad, _ = metric_change(off["results"]["metrics"], on["results"]["metrics"])
    problems = [f"{job}: metric {k} changed with compression={mode}" for k in bad]
    if off["results"]["comm"]["compression"] or off["results"]["comm"].get("compression_mode") != "none":
        problems.append(f"{job}: results.json records compression with compression=none")
    recorded = on["results"]["comm"]["compression"]  # per gathered payload (none when a job gathers nothing)
    if on["results"]["comm"].get("compression_mode") != mode or any(c.get("mode") != mode for c in recorded.values()):
        problems.append(f"{job}: results.json does not record compression={mode}: "
                        f"{on['results']['comm'].get('compression_mode')}, {recorded}")
    if mode == "lossless" and any(c.get("max_abs_error") for c in recorded.values()):
        problems.append(f"{job}: lossless compression reports an error: {recorded}")
    return problems


def comm_seconds(res: dict) -> float:
    """Rank 0's seconds inside collectives over the whole run (results.json ``comm.seconds_by_op``): the
    synchronisation and, for kNN, the sharded search's exchanges after the loop."""
    return float(sum((res["comm"].get("seconds_by_op") or {}).values()))


def _payload_bytes(res: dict) -> tuple[int, int]:
    """(before, after) summed over the payloads compression changed (results.json comm.compression)."""
    comp = res["comm"]["compression"].values()
    changed = [c for c in comp if c["bytes_after"] < c["bytes_before"]]
    return sum(c["bytes_before"] for c in changed), sum(c["bytes_after"] for c in changed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000, 100, 10], help="link rates, Mbit/s")
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--smoke", action="store_true", help="default and ranking at 10 Mbit/s")
    args = parser.parse_args()
    if args.smoke:
        args.rates, args.jobs = [10.0], ["default", "ranking"]
    console = Console()
    reason = NetLab.available()
    if reason:
        console.print(f"links: nothing measured: {reason}\nchecks passed (none run)")
        return 0
    table = Table(title="links: compression across a shaped link (2 nodes x 2 ranks, n2 shaped)")
    for col in ("job", "link Mbit/s", "compression", "sent bytes (all ranks)", "compressible bytes before -> after",
                "sync s", "comm s", "metric change"):
        table.add_column(col, justify="left" if col in ("job", "compression") else "right")
    problems, ratios, port = [], [], 29700
    with NetLab(nodes=2, name="blinks") as lab:
        for job in args.jobs:
            why = _missing(job)
            if why:
                console.print(f"[yellow]{job}: skipped: {why}[/]")
                continue
            overrides, mode = JOBS[job]
            for rate in args.rates:
                lab.rate("n2", rate)
                try:
                    runs = {}
                    for comp in ("none", mode):
                        port += 1
                        run_dir = lab.shared / f"{job}-{rate:g}-{comp}"
                        runs[comp] = run_job(lab, run_dir, [*overrides, f"communication.compression={comp}"], port)
                finally:
                    lab.unrate("n2")
                off, on = runs["none"], runs[mode]
                problems += check_pair(job, mode, off, on)
                _, lossy = metric_change(off["results"]["metrics"], on["results"]["metrics"])
                before, after = _payload_bytes(on["results"])
                err = max((c.get("max_abs_error") or 0.0 for c in on["results"]["comm"]["compression"].values()),
                          default=0.0)
                for comp, r in runs.items():
                    change = "" if comp == "none" else ("nothing gathered" if not on["results"]["comm"]["compression"]
                                                       else "0 (==)" if lossy == 0 else
                                                       f"{lossy:.2e} (payload error {err:.2e})")
                    payload = f"{before:,} -> {after:,}" if comp != "none" and before else ""
                    table.add_row(job, f"{rate:g}", comp, f"{r['sent']:,}", payload,
                                  f"{r['results']['timings']['sync']:.3f}", f"{comm_seconds(r['results']):.3f}", change)
                if rate == min(args.rates) and before:
                    syncs = (off["results"]["timings"]["sync"], on["results"]["timings"]["sync"])
                    ratios.append((job, rate, before / after, syncs[0] / syncs[1], syncs))
    console.print(table)
    rows = []
    for job, rate, bytes_ratio, sync_ratio, syncs in ratios:
        met = "met" if bytes_ratio >= 2 and sync_ratio >= 1.7 else "NOT met"
        console.print(f"{job} at {rate:g} Mbit/s: compressible payload bytes / {bytes_ratio:.2f}, sync time / "
                      f"{sync_ratio:.2f} (target: bytes / >= 2 and sync / >= 1.7: {met})")
        rows.append(_summary.row(f"links {job} at {rate:g} Mbit/s: sync with compression vs without",
                                 f"{syncs[1]:.3f} s", f"{syncs[0]:.3f} s", syncs[1] / syncs[0]))
    _summary.write("links", rows, args.smoke)
    if problems:
        for p in problems:
            console.print(f"[red]MISMATCH[/] {p}")
        return 1
    console.print("checks passed: every run completed; compression changed no metric but the compressed scores' "
                  "family; results.json recorded compression exactly when it was on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
