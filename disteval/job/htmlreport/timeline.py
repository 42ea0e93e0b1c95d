"""The per-rank timeline of a finished run from its records: each rank's start-up (status.json ``t_start`` to
``joined``), load and forward (results.json ``per_rank[].seconds``, placed after the join, the forward after
the canary's all_gather when results.json ``canary`` says it ran), and every collective
of ``collectives_done`` (entry = ``t_end - seconds``) split into the wait for the last rank to arrive and the
transfer after it. Ranks issue the same collectives in the same order, so the i-th entries belong together and
the rank that entered last is the one the others waited for. Clocks are each host's wall clock (``time.time``):
across hosts the picture is as good as their clocks agree."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from disteval.common.figures import new_figure
from disteval.job.htmlreport.render import read_json

COLORS = {"start-up": "#bbbbbb", "load": "#55a868", "forward": "#4c72b0", "wait": "#dd8452", "collective": "#c44e52"}


def statuses(run_dir: Path) -> dict[int, dict]:
    """{rank: status.json} of ``RUN_DIR/ranks/rank*/status.json`` (unreadable ones left out)."""
    out = {}
    for path in sorted(run_dir.glob("ranks/rank*/status.json")):
        rec = read_json(path)
        if rec is not None and path.parent.name[4:].isdigit():
            out[int(path.parent.name[4:])] = rec
    return out


def collective_waits(status: dict[int, dict]) -> list[dict]:
    """One row per collective issued by every rank: {index, op, bytes, entry {rank: s since the first entry},
    wait {rank: s}, last_rank (the one the others waited for), transfer_s (last entry to the slowest end),
    t_entry {rank: epoch}, t_end {rank: epoch}}."""
    done = {r: s.get("collectives_done") or [] for r, s in status.items()}
    if not done:
        return []
    rows = []
    for i in range(min(len(v) for v in done.values())):
        calls = {r: v[i] for r, v in done.items()}
        entry = {r: float(c["t_end"]) - float(c["seconds"]) for r, c in calls.items()}
        last = max(entry, key=entry.get)
        first = min(entry.values())
        rows.append({"index": i, "op": calls[last]["op"], "bytes": max(int(c.get("bytes") or 0) for c in calls.values()),
                     "entry": {r: e - first for r, e in entry.items()}, "wait": {r: entry[last] - e for r, e in entry.items()},
                     "last_rank": last, "transfer_s": max(float(c["t_end"]) for c in calls.values()) - entry[last],
                     "t_entry": entry, "t_end": {r: float(c["t_end"]) for r, c in calls.items()}})
    return rows


def rank_phases(results: dict, status: dict[int, dict], waits: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """{rank: [(phase, start epoch, end epoch)]}: start-up, load, forward, then per collective its wait and its
    transfer."""
    seconds = {p["rank"]: p.get("seconds") or {} for p in results.get("per_rank") or []}
    canary = bool((results.get("canary") or {}).get("digest"))  # results.json canary: compared before the loop
    out: dict[int, list[tuple[str, float, float]]] = {}
    for r, s in status.items():
        spans = []
        joined = s.get("joined")
        if s.get("t_start") is not None and joined is not None:
            spans.append(("start-up", float(s["t_start"]), float(joined)))
        sec = seconds.get(r, {})
        if joined is not None and sec.get("load") is not None:
            load_end = float(joined) + float(sec["load"])
            spans.append(("load", float(joined), load_end))
            if sec.get("forward") is not None:  # after the canary's all_gather, the first collective, when it ran
                start = max(load_end, waits[0]["t_end"][r]) if canary and waits else load_end
                spans.append(("forward", start, start + float(sec["forward"])))
        for w in waits:
            entry, last = w["t_entry"][r], w["t_entry"][w["last_rank"]]
            if last > entry:
                spans.append(("wait", entry, last))
            spans.append(("collective", max(entry, last), w["t_end"][r]))
        out[r] = spans
    return out


def timeline_figure(phases: dict[int, list[tuple[str, float, float]]], t0: float) -> Any:
    """A horizontal bar per rank (matplotlib ``broken_barh``), seconds since ``t0``, one colour per phase."""
    fig, ax = new_figure(9.0, 0.9 + 0.55 * len(phases))
    labelled = set()
    for row, (_rank, spans) in enumerate(sorted(phases.items())):
        for name in COLORS:
            bars = [(a - t0, max(b - a, 1e-4)) for phase, a, b in spans if phase == name]
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), color=COLORS[name],
                               label=None if name in labelled else name)
                labelled.add(name)
    ax.set_yticks(range(len(phases)), [f"rank {r}" for r in sorted(phases)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the driver's start")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(phases) < 3 else -0.2), ncol=len(COLORS),
              fontsize=8, frameon=False)
    return fig


def timeline(run_dir: Path, results: dict, t0: float | None) -> dict | None:
    """The page's timeline section: {figure (matplotlib), waits (rows of ``collective_waits``), ranks (per-rank
    totals: rank, start-up, load, forward, wait, collective seconds)}; None without status records."""
    status = statuses(run_dir)
    if not status:
        return None
    waits = collective_waits(status)
    phases = rank_phases(results, status, waits)
    starts = [a for spans in phases.values() for _, a, _ in spans]
    if not starts:
        return None
    origin = t0 if t0 is not None and t0 <= min(starts) else min(starts)
    totals = [{"rank": r, **{name: sum(b - a for p, a, b in spans if p == name) for name in COLORS}}
              for r, spans in sorted(phases.items())]
    return {"figure": timeline_figure(phases, origin), "waits": waits, "ranks": totals, "origin": origin}
