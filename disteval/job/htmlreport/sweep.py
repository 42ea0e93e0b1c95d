"""SWEEP_DIR/report.html of a multirun over world sizes, from the rows of ``disteval.job.sweep.summarize_sweep`` (one
per job) and each completed job's results.json: the scaling (job wall time, evaluation time and forward-only
throughput against the world size, each with the ideal line from the smallest world size) and the identity check
(every metric of every completed job equal to the first's, bit for bit)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disteval.job.htmlreport.render import png_uri, read_json, write_page

PANELS = (("job_wall_s", "job wall time (s)", "time"), ("eval_s", "evaluation time (s)", "time"),
          ("forward_images_per_s", "forward-only images/s", "rate"))


def scaling_figure(rows: list[dict]) -> Any:
    """Three panels against the world size, measured points and the ideal: a time falls as 1/W from the smallest
    world size's value, a rate grows as W."""
    from matplotlib.figure import Figure

    done = {}
    for r in rows:  # the first completed job of each world size
        if r.get("status") == "completed" and r.get("world_size"):
            done.setdefault(int(r["world_size"]), r)
    sizes = sorted(done)
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    for ax, (key, label, kind) in zip(fig.subplots(1, len(PANELS)), PANELS):
        points = [(w, done[w][key]) for w in sizes if done[w].get(key) is not None]
        if points:
            w0, v0 = points[0]
            ideal = [v0 * w0 / w if kind == "time" else v0 * w / w0 for w, _ in points]
            ax.plot([w for w, _ in points], ideal, "--", color="gray", label="ideal")
            ax.plot([w for w, _ in points], [v for _, v in points], "o-", label="measured")
            ax.set_xticks([w for w, _ in points])
            ax.legend(fontsize=8)
        ax.set_xlabel("world size")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    return fig


def _flat(metrics: dict, prefix: str = "") -> dict[str, Any]:
    """Metrics flattened to dotted keys (nested dicts); lists kept whole (compared as one value)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def identity_check(rows: list[dict]) -> dict:
    """{jobs: [{job, world_size, mode}], metrics: [{key, values [per job], equal}], equal (all), differing
    [keys]} over the completed jobs' results.json ``metrics`` (equality as JSON values: exact)."""
    jobs, flats = [], []
    for r in rows:
        res = read_json(Path(r["run_dir"]) / "results.json") if r.get("status") == "completed" else None
        if res is not None:
            jobs.append({"job": r["job"], "world_size": res.get("world_size"), "mode": res.get("mode")})
            flats.append(_flat(res.get("metrics") or {}))
    keys = list(dict.fromkeys(k for f in flats for k in f))
    metrics = []
    for k in keys:
        values = [f.get(k) for f in flats]
        equal = all(json.dumps(v, sort_keys=True) == json.dumps(values[0], sort_keys=True) for v in values)
        shown = [v if v is None or isinstance(v, (int, float, str)) else f"[{len(v)} values]" if isinstance(v, list)
                 else str(v) for v in values]
        metrics.append({"key": k, "values": shown, "equal": equal})
    differing = [m["key"] for m in metrics if not m["equal"]]
    return {"jobs": jobs, "metrics": metrics, "equal": not differing and len(jobs) > 1, "differing": differing}


def write_sweep_report(sweep_dir: str | Path, rows: list[dict]) -> Path:
    """Write SWEEP_DIR/report.html from ``rows`` (``disteval.job.sweep.summarize_sweep``'s) and return its path."""
    sweep_dir = Path(sweep_dir)
    check = identity_check(rows)
    context = {"title": f"sweep over world sizes: {sweep_dir.name}", "sweep_dir": str(sweep_dir), "rows": rows,
               "scaling": png_uri(scaling_figure(rows)), "check": check,
               "failed": [r for r in rows if r.get("status") != "completed"]}
    return write_page(sweep_dir / "report.html", "sweep.html.j2", context)
