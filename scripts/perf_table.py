"""README.md's performance table, regenerated from the benchmarks' own output.

    python scripts/perf_table.py           # rewrite the table in README.md from benchmarks/results/*.json
    python scripts/perf_table.py --check   # exit 1 when README.md's table differs from the files (a test runs it)

Each full (non ``--smoke``) benchmark run writes its headline rows, date, commit and machine to
``benchmarks/results/<name>.json`` (``benchmarks/_summary.py``); this script renders them, one table row per
headline row, between the ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` markers of README.md.
Nothing in the table is typed by hand: to change a number, rerun its benchmark.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"


def render(results_dir: Path) -> str:
    """The markdown between the markers: a header line and one row per headline row of every results file."""
    records = [json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))]
    lines = ["| benchmark | measure | disteval | baseline | ratio | measured |", "|---|---|---:|---:|---:|---|"]
    for rec in records:
        m = rec["machine"]
        where = f"{rec['date']}, {m['cores']} cores, torch {m['torch']}, commit {rec.get('commit') or '?'}"
        for r in rec["rows"]:
            ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            lines.append(f"| `{rec['command']}` | {r['measure']} | {r['value']} | {r['baseline']} | {ratio} | {where} |")
    if not records:
        lines.append("| (no benchmark results yet: run a benchmark without --smoke) | | | | | |")
    return "\n".join(lines)


def replace(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table``; ValueError without the markers."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(f"README.md needs one {START} line followed by one {END} line")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table is not the generated one")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    readme = args.readme.read_text()
    new = replace(readme, render(args.results))
    if args.check:
        if new != readme:
            print(f"{args.readme}: the performance table differs from {args.results}/*.json; run "
                  "python scripts/perf_table.py", file=sys.stderr)
            return 1
        print("README.md's performance table matches benchmarks/results")
        return 0
    if new != readme:
        tmp = args.readme.with_suffix(".md.tmp")
        tmp.write_text(new)
        tmp.replace(args.readme)
    print(f"wrote the performance table of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
