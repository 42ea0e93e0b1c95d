"""The end of a multirun: one row per job (world size, status, main metric, the job's wall time, the
evaluation's time, forward-only throughput) from the jobs' results.json / launch.json / status records,
written as SWEEP_DIR/summary.csv, summary.png (matplotlib) and report.html (``disteval.job.htmlreport``) and printed as a
table. A metric that differs
across world sizes is flagged: for an exact evaluation it must not.

The three times measure different things, and more ranks can raise one while the others get worse:

- ``job_wall_s``: the whole job as its driver saw it, from taking the composed job to the job's end
  (launch.json ``t_end - t_start``: checks, rank start-up and imports, data and model loading, evaluation,
  synchronisation, shutdown); what a user waits for each job;
- ``eval_s``: rank 0's evaluation (results.json ``timings.evaluation_s``: process group, load, forward, sync);
- ``forward_images_per_s``: samples / the slowest rank's forward seconds (results.json ``throughput``):
  forward passes only, without start-up, loading and synchronisation.

Registered as a Hydra callback in conf/config.yaml (``hydra.callbacks.sweep_summary``); ``summarize_sweep``
can also be called on any sweep directory.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from disteval.common.links import mbit, node_throughput

COLUMNS = ("job", "world_size", "status", "main_metric", "value", "job_wall_s", "eval_s", "forward_images_per_s",
           "pipeline", "delivered_images_per_s", "link_mbit_s", "slow_link_node", "error", "run_dir")
PLOTS = (("job_wall_s", "job wall time (s)\nwhole job: start-up, load, eval, exit"),
         ("eval_s", "evaluation time (s)\nrank 0: load, forward, sync"),
         ("forward_images_per_s", "forward-only throughput (images/s)\nno start-up, loading or sync"),
         ("value", "main metric"))


def _job_wall(run_dir: Path, results: dict | None) -> float | None:
    """The job's wall time (s): launch.json ``t_end - t_start`` (the driver from taking the composed job to its
    end), else results.json ``timings.process_wall_s`` (driver start to results written), else None."""
    launch = run_dir / "launch.json"
    if launch.is_file():
        rec = json.loads(launch.read_text())
        if rec.get("t_end") is not None and rec.get("t_start") is not None:
            return float(rec["t_end"]) - float(rec["t_start"])
    return ((results or {}).get("timings") or {}).get("process_wall_s")


def _links(run_dir: Path) -> dict[str, Any]:
    """``link_mbit_s``: the slowest node's achieved link throughput (Mbit/s) over the collectives large enough to
    measure it (``disteval.common.links``), ``slow_link_node``: that node when the run spans nodes; None when
    nothing was measured. A forward-slow rank shows in forward_images_per_s, a slow link here."""
    statuses = {}
    for path in run_dir.glob("ranks/rank*/status.json"):
        try:
            statuses[int(path.parent.name[4:])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    nodes = node_throughput(statuses)
    if not nodes:
        return {"link_mbit_s": None, "slow_link_node": None}
    host, slowest = min(nodes.items(), key=lambda kv: kv[1]["bps"])
    return {"link_mbit_s": round(mbit(slowest["bps"]), 3), "slow_link_node": host if len(nodes) > 1 else None}


def main_metric_of(results: dict) -> str | None:
    """The main metric a job's results.json names (``task.main_metric``: the task's choice by its metrics'
    declarations, ``disteval.metrics.meaning``) when its metrics hold it, else None."""
    name = (results.get("task") or {}).get("main_metric")
    return name if name in (results.get("metrics") or {}) else None


def _job_row(run_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": run_dir.name, "run_dir": str(run_dir), **_links(run_dir)}
    results = run_dir / "results.json"
    if results.is_file():
        res = json.loads(results.read_text())
        name = main_metric_of(res)
        row.update(world_size=res["world_size"], status="completed", main_metric=name,
                   value=res["metrics"].get(name) if name else None, job_wall_s=_job_wall(run_dir, res),
                   eval_s=res["timings"].get("evaluation_s", res["timings"]["total"]),
                   forward_images_per_s=res["throughput"]["images_per_s"], error="")
        pipe = res.get("pipeline") or {}  # input- or compute-bound, and the images/s the loader delivered
        row.update(pipeline=pipe.get("bound"), delivered_images_per_s=pipe.get("delivered_images_per_s"))
        return row
    row.update(status="failed", job_wall_s=_job_wall(run_dir, None))
    job = run_dir / "job.json"
    if job.is_file():
        rec = json.loads(job.read_text())
        row.update(status=str(rec.get("state", "FAILED")).lower(), error=rec.get("error", ""),
                   world_size=rec.get("world_size"))
    launch = run_dir / "launch.json"
    if launch.is_file() and not row.get("error"):  # the driver's verdict: culprit rank and its own error
        rec = json.loads(launch.read_text())
        row.update(error=(rec.get("error") or {}).get("message", ""), world_size=rec.get("world_size"))
    statuses = sorted(run_dir.glob("ranks/rank*/status.json"))
    for path in statuses:
        s = json.loads(path.read_text())
        row.setdefault("world_size", s.get("world_size"))
        if s.get("phase") == "failed" and not row.get("error"):
            err = s.get("error") or {}
            row["error"] = f"rank {s.get('rank')}: {err.get('type')}: {err.get('message')}"
    return row


def summarize_sweep(sweep_dir: str | Path, console=None) -> list[dict[str, Any]]:
    """Collect every job of ``sweep_dir`` (its numbered sub-folders), write summary.csv and summary.png,
    print a table, and return the rows (sorted by world size then job). Differences of a main metric across
    the completed jobs are flagged in the table and in each row's ``flag``."""
    from rich.console import Console
    from rich.table import Table

    sweep_dir = Path(sweep_dir)
    jobs = [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()] if sweep_dir.is_dir() else []
    rows = sorted((_job_row(d) for d in jobs), key=lambda r: (r.get("world_size") or 0, int(r["job"])))
    by_metric: dict[str, set] = {}
    for r in rows:
        if r["status"] == "completed" and r.get("main_metric"):
            by_metric.setdefault(r["main_metric"], set()).add(r["value"])
    for r in rows:
        r["flag"] = "differs across world sizes" if len(by_metric.get(r.get("main_metric"), ())) > 1 else ""
    if not rows:
        return rows
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, "flag"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, sweep_dir / "summary.png")
    write_report(sweep_dir, rows)  # its path: the sweep's last console line (disteval.driver.loggers.end_line)
    table = Table(title=f"sweep summary: {sweep_dir}",
                  caption="job wall s: the whole job (start-up, load, evaluation, exit); eval s: rank 0's "
                          "evaluation; forward images/s: forward passes only (no start-up, loading or sync); "
                          "pipeline: input-bound when the ranks waited for data >= 25 % of their loop, with the "
                          "images/s the loader delivered; "
                          "link Mbit/s: the slowest node's achieved throughput in collectives of >= 64 KiB")
    for col in ("job", "world size", "status", "metric", "job wall s", "eval s", "forward images/s", "pipeline",
                "link Mbit/s", "note"):
        table.add_column(col, justify="right" if col not in ("status", "note") else "left")
    for r in rows:
        value = "" if r.get("value") is None else f"{r['main_metric']} {r['value']:.6f}"
        ips = "" if r.get("forward_images_per_s") is None else f"{r['forward_images_per_s']:,.0f}"
        wall, ev = ("" if r.get(k) is None else f"{r[k]:.2f}" for k in ("job_wall_s", "eval_s"))
        note = r["flag"] or _short(r.get("error", ""))
        style = "red" if r["status"] != "completed" or r["flag"] else None
        link = "" if r.get("link_mbit_s") is None else (f"{r['link_mbit_s']:,.1f}" + (
            f" ({r['slow_link_node']})" if r.get("slow_link_node") else ""))
        pipe = "" if not r.get("pipeline") else (f"{r['pipeline']}-bound" + (
            f", {r['delivered_images_per_s']:,.0f}/s delivered" if r.get("delivered_images_per_s") else ""))
        table.add_row(r["job"], str(r.get("world_size", "")), r["status"], value, wall, ev, ips, pipe, link, note,
                      style=style)
    (console or Console()).print(table)
    return rows


