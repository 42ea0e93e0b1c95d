"""``logger=csv``: RUN_DIR/metrics.csv with one ``metric,value`` row per scalar of results.json
(``disteval.driver.loggers.base.scalar_metrics``); at a sweep's end SWEEP_DIR/metrics.csv with one row per job (job,
world_size, status, run_dir, then every scalar). SWEEP_DIR/summary.csv (disteval/job/sweep.py) stays the sweep's
timing summary; this file holds all of the metrics."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from disteval.driver.loggers.base import JobView, TrackerCallback, scalar_metrics
from disteval.job.records import atomic_write_text

FILE = "metrics.csv"


class CsvLogger(TrackerCallback):
    """Hydra callback (conf/logger/csv.yaml): the scalars of each job, and of a sweep's jobs, as CSV files."""

    name = "csv"

    def log_job(self, job: JobView) -> str | None:
        """Write RUN_DIR/metrics.csv (metric,value); nothing for a job without results.json."""
        if not job.ok:
            return None
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["metric", "value"])
        writer.writerows((k, repr(v)) for k, v in scalar_metrics(job.results).items())
        path = job.run_dir / FILE
        atomic_write_text(path, buf.getvalue())
        return str(path)

    def log_sweep(self, sweep_dir: Path, jobs: list[JobView]) -> str | None:
        """Write SWEEP_DIR/metrics.csv: one row per job, the union of the jobs' scalars as columns."""
        rows = []
        for job in jobs:
            row = {"job": job.num, "world_size": job.world_size, "status": "completed" if job.ok else "failed",
                   "run_dir": str(job.run_dir)}
            row.update({k: repr(v) for k, v in (scalar_metrics(job.results) if job.ok else {}).items()})
            rows.append(row)
        if not rows:
            return None
        columns = list(dict.fromkeys(k for row in rows for k in row))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        path = sweep_dir / FILE
        atomic_write_text(path, buf.getvalue())
        return str(path)
