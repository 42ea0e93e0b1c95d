"""Where the start-up of ``python -m disteval`` goes: time to the first console line, each progress line, and
the phases read from the run's records.

    python benchmarks/startup.py [--repeats 3] [--cold-cache] [--no-imports] [overrides ...]

Runs ``python -m disteval hydra.run.dir=TMP/runK [overrides]`` ``--repeats`` times (default job: the shipped
CNN on digits, 2 local ranks) from a folder outside the checkout, timestamps every stdout/stderr line as it
arrives (seconds since the process was started), and prints per run:

- the first line and its time, then every ``disteval:`` progress line (stderr) with its time;
- phases from the records (wall clock, same machine): the driver's launch record (config composed), each
  rank's status record created (the rank process is up and has imported the engine), the rank joined the
  process group, the rank's data + model load (results.json ``per_rank[].seconds.load``), results.json
  written, the driver's launch record finished, and the process exit;
- results.json's ``timings`` (``evaluation_s``/``total``, and ``process_wall_s`` where the run records it).

``--cold-cache`` gives every run an empty ``DISTEVAL_CACHE_DIR`` (the digits split is then built with
scikit-learn in every rank, as on a machine's first run). Then (unless ``--no-imports``) the import time of the
modules each process loads, each in a fresh interpreter (``python -X importtime``, cumulative, seconds).
Timing targets live here, not in the unit tests: a loaded machine moves every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMPORTS = ("disteval.cli", "disteval.engine", "torch", "hydra", "torchvision")


def _reader(stream, name: str, t0: float, lines: list) -> None:
    for line in stream:
        lines.append((time.time() - t0, name, line.rstrip("\n")))


def run_once(run_dir: Path, overrides: list[str], cache_dir: Path | None = None) -> dict:
    """One ``python -m disteval`` run (``cache_dir``: its DISTEVAL_CACHE_DIR). Returns {lines [(s, stream,
    text)], exit_s, returncode, t0}."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="100")
    if cache_dir is not None:
        env["DISTEVAL_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    lines: list = []
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", *overrides],
                            cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readers = [threading.Thread(target=_reader, args=(s, n, t0, lines)) for s, n in
               ((proc.stdout, "out"), (proc.stderr, "err"))]
    for r in readers:
        r.start()
    code = proc.wait()
    exit_s = time.time() - t0
    for r in readers:
        r.join()
    return {"lines": sorted(lines), "exit_s": exit_s, "returncode": code, "t0": t0}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def phases(run_dir: Path, t0: float) -> list[tuple[str, float | None]]:
    """(label, seconds since the process start) from launch.json, the ranks' status.json and results.json."""
    launch = _load(run_dir / "launch.json")
    ranks = [_load(p) for p in sorted((run_dir / "ranks").glob("rank*/status.json"))]
    res = _load(run_dir / "results.json")
    loads = [p["seconds"]["load"] for p in res.get("per_rank", [])]

    def rel(t):
        return None if t is None else t - t0

    out = [("driver: config composed (launch record)", rel(launch.get("t_start")))]
    if ranks:
        out += [("ranks: first process up (status record)", rel(min(r["t_start"] for r in ranks))),
                ("ranks: last process up", rel(max(r["t_start"] for r in ranks))),
                ("ranks: last joined the process group", rel(max((r.get("joined") or 0) for r in ranks) or None))]
    if loads:
        out.append(("ranks: slowest data + model load (duration)", max(loads)))
    out += [("rank 0: results.json written", rel(res.get("created"))),
            ("driver: finished (launch record)", rel(launch.get("t_end")))]
    return out


def import_times() -> dict[str, float]:
    """Cumulative import time (s) of each module of IMPORTS in a fresh interpreter."""
    out = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for module in IMPORTS:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], env=env,
                              capture_output=True, text=True)
        rows = [line.split("|") for line in proc.stderr.splitlines() if line.startswith("import time:")]
        out[module] = max((int(r[1]) for r in rows[1:] if r[1].strip().isdigit()), default=0) / 1e6
    return out


def _report(k: int, run: dict, run_dir: Path) -> float | None:
    first = run["lines"][0] if run["lines"] else None
    print(f"run {k}: exit code {run['returncode']}, process wall {run['exit_s']:.2f} s")
    if first:
        print(f"  first line after {first[0]:6.2f} s ({first[1]}): {first[2][:90]}")
    for t, name, text in run["lines"][1:]:
        if name == "err" and text.startswith("disteval:"):
            print(f"  {t:6.2f} s  {text[:100]}")
    for label, t in phases(run_dir, run["t0"]):
        print(f"  {'' if t is None else f'{t:6.2f} s'}  {label}")
    timings = _load(run_dir / "results.json").get("timings", {})
    print("  results.json timings: " + ", ".join(f"{k_}={v:.2f}" for k_, v in timings.items()
                                                  if isinstance(v, (int, float))))
    return first[0] if first else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-imports", action="store_true", help="skip the per-module import times")
    ap.add_argument("--cold-cache", action="store_true", help="an empty DISTEVAL_CACHE_DIR for every run")
    args, overrides = ap.parse_known_args()
    firsts, walls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            run_dir = Path(tmp) / f"run{k}"
            run = run_once(run_dir, overrides, Path(tmp) / f"cache{k}" if args.cold_cache else None)
            first = _report(k, run, run_dir)
            if first is not None:
                firsts.append(first)
            walls.append(run["exit_s"])
    if firsts:
        print(f"median over {len(walls)} runs: first line {statistics.median(firsts):.2f} s, "
              f"process wall {statistics.median(walls):.2f} s")
    if not args.no_imports:
        for module, s in import_times().items():
            print(f"import {module}: {s:.2f} s (fresh interpreter, cumulative)")


if __name__ == "__main__":
    main()
