"""The headline rows a benchmark run leaves for docs/benchmarks.md's performance table (``scripts/perf_table.py``).

``write(name, rows, smoke)`` saves ``<results folder>/<name>.json``: the date (UTC), the commit, the
machine (cores, CPU model, torch), the command and ``rows``, each ``{"measure", "value", "baseline",
"ratio"}`` (strings as printed, ``ratio`` a float or None), taken from the numbers the benchmark printed in
the same run. A ``--smoke`` run writes nothing: its sizes are not the benchmark's. Not a benchmark itself
(the leading underscore keeps it out of tests/test_benchmarks.py's list).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # the recorded figures (docs/benchmarks.md's table)


def results_dir() -> Path:
    """Where a run's headline rows go: ``$DISTEVAL_BENCH_RESULTS``, else ``~/.cache/disteval/benchmarks`` (a folder
    of the user's: running a benchmark never rewrites the checkout's recorded figures). A maintainer records a
    run with ``DISTEVAL_BENCH_RESULTS=benchmarks/results``, then ``python scripts/perf_table.py``."""
    given = os.environ.get("DISTEVAL_BENCH_RESULTS")
    if given:
        return Path(given).resolve()
    base = os.environ.get("DISTEVAL_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                                 os.path.expanduser("~/.cache"), "disteval")
    return Path(base) / "benchmarks"


def machine() -> dict:
    """cores (os.cpu_count), cpu (model name from /proc/cpuinfo), python, torch versions."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch_version}


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def row(measure: str, value: str, baseline: str = "", ratio: float | None = None) -> dict:
    """One headline row: what was measured, disteval's figure, the baseline's figure, value/baseline."""
    return {"measure": measure, "value": value, "baseline": baseline,
            "ratio": None if ratio is None else round(float(ratio), 3)}


def write(name: str, rows: list[dict], smoke: bool) -> Path | None:
    """Save the rows (see the module docstring) unless ``smoke``; returns the path written."""
    if smoke or not rows:
        return None
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    record = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "commit": _commit(), "machine": machine(),
              "command": " ".join(["python", f"benchmarks/{name}.py", *sys.argv[1:]]), "rows": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    if folder == RESULTS.resolve():
        print(f"headline rows recorded in {path} (python scripts/perf_table.py puts them into docs/benchmarks.md)")
    else:
        print(f"headline rows written to {path} (the checkout's benchmarks/results/ is left as it is; record them "
              "there with DISTEVAL_BENCH_RESULTS=benchmarks/results)")
    return path


def finish(name: str, rows: list[dict], problems: list[str], smoke: bool, console) -> int:
    """The end of a benchmark: each problem in red and exit code 1, else the headline rows written (``write``),
    "checks passed" and 0."""
    for p in problems:
        console.print(f"[red]problem:[/] {p}")
    if problems:
        return 1
    write(name, rows, smoke)
    console.print("checks passed")
    return 0


FASHION = Path("/usr/share/datasets/fashion-mnist")


def fashion_job_args(doc: str, console, world_size: int | None = 2):
    """The command line of a benchmark of ``python -m disteval`` jobs on Fashion-MNIST: ``--repeats`` (default
    3), ``--smoke`` (one repeat) and, unless ``world_size`` is None, ``--world-size`` (default ``world_size``).
    Returns the parsed namespace, or None after saying so when Fashion-MNIST is not installed (the benchmark
    then measures nothing and exits 0)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one repeat")
    if world_size is not None:
        parser.add_argument("--world-size", type=int, default=world_size, help="ranks of every job")
    args = parser.parse_args()
    if not any(FASHION.glob("t10k-*")):
        console.print(f"Fashion-MNIST not found at {FASHION} (apt-get install dataset-fashion-mnist): nothing measured")
        return None
    return args
