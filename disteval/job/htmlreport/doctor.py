"""RUN_DIR/doctor/report.html: the doctor's diagnosis of one run (``diagnostics.report.as_dict``'s object) drawn
as its state machine (each state's checks, the states passed, the failing state), the verdict with the culprit
rank, the evidence and the remedy, and every check's finding. The states come in with the diagnosis (this layer
does not import the doctor)."""
from __future__ import annotations

from pathlib import Path

from disteval.job.htmlreport.render import write_page

ORDER = ("crashed", "fail", "unknown", "warn", "pass", "skipped")  # the worst first
COLORS = {"pass": "#cfeccf", "warn": "#ffe9a8", "fail": "#f4b4b4", "unknown": "#ffd0a0", "skipped": "#e4e4e4",
          "crashed": "#e0c4f0"}


def state_boxes(entry: dict, states: list[str] | tuple[str, ...]) -> list[dict]:
    """One box per state in order: {name, status (the worst of its checks; skipped when all were), role ("passed"
    before the verdict's state, "failing" at it, "after" past it; "passed" everywhere for a healthy run), counts
    {status: n}, fill colour, x}."""
    verdict = entry.get("verdict") or {}
    at = list(states).index(verdict["state"]) if verdict.get("state") in states else None
    out = []
    for i, name in enumerate(states):
        found = [c["status"] for c in entry.get("checks") or [] if c["state"] == name]
        status = next((s for s in ORDER if s in found), "skipped")
        role = "passed" if at is None or i < at else "failing" if i == at else "after"
        out.append({"name": name, "status": status, "role": role, "x": 20 + 190 * i,
                    "counts": {s: found.count(s) for s in ORDER if s in found}, "fill": COLORS[status]})
    return out


def write_doctor_report(run_dir: str | Path, entry: dict, states: list[str] | tuple[str, ...]) -> Path:
    """Write RUN_DIR/doctor/report.html for ``entry`` (one run of ``python -m diagnostics doctor --json``'s
    ``runs``) and return its path."""
    run_dir = Path(run_dir)
    verdict = entry.get("verdict")
    title = (f"doctor: {verdict['state']} failed" if verdict and verdict["status"] == "fail" else
             "doctor: verdict unknown" if verdict else "doctor: healthy")
    context = {"title": title, "entry": entry, "boxes": state_boxes(entry, states), "verdict": verdict,
               "remedy": entry.get("remedy"), "culprit": entry.get("culprit_rank"), "colors": COLORS}
    return write_page(run_dir / "doctor" / "report.html", "doctor.html.j2", context)
