"""docs/benchmarks.md's performance table, regenerated from the benchmarks' own output.

    python scripts/perf_table.py           # rewrite the table in docs/benchmarks.md from benchmarks/results/*.json
    python scripts/perf_table.py --check   # exit 1 when docs/benchmarks.md's table differs from the files (a test runs it)

Each full (non ``--smoke``) benchmark run writes its headline rows, date, commit and machine to
``benchmarks/results/<name>.json`` (``benchmarks/_summary.py``); this script renders them, one table row per
headline row, between the ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` markers of
docs/benchmarks.md ("Measured figures"). Nothing in the table is typed by hand: to change a number, rerun its
benchmark.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"  # the "Measured figures" table (README.md links to it)
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


def replace(page: str, table: str) -> str:
    """``page`` with the text between the markers replaced by ``table``; ValueError without the markers."""
    if page.count(START) != 1 or page.count(END) != 1 or page.index(START) > page.index(END):
        raise ValueError(f"the page needs one {START} line followed by one {END} line")
    head, rest = page.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page's table is not the generated one")
    ap.add_argument("--page", "--readme", dest="page", type=Path, default=PAGE,
                    help=f"the markdown page holding the table (default {PAGE.relative_to(REPO)})")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    page = args.page.read_text()
    new = replace(page, render(args.results))
    if args.check:
        if new != page:
            print(f"{args.page}: the performance table differs from {args.results}/*.json; run "
                  "python scripts/perf_table.py", file=sys.stderr)
            return 1
        print(f"{args.page}: the performance table matches {args.results}")
        return 0
    if new != page:
        tmp = args.page.with_suffix(".md.tmp")
        tmp.write_text(new)
        tmp.replace(args.page)
    print(f"wrote the performance table of {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
