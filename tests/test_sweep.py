"""The sweep summary (disteval/job/sweep.py) from hand-written job records: each job's whole wall time beside the
evaluation's time and the forward-only throughput, each labelled as what it measures."""
from __future__ import annotations

import csv
import io
import json

from rich.console import Console

from disteval.job import sweep


def _job(root, name: str, results: dict | None = None, launch: dict | None = None) -> None:
    job = root / name
    job.mkdir(parents=True)
    if results is not None:
        (job / "results.json").write_text(json.dumps(results))
    if launch is not None:
        (job / "launch.json").write_text(json.dumps(launch))


def _results(world_size: int, images_per_s: float, timings: dict) -> dict:
    return {"world_size": world_size, "metrics": {"top1": 0.9852}, "throughput": {"images_per_s": images_per_s},
            "timings": timings, "task": {"name": "classification", "main_metric": "top1"}}


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


def test_every_task_s_main_metric_is_compared_across_world_sizes(tmp_path):
    """The sweep compares the main metric each job's results.json names (``task.main_metric``, from the metric
    classes' declarations): a segmentation sweep whose mIoU differs between W=1 and W=2 is flagged (with a fixed
    list of top1/AP/auroc_macro it had no main metric and flagged nothing); the same number is not flagged."""
    for job, (w, miou) in enumerate([(1, 0.6125), (2, 0.6126), (4, 0.6125)]):
        res = {"world_size": w, "metrics": {"mIoU": miou, "pixel_accuracy": 0.9}, "throughput": {"images_per_s": 10.0},
               "timings": {"total": 1.0}, "task": {"name": "segmentation", "main_metric": "mIoU"}}
        _job(tmp_path / "seg", str(job), res)
    rows = sweep.summarize_sweep(tmp_path / "seg", console=Console(file=io.StringIO(), width=250))
    assert [(r["main_metric"], r["value"], r["flag"]) for r in rows] == [("mIoU", 0.6125, "differs across world sizes"),
                                                                       ("mIoU", 0.6126, "differs across world sizes"),
                                                                       ("mIoU", 0.6125, "differs across world sizes")]
    for job, w in enumerate([1, 2]):
        res = {"world_size": w, "metrics": {"recall@1": 0.5}, "throughput": {"images_per_s": 10.0},
               "timings": {"total": 1.0}, "task": {"name": "embedding", "main_metric": "recall@1"}}
        _job(tmp_path / "emb", str(job), res)
    rows = sweep.summarize_sweep(tmp_path / "emb", console=Console(file=io.StringIO(), width=250))
    assert [(r["main_metric"], r["value"], r["flag"]) for r in rows] == [("recall@1", 0.5, ""), ("recall@1", 0.5, "")]


def _status(job, rank: int, host: str, done: list[dict], flight: dict | None = None) -> None:
    path = job / "ranks" / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "status.json").write_text(json.dumps({"rank": rank, "world_size": 4, "phase": "done", "host": host,
                                                 "collectives_done": done, "in_flight": flight}))


def test_link_throughput_per_node_in_the_summary_and_from_a_hung_collective(tmp_path):
    """Hand-written records of two jobs on nodes a and b. Job 0: b's ranks moved a 1,000,000-byte all_gather in
    8 s (1 Mbit/s), a's in 0.08 s (100 Mbit/s); small collectives (< 64 KiB) measure latency and are ignored.
    Job 1: one collective under way, 250,000 of 1,000,000 bytes moved after 2 s (wire 3x the payload). The
    summary's link column is the slowest node's figure and names it; the hung collective's rate and the time
    the whole payload needs come out of ``flight_rate`` exactly."""
    from disteval.common.links import flight_rate, node_throughput

    small = {"op": "all_reduce", "wire_bytes": 1000, "seconds": 1e-6}
    job = tmp_path / "0"
    _job(tmp_path, "0", _results(4, 1000.0, {"total": 1.0}))
    for rank, host, seconds in ((0, "a", 0.08), (1, "a", 0.08), (2, "b", 8.0), (3, "b", 8.0)):
        _status(job, rank, host, [small, {"op": "all_gather", "wire_bytes": 1_000_000, "seconds": seconds}])
    flight = {"op": "all_gather", "bytes": 1_000_000, "wire_bytes": 3_000_000, "bytes_done": 250_000,
              "since": 100.0, "t_done": 102.0, "payload": {"name": "ranking.scores"}}
    _status(tmp_path / "1", 0, "a", [small], flight)
    (tmp_path / "1" / "launch.json").write_text(json.dumps({"world_size": 1}))
    rate = flight_rate(flight)
    assert rate["bps"] == 125_000.0 and rate["wire_bps"] == 375_000.0 and rate["needed_s"] == 8.0
    nodes = node_throughput({0: json.loads((tmp_path / "1/ranks/rank0/status.json").read_text())})
    assert nodes == {"a": {"ranks": [0], "bps": 375_000.0}}  # 750,000 wire bytes moved: large enough
    out = io.StringIO()
    rows = {r["job"]: r for r in sweep.summarize_sweep(tmp_path, console=Console(file=out, width=250,
                                                                                   color_system=None))}
    assert rows["0"]["link_mbit_s"] == 1.0 and rows["0"]["slow_link_node"] == "b"
    assert rows["1"]["link_mbit_s"] == 3.0 and rows["1"]["slow_link_node"] is None
    assert "1.0 (b)" in out.getvalue() and "link Mbit/s" in out.getvalue()
    csv_rows = {r["job"]: r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    assert csv_rows["0"]["link_mbit_s"] == "1.0" and csv_rows["0"]["slow_link_node"] == "b"


def test_doctor_names_the_node_whose_link_is_slow(tmp_path):
    """The doctor's COMM/links on the same hand-written records: b's links ran at 1 Mbit/s, under a quarter of
    the median node's (50.5 Mbit/s): warn, naming node b and its first rank; a's alone would pass."""
    from diagnostics.evidence import load_run
    from diagnostics.links import comm_links

    for rank, host, seconds in ((0, "a", 0.08), (1, "a", 0.08), (2, "b", 8.0), (3, "b", 8.0)):
        _status(tmp_path, rank, host, [{"op": "all_gather", "wire_bytes": 1_000_000, "seconds": seconds}])
    finding = comm_links(load_run(tmp_path), None)
    assert finding.status == "warn" and finding.culprit == 2, finding
    assert "node b's link is slow: its ranks [2, 3] moved their collectives at 1.0 Mbit/s" in finding.finding
    assert "median node's 50.5 Mbit/s" in finding.finding
    for rank in (2, 3):
        (tmp_path / "ranks" / f"rank{rank}" / "status.json").unlink()
    assert comm_links(load_run(tmp_path), None).status == "pass"
