"""RUN_DIR/report.html of a finished run, from its records alone: results.json (identity, settings, metrics with
their bootstrap intervals, timings, the synchronisation's collectives and bytes, warnings), launch.json (the
command and the outcome), .hydra/config.yaml (the job config) and ranks/rank*/status.json (the per-rank timeline,
``disteval.job.htmlreport.timeline``). The task's own figures come in as ``figures_of(metrics)`` (``Task.report_figures``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from disteval.common.pipeline import console_line as pipeline_line
from disteval.job.htmlreport.render import items, png_uri, read_json, write_page
from disteval.job.htmlreport.timeline import timeline

REPORT_NAME = "report.html"


def _identity(results: dict, launch: dict | None) -> list[tuple[str, str, str]]:
    """(id, label, value) rows of what ran and how."""
    data, model, task = results.get("dataset") or {}, results.get("model") or {}, results.get("task") or {}
    run_dir = Path(results.get("run_dir") or ".")
    rows = [("run-name", "run", f"{results.get('experiment', 'default')} / {run_dir.name}"),
            ("run-dir", "run directory", str(run_dir)),
            ("mode", "mode", str(results.get("mode"))),
            ("world-size", "world size", str(results.get("world_size"))),
            ("task", "task", f"{task.get('name')} ({task.get('class')})"),
            ("model", "model", f"{model.get('name')} ({model.get('class')}, weights {model.get('weights')}"
                               f"{', checkpoint ' + str(model['checkpoint']) if model.get('checkpoint') else ''})"),
            ("data", "data", f"{data.get('name')} split {data.get('split')}, {data.get('num_samples')} samples, "
                             f"batch size {data.get('batch_size')}"),
            ("device", "device", str(results.get("device"))),
            ("sampler", "sampler", f"{results.get('sampler')} ({'exact' if results.get('exact', True) else 'inexact'})"),
            ("fingerprint", "config fingerprint", str(results.get("config_digest"))),
            ("versions", "versions", ", ".join(f"{k} {v}" for k, v in (results.get("versions") or {}).items()))]
    if launch:
        rows += [("command", "command", " ".join(launch.get("argv") or [])),
                 ("outcome", "outcome", f"{launch.get('outcome')} (exit code {launch.get('exit_code')})")]
    return rows


def metric_rows(metrics: dict, intervals: dict | None) -> list[dict]:
    """{key, value, low, high} of every scalar metric, with its bootstrap interval where results.json has one."""
    ci = intervals or {}
    out = []
    for key, value in metrics.items():
        if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
            continue
        band = ci.get(key) if isinstance(ci.get(key), dict) else {}
        out.append({"key": key, "value": value, "low": band.get("low"), "high": band.get("high")})
    return out


def _blocks(results: dict, figures_of: Callable[[dict], list] | None, notes: list[str]) -> list[dict]:
    """One metrics block per checkpoint of the job (one block for a plain run): {name, rows, ci, items}."""
    blocks = results.get("checkpoints") or [dict(results, name="")]
    out = []
    for b in blocks:
        figures = []
        if figures_of is not None:
            try:
                figures = figures_of(b.get("metrics") or {})
            except Exception as exc:  # noqa: BLE001 - a figure problem leaves the rest of the page
                notes.append(f"the task's figures failed: {type(exc).__name__}: {exc}")
        ci = b.get("confidence_intervals")
        out.append({"name": b.get("name") or "", "rows": metric_rows(b.get("metrics") or {}, ci), "ci": ci,
                    "items": items(figures)})
    return out


def run_context(run_dir: Path, figures_of: Callable[[dict], list] | None = None) -> dict:
    """Everything run.html.j2 shows. Raises FileNotFoundError without results.json."""
    results = json.loads((run_dir / "results.json").read_text())
    launch = read_json(run_dir / "launch.json")
    notes: list[str] = []
    config = run_dir / ".hydra" / "config.yaml"
    line = timeline(run_dir, results, (launch or {}).get("t_start"))
    task, model, data = results.get("task") or {}, results.get("model") or {}, results.get("dataset") or {}
    return {"title": f"{task.get('name') or 'disteval'}: {model.get('name')} on {data.get('name')}",
            "results": results, "identity": _identity(results, launch), "blocks": _blocks(results, figures_of, notes),
            "config": config.read_text() if config.is_file() else None,
            "timeline": None if line is None else dict(line, src=png_uri(line["figure"])),
            "comm": results.get("comm") or {}, "timings": results.get("timings") or {},
            "per_rank": results.get("per_rank") or [], "warnings": list(results.get("warnings") or []),
            "pipeline": pipeline_bars(results), "notes": notes}


STAGE_COLOURS = {"wait_for_data": "#d9534f", "forward": "#1f77b4", "metric_update": "#9467bd", "other": "#c7c7c7",
                 "read": "#8c564b", "decode": "#ff7f0e", "transform": "#2ca02c", "collate": "#17becf"}


def pipeline_bars(results: dict) -> dict | None:
    """The input pipeline's stage bars (results.json ``pipeline`` and ``per_rank[].pipeline``): per rank, its loop
    split into waiting for data, forward, metric update and the rest; the loader workers' time split into read,
    decode, transform and collate. Each segment: stage, seconds, percent. None without a pipeline record."""
    pipe = results.get("pipeline")
    if not pipe:
        return None
    ranks = []
    for p in results.get("per_rank") or []:
        rec = p.get("pipeline") or {}
        loop = rec.get("loop") or 0.0
        if loop <= 0:
            continue
        segs = [(s, float(rec.get(s) or 0.0)) for s in ("wait_for_data", "forward", "metric_update")]
        segs.append(("other", max(loop - sum(v for _, v in segs), 0.0)))
        ranks.append({"rank": p["rank"], "segments": [{"stage": s, "seconds": v, "pct": 100 * v / loop,
                                                       "colour": STAGE_COLOURS[s]} for s, v in segs]})
    host = [{"stage": s, "seconds": (pipe["stages"].get(s) or {}).get("worker_seconds"),
             "pct": 100 * ((pipe["stages"].get(s) or {}).get("share_of_worker_time") or 0.0), "colour": STAGE_COLOURS[s],
             "per_worker": (pipe["stages"].get(s) or {}).get("images_per_s_per_worker")}
            for s in ("read", "decode", "transform", "collate") if s in pipe.get("stages", {})]
    return {"summary": pipe, "ranks": ranks, "host": host, "line": pipeline_line(pipe)}


def write_run_report(run_dir: str | Path, figures_of: Callable[[dict], list] | None = None) -> Path:
    """Write RUN_DIR/report.html from the run's records and return its path. ``figures_of(metrics)``: the task's
    figures and tables (``Task.report_figures``), None for none. Raises FileNotFoundError without results.json."""
    run_dir = Path(run_dir)
    return write_page(run_dir / REPORT_NAME, "run.html.j2", run_context(run_dir, figures_of))
