"""The sweep summary (disteval/sweep.py) from hand-written job records: each job's whole wall time beside the
evaluation's time and the forward-only throughput, each labelled as what it measures."""
from __future__ import annotations

import csv
import io
import json

from rich.console import Console

from disteval import sweep


def _job(root, name: str, results: dict | None = None, launch: dict | None = None) -> None:
    job = root / name
    job.mkdir(parents=True)
    if results is not None:
        (job / "results.json").write_text(json.dumps(results))
    if launch is not None:
        (job / "launch.json").write_text(json.dumps(launch))


def _results(world_size: int, images_per_s: float, timings: dict) -> dict:
    return {"world_size": world_size, "metrics": {"top1": 0.9852}, "throughput": {"images_per_s": images_per_s},
            "timings": timings}


def test_summary_shows_job_wall_time_and_forward_only_throughput(tmp_path):
    # forward-only throughput rises with the world size while each job takes longer: both must show
    _job(tmp_path, "0", _results(1, 2000.0, {"total": 1.0, "evaluation_s": 1.0, "process_wall_s": 6.0}),
         {"t_start": 100.0, "t_end": 106.5, "world_size": 1})
    _job(tmp_path, "1", _results(2, 5000.0, {"total": 1.5, "process_wall_s": 9.25}))  # no launch.json, older keys
    _job(tmp_path, "2", launch={"t_start": 200.0, "t_end": 203.0, "world_size": 4,
                                "error": {"message": "dist.master_port: port 1 is already in use"}})
    out = io.StringIO()
    rows = sweep.summarize_sweep(tmp_path, console=Console(file=out, width=250, color_system=None))
    by_job = {r["job"]: r for r in rows}
    assert by_job["0"]["job_wall_s"] == 6.5 and by_job["0"]["eval_s"] == 1.0  # launch.json t_end - t_start
    assert by_job["1"]["job_wall_s"] == 9.25 and by_job["1"]["eval_s"] == 1.5  # results.json process_wall_s
    assert by_job["1"]["forward_images_per_s"] == 5000.0
    assert by_job["2"]["status"] == "failed" and by_job["2"]["job_wall_s"] == 3.0

    table = out.getvalue()
    for label in ("job wall s", "eval s", "forward images/s", "whole job", "forward passes only"):
        assert label in table, label
    assert "6.50" in table and "9.25" in table and "5,000" in table

    csv_rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert list(csv_rows[0])[:8] == ["job", "world_size", "status", "main_metric", "value", "job_wall_s", "eval_s",
                                     "forward_images_per_s"]
    assert [(r["world_size"], r["job_wall_s"], r["forward_images_per_s"]) for r in csv_rows] == [
        ("1", "6.5", "2000.0"), ("2", "9.25", "5000.0"), ("4", "3.0", "")]
    assert (tmp_path / "summary.png").stat().st_size > 0
    titles = dict(sweep.PLOTS)
    assert "job wall time" in titles["job_wall_s"] and "forward-only" in titles["forward_images_per_s"]
