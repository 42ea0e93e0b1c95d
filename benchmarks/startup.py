"""Where the start-up of ``python -m disteval`` goes: time to the first console line, each progress line, and
the phases read from the run's records.

    python benchmarks/startup.py [--repeats 3] [--cold-cache] [--no-imports] [--smoke] [overrides ...]

Runs ``python -m disteval hydra.run.dir=TMP/runK [overrides]`` ``--repeats`` times (default job: the shipped
CNN on digits, 2 local ranks) from a folder outside the checkout, timestamps every stdout/stderr line as it
arrives (seconds since the process was started), and prints per run the first line and its time, then every
``disteval:`` progress line (stderr) with its time; then one table, a column per run, of:

- the first line's time;
- phases from the records (wall clock, same machine): the driver's launch record (config composed), each
  rank's status record created (the rank process is up and has imported the engine), the rank joined the
  process group, the rank's data + model load (results.json ``per_rank[].seconds.load``), results.json
  written, the driver's launch record finished, and the process exit;
- results.json's ``timings`` (``evaluation_s``/``total``, and ``process_wall_s`` where the run records it).

Checked, and the benchmark exits 1 naming the problem (never on a
time): every run exits 0, prints a first line, records every phase, writes results.json whose ranks evaluated
every sample once (coverage ok, per-rank samples add up to the dataset's size), and every module imports.
``--smoke``: 1 run and the import time of disteval.driver.cli only (seconds).

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
IMPORTS = ("disteval.driver.cli", "disteval.rank.engine", "torch", "hydra", "torchvision")


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


def import_times(modules: tuple[str, ...] = IMPORTS) -> tuple[dict[str, float], list[str]]:
    """Cumulative import time (s) of each module in a fresh interpreter, and the modules that failed to import
    (with the last line of their error)."""
    out, failed = {}, []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for module in modules:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            failed.append(f"import {module} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        rows = [line.split("|") for line in proc.stderr.splitlines() if line.startswith("import time:")]
        out[module] = max((int(r[1]) for r in rows[1:] if r[1].strip().isdigit()), default=0) / 1e6
    return out, failed


def import_floor(world_size: int, repeats: int) -> float:
    """The floor of any start-up: median wall time (s) of starting ``world_size`` Python processes at once that
    each ``import torch`` and exit (as many processes as the job's ranks, on the same cores)."""
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(world_size)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"python -c 'import torch' exited {codes}")
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def headline(firsts: list[float], walls: list[float], all_marks: list, timings: list[dict], floor: float,
             world_size: int) -> list[dict]:
    """Headline rows: first output; last rank joined and process wall against the import floor (the target:
    process wall within 2.5x of floor + evaluation)."""
    from _summary import row

    joined = [dict(m).get("ranks: last joined the process group") for m in all_marks]
    joined = [j for j in joined if j is not None]
    evals = [t["evaluation_s"] for t in timings if isinstance(t.get("evaluation_s"), (int, float))]
    wall, ev = statistics.median(walls), statistics.median(evals) if evals else 0.0
    rows = [row("start-up: first console line (s)", f"{statistics.median(firsts):.2f}", "target 1.0")]
    if joined:
        rows.append(row(f"start-up: all {world_size} ranks joined (s) vs {world_size} processes importing torch",
                        f"{statistics.median(joined):.2f}", f"{floor:.2f}", statistics.median(joined) / floor))
    rows.append(row("start-up: default job's process wall (s) vs import floor + evaluation (target <= 2.5x)",
                    f"{wall:.2f}", f"{floor:.2f} + {ev:.2f}", wall / (floor + ev)))
    return rows


def check_run(k: int, run: dict, run_dir: Path, marks: list[tuple[str, float | None]]) -> list[str]:
    """Mismatches of run ``k``: a non-zero exit, no console line, a phase missing from the records, no
    results.json, an incomplete coverage or per-rank samples that do not add up to the dataset's."""
    problems = [f"run {k}: {label} missing from the records" for label, t in marks if t is None]
    if run["returncode"] != 0:
        tail = "\n".join(text for _, _, text in run["lines"][-15:])
        problems.append(f"run {k}: exit code {run['returncode']}\n{tail}")
    if not run["lines"]:
        problems.append(f"run {k}: printed nothing")
    res = _load(run_dir / "results.json")
    if not res:
        return problems + [f"run {k}: no results.json"]
    samples, expected = sum(int(p["samples"]) for p in res["per_rank"]), res["dataset"]["num_samples"]
    if samples != expected or not res["coverage"]["ok"]:
        problems.append(f"run {k}: ranks evaluated {samples} samples of {expected} (coverage {res['coverage']})")
    if len(res["per_rank"]) != res["world_size"]:
        problems.append(f"run {k}: {len(res['per_rank'])} per-rank records for world size {res['world_size']}")
    return problems