def write_report(sweep_dir: Path, rows: list[dict]) -> Path | None:
    """SWEEP_DIR/report.html (``disteval.job.htmlreport.write_sweep_report``: scaling and the identity check) and its
    path; None with a warning when it cannot be written (the summary and the jobs' results stand)."""
    try:
        from disteval.job.htmlreport import write_sweep_report

        return write_sweep_report(sweep_dir, rows)
    except Exception as exc:  # noqa: BLE001 - the page is a view of rows already written to summary.csv
        print(f"disteval: warning: could not write {sweep_dir / 'report.html'}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return None


def _short(text: str, limit: int = 160) -> str:
    """One line of at most ``limit`` characters (the full text is in summary.csv and the job's job.json)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "completed"]
    fig, axes = plt.subplots(1, len(PLOTS), figsize=(4 * len(PLOTS), 3.8))
    for ax, (key, label) in zip(axes, PLOTS):
        points = [(r["world_size"], r[key]) for r in done if r.get(key) is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], "o-")
        ax.set_xticks(sorted({x for x, _ in points}))
        ax.set_xlabel("world size")
        ax.set_title(label, fontsize=9)
        failed = [r["world_size"] for r in rows if r["status"] != "completed" and r.get("world_size")]
        for x in failed:
            ax.axvline(x, color="red", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


class SweepSummary(Callback):
    """Hydra callback: ``summarize_sweep(hydra.sweep.dir)`` when a multirun ends (also after failures).

    With Hydra's basic launcher (jobs in the driver's process) the summary files are also rewritten after each
    job, because Hydra skips ``on_multirun_end`` when a job failed; the scheduling launchers write
    it themselves after failures."""

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        try:
            if "BasicLauncher" not in str(config.hydra.launcher.get("_target_", "")) or \
                    config.hydra.mode != RunMode.MULTIRUN:
                return
            from rich.console import Console

            summarize_sweep(str(config.hydra.sweep.dir), console=Console(file=open(os.devnull, "w")))
        except Exception:  # noqa: BLE001 - best effort; on_multirun_end or the launcher writes it again
            pass

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            summarize_sweep(str(config.hydra.sweep.dir))
        except Exception as exc:  # noqa: BLE001 - a summary problem must not hide the jobs' own outcome
            print(f"disteval: could not write the sweep summary: {type(exc).__name__}: {exc}")