def _report(k: int, run: dict) -> float | None:
    """Print run ``k``'s exit, first line and progress lines; returns the first line's time."""
    first = run["lines"][0] if run["lines"] else None
    print(f"run {k}: exit code {run['returncode']}, process wall {run['exit_s']:.2f} s")
    if first:
        print(f"  first line after {first[0]:6.2f} s ({first[1]}): {first[2][:90]}")
    for t, name, text in run["lines"][1:]:
        if name == "err" and text.startswith("disteval:"):
            print(f"  {t:6.2f} s  {text[:100]}")
    return first[0] if first else None


def _marks(run: dict, run_dir: Path) -> list[tuple[str, float | None]]:
    """(label, seconds since the process start) of run's first line, the records' phases and its exit."""
    first = run["lines"][0][0] if run["lines"] else None
    return [("first console line", first), *phases(run_dir, run["t0"]), ("process exit", run["exit_s"])]


def phase_table(all_marks: list[list[tuple[str, float | None]]], timings: list[dict]):
    """One row per phase (and results.json timing), one column per run; '-' where a phase has no record."""
    from rich.table import Table

    table = Table(title=f"start-up phases (s since the process start, {len(all_marks)} run(s))")
    table.add_column("phase")
    for k in range(len(all_marks)):
        table.add_column(f"run {k}", justify="right")
    for i, (label, _) in enumerate(all_marks[0]):
        table.add_row(label, *("-" if m[i][1] is None else f"{m[i][1]:.2f}" for m in all_marks))
    for key in sorted({k_ for t in timings for k_, v in t.items() if isinstance(v, (int, float))}):
        table.add_row(f"results.json timings.{key}", *(_fmt(t.get(key)) for t in timings))
    return table


def _fmt(x) -> str:
    """A number with 2 decimals, '-' otherwise."""
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def main() -> int:
    """The runs, the phase table, the import times and the checks; 1 on a problem."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-imports", action="store_true", help="skip the per-module import times")
    ap.add_argument("--cold-cache", action="store_true", help="an empty DISTEVAL_CACHE_DIR for every run")
    ap.add_argument("--smoke", action="store_true", help="1 run, import time of disteval.driver.cli only (seconds)")
    args, overrides = ap.parse_known_args()
    if args.smoke:
        args.repeats = 1
    from rich.console import Console
    from _summary import write

    world_size = 1
    firsts, walls, all_marks, timings, problems = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            run_dir = Path(tmp) / f"run{k}"
            run = run_once(run_dir, overrides, Path(tmp) / f"cache{k}" if args.cold_cache else None)
            first = _report(k, run)
            if first is not None:
                firsts.append(first)
            walls.append(run["exit_s"])
            all_marks.append(_marks(run, run_dir))
            res = _load(run_dir / "results.json")
            timings.append(res.get("timings", {}))
            world_size = int(res.get("world_size") or 1)
            problems += check_run(k, run, run_dir, all_marks[-1])
    Console(width=max(Console().width, 120)).print(phase_table(all_marks, timings))
    floor = import_floor(world_size, 1 if args.smoke else 3)
    evals = [t["evaluation_s"] for t in timings if isinstance(t.get("evaluation_s"), (int, float))]
    print(f"import floor: {world_size} processes that import torch, started at once: {floor:.2f} s (median)")
    if firsts:
        wall, ev = statistics.median(walls), statistics.median(evals) if evals else 0.0
        print(f"median over {len(walls)} runs: first line {statistics.median(firsts):.2f} s, "
              f"process wall {wall:.2f} s = {wall / (floor + ev):.2f}x (import floor + evaluation "
              f"{floor:.2f} + {ev:.2f} s; target <= 2.5x)")
        write("startup", headline(firsts, walls, all_marks, timings, floor, world_size), args.smoke or bool(overrides)
              or args.cold_cache)
    if not args.no_imports:
        times, failed = import_times(IMPORTS[:1] if args.smoke else IMPORTS)
        problems += failed
        for module, s in times.items():
            print(f"import {module}: {s:.2f} s (fresh interpreter, cumulative)")
    if problems:
        print("MISMATCH: " + "\n".join(problems))
        return 1
    print(f"checks passed: {args.repeats} run(s) exited 0 with every phase recorded and every sample evaluated once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
