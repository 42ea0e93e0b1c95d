"""Robust aggregation (trials, outlier ranks), fault parsing, remedy overrides and the doctor's state machine,
without processes. Expected values come from numpy / scipy computed here."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as sps

from diagnostics import checks
from diagnostics.evidence import load_run
from diagnostics.machine import diagnose
from diagnostics.remedies import merge_overrides, shell_line
from disteval.faults import FaultPlan, check_ranks, parse
from disteval.metrics.robust import rank_outliers, robust_stats, summarize_trials


def test_robust_stats_against_numpy_and_scipy():
    rng = np.random.default_rng(0)
    x = rng.normal(0.8, 0.01, size=9).tolist() + [0.2]  # one wild trial
    st = robust_stats(x)
    assert st["mean"] == pytest.approx(np.mean(x), rel=1e-15)
    assert st["std"] == pytest.approx(np.std(x, ddof=1), rel=1e-12)
    assert st["median"] == np.median(x)
    assert st["mad"] == pytest.approx(sps.median_abs_deviation(x), rel=1e-12)
    # the classic mean +- 3 sigma filter cannot reject it (|z| <= (K-1)/sqrt(K) = 2.85 for K = 10) ...
    z = (np.array(x) - np.mean(x)) / np.std(x, ddof=1)
    assert np.abs(z).max() <= (len(x) - 1) / np.sqrt(len(x)) + 1e-12
    # ... the median/MAD clip does, and says so
    keep = np.abs(np.array(x) - np.median(x)) <= 3 * 1.4826 * sps.median_abs_deviation(x)
    assert st["dropped"] == 1 and st["sigma_clip_mean"] == pytest.approx(np.mean(np.array(x)[keep]), rel=1e-15)
    assert robust_stats([0.5, 0.5, 0.5])["agree"] and robust_stats([0.5])["std"] == 0.0
    with pytest.raises(ValueError):
        robust_stats([0.5, float("nan")])


def test_summarize_trials_reports_last_trial_when_identical_else_the_aggregate():
    same = [{"top1": 0.9, "num_samples": 10, "per_class": [1, 2]}] * 3
    metrics, summary = summarize_trials(same)
    assert metrics == same[-1] and summary["agree"] and "num_samples" not in summary["values"]
    trials = [{"top1": v, "nll": 1.0} for v in (0.90, 0.92, 0.50)]
    for agg, want in (("median", 0.90), ("mean", np.mean([0.90, 0.92, 0.50]))):
        metrics, summary = summarize_trials(trials, agg)
        assert metrics["top1"] == pytest.approx(want, rel=1e-15) and metrics["nll"] == 1.0
        assert summary["disagreeing"] == ["top1"]
    with pytest.raises(ValueError, match="trial_aggregate"):
        summarize_trials(trials, "mode")


def test_rank_outliers_modified_z_with_binomial_floor():
    acc, n = [0.98, 0.97, 0.99, 0.30], [1000] * 4
    out = rank_outliers(acc, n)
    med = np.median(acc)
    mad = sps.median_abs_deviation(acc)
    p = np.dot(acc, n) / sum(n)
    z3 = (0.30 - med) / max(1.4826 * mad, np.sqrt(p * (1 - p) * (1 / 1000 + 1 / 3000)))
    assert out["outliers"] == out["low"] == out["excludable"] == [3] and out["z"][3] == pytest.approx(z3, rel=1e-12)
    # small shards: a difference within sampling noise is not an outlier even when MAD is tiny
    assert rank_outliers([0.90, 0.90, 0.90, 0.80], [50] * 4)["outliers"] == []
    # 5 errors of 160 against 1 and 1: Fisher's exact test p = 0.044, far from the 3.5-sigma level (p = 4.7e-4)
    out = rank_outliers([159 / 160, 155 / 160, 159 / 160], [160] * 3)
    assert out["outliers"] == [] and sps.fisher_exact([[155, 5], [318, 2]]).pvalue > 2 * sps.norm.sf(3.5)
    # two of three ranks broken: the healthy one stands out above; nothing may be excluded
    out = rank_outliers([0.989, 0.10, 0.11], [180] * 3)
    assert out["high"] == [0] and out["excludable"] == []
    assert rank_outliers([0.9, 0.1], [10, 10])["skipped"]
    assert rank_outliers([0.9, None, 0.9, 0.9], [10, 0, 10, 10])["z"][1] is None


def test_fault_parsing_and_plan():
    faults = parse("kill@1:batch=2; delay@0,2:batch=1,seconds=3;noise@*:std=0.1")
    assert [(f.kind, f.ranks, f.params) for f in faults] == [
        ("kill", frozenset({1}), {"batch": 2.0}), ("delay", frozenset({0, 2}), {"batch": 1.0, "seconds": 3.0}),
        ("noise", None, {"std": 0.1})]
    assert not FaultPlan(3, "kill@1:batch=2") and FaultPlan(1, "kill@1:batch=2")
    for bad in ("explode@1", "kill@x:batch=1", "kill@1:seconds=2", "delay@1:batch", "kill@-1:batch=1",
                "kill@1:batch=0", "kill@1:batch=1.7", "delay@1:seconds=-5", "noise@*:std=nan", "weights@1:std=inf"):
        with pytest.raises(ValueError, match="DISTEVAL_FAULTS"):
            parse(bad)
    check_ranks(parse("kill@1:batch=1"), 2)
    with pytest.raises(ValueError, match=r"rank\(s\) \[5\].*never fire"):
        check_ranks(parse("kill@5:batch=1"), 2)


def test_merge_overrides_and_shell_line():
    base = ["+experiment=digits", "dist.world_size=2", "hydra.run.dir=/x", "communication.timeout_s=3"]
    assert merge_overrides(base, ["communication.timeout_s=60", "precision.deterministic=true"]) == [
        "+experiment=digits", "dist.world_size=2", "communication.timeout_s=60", "precision.deterministic=true"]
    assert shell_line(["python", "-m", "disteval", "data.root=/a b"], {"MASTER_PORT": "5"}) == \
        "MASTER_PORT=5 python -m disteval 'data.root=/a b'"


def _write_status(run_dir, rank, **fields):
    d = run_dir / "ranks" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": 2, "phase": "done", "samples_done": 5, "samples_planned": 5, "joined": 1.0}
    (d / "status.json").write_text(json.dumps({**record, **fields}))


def _edit(path, change):
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _write_results(run_dir, top1=(0.8, 1.0)):
    per_rank = [{"rank": r, "host": "h", "shard": [5 * r, 5 * r + 5], "samples": 5, "metrics": {"accuracy": a},
                 "images_per_s": None} for r, a in enumerate(top1)]
    (run_dir / "results.json").write_text(json.dumps({
        "world_size": len(top1), "dataset": {"num_samples": 10, "num_classes": 2}, "per_rank": per_rank,
        "metrics": {"top1": sum(top1) / len(top1), "num_samples": 10},
        "coverage": {"num_samples": 10, "missing": 0, "duplicated": 0, "out_of_range": 0, "ok": True}}))


def test_a_crashing_check_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    _write_status(tmp_path, 0)
    _write_status(tmp_path, 1)
    _write_results(tmp_path)

    def broken(run, probes):
        raise KeyError("boom")

    monkeypatch.setitem(checks.CHECKS, "SHARDS", [broken])
    diag = diagnose(load_run(tmp_path))
    crashed = [f for f in diag.findings if f.status == "crashed"]
    assert len(crashed) == 1 and "KeyError" in crashed[0].finding and crashed[0].evidence[0].line
    assert any(f.state == "RESULT" for f in diag.findings)  # the later states still ran
    assert diag.verdict is None and diag.exit_code == 2


def test_never_started_rank_and_unreadable_record(tmp_path):
    _write_status(tmp_path, 0, phase="failed", error={"type": "DistStoreError", "message": "Timed out after 5 seconds "
                                                      "waiting for clients. 1/2 clients joined."}, joined=None)
    diag = diagnose(load_run(tmp_path))
    assert (diag.verdict.state, diag.verdict.check, diag.culprit) == ("INIT", "started", 1)
    (tmp_path / "results.json").write_text("{not json")
    diag = diagnose(load_run(tmp_path))
    assert any(f.check == "records" and "results.json is unreadable" in f.finding for f in diag.findings)


@pytest.mark.parametrize("damage", ["results_missing", "results_empty", "results_list", "results_truncated",
                                    "results_no_coverage", "results_no_metrics", "results_rank_count", "results_n_string",
                                    "status_truncated", "status_list", "launch_bad_world_size", "launch_world_size_text"])
def test_damaged_records_are_never_judged_healthy(tmp_path, damage):
    """A healthy run's records, damaged one way each: the doctor must not call it healthy nor crash."""
    _write_status(tmp_path, 0)
    _write_status(tmp_path, 1)
    _write_results(tmp_path)
    (tmp_path / "launch.json").write_text(json.dumps({"outcome": "ok", "world_size": 2, "overrides": []}))
    assert diagnose(load_run(tmp_path)).exit_code == 0  # intact: healthy
    res, status, launch = tmp_path / "results.json", tmp_path / "ranks" / "rank1" / "status.json", tmp_path / "launch.json"
    {"results_missing": lambda: res.unlink(), "results_empty": lambda: res.write_text("{}"),
     "results_list": lambda: res.write_text("[]"), "results_truncated": lambda: res.write_text(res.read_text()[:40]),
     "status_truncated": lambda: status.write_text(status.read_text()[:20]), "status_list": lambda: status.write_text("[1]"),
     "launch_bad_world_size": lambda: launch.write_text(json.dumps({"outcome": "failed", "world_size": [3]})),
     "launch_world_size_text": lambda: launch.write_text(json.dumps({"outcome": "ok", "world_size": "two"})),
     "results_no_coverage": lambda: _edit(res, lambda r: r.pop("coverage")),
     "results_no_metrics": lambda: _edit(res, lambda r: r.update(metrics={})),
     "results_rank_count": lambda: _edit(res, lambda r: r["per_rank"][1].update(samples=0)),
     "results_n_string": lambda: _edit(res, lambda r: r["dataset"].update(num_samples="10")),
     }[damage]()
    diag = diagnose(load_run(tmp_path))
    assert diag.verdict is not None and not diag.crashed, [(f.check, f.status, f.finding) for f in diag.findings]


def test_sweep_directory_and_scheduler_timeout(tmp_path):
    """A sweep directory: every job is diagnosed; a SLURM TIMEOUT proposes twice the launcher's time limit."""
    import argparse

    from rich.console import Console

    from diagnostics.cli import doctor

    ok, late = tmp_path / "0", tmp_path / "1"
    for run in (ok, late):
        _write_status(run, 0)
        _write_status(run, 1)
        _write_results(run)
    (late / ".hydra").mkdir()
    (late / ".hydra" / "hydra.yaml").write_text("hydra:\n  launcher:\n    timeout_min: 30\n")
    (late / "job.json").write_text(json.dumps({"job_id": "7", "state": "TIMEOUT", "error": "time limit",
                                               "world_size": 2}))
    args = argparse.Namespace(run_dir=tmp_path, probe=False, apply=False, json=True, verbose=False)
    code, runs = doctor(args, Console(file=open("/dev/null", "w")))
    assert code == 1 and [r["verdict"] for r in runs][0] is None
    assert runs[1]["verdict"]["check"] == "scheduler" and runs[1]["remedy"]["overrides"] == ["hydra.launcher.timeout_min=60"]


def test_checks_on_recorded_symptoms(tmp_path):
    """Checks that the process tests do not reach, on records written as the ranks would write them."""
    from diagnostics.machine import probe_findings

    # mismatched collectives: gloo's message names it; the remedy is a DETAIL rerun
    _write_status(tmp_path, 0, phase="failed", error={"type": "RuntimeError", "message": "Detected mismatch between "
                  "collectives on ranks. Rank 0 is running collective: ALLREDUCE"})
    _write_status(tmp_path, 1)
    diag = diagnose(load_run(tmp_path))
    mismatch = next(f for f in diag.findings if f.check == "mismatch")
    assert mismatch.status == "fail" and mismatch.remedy.env == {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}

    # an unresolvable rendezvous address found by the driver before any rank started
    run = tmp_path / "addr"
    run.mkdir()
    (run / "launch.json").write_text(json.dumps({"outcome": "config_error", "world_size": 2, "master_addr": "nohost.x",
                                                 "error": {"key": "dist.master_addr", "message": "cannot resolve"}}))
    diag = diagnose(load_run(run))
    assert (diag.verdict.check, diag.remedy.overrides) == ("launch", ["dist.master_addr=127.0.0.1"])

    # TF32 and cuDNN benchmark on a GPU: a warning with the deterministic remedy; a straggler rank
    run = tmp_path / "gpu"
    for r in range(3):
        _write_status(run, r)
    _write_results(run, top1=(0.9, 0.9, 0.9))
    _edit(run / "results.json", lambda res: res.update(device="cuda:0", precision={"tf32": True, "cudnn_benchmark": True,
                                                                                  "deterministic": False}))
    _edit(run / "results.json", lambda res: [p.update(images_per_s=v, seconds={"forward": 40.0}, samples=400)
                                             for p, v in zip(res["per_rank"], (100.0, 95.0, 30.0))])
    findings = {f.check: f for f in diagnose(load_run(run)).findings}
    assert findings["flags"].status == "warn" and "precision.tf32=true" in findings["flags"].finding
    assert findings["stragglers"].status == "warn" and findings["stragglers"].culprit == 2

    # probes: a rank absent from the monitored barrier, and drift without a majority
    found = {f.check: f for f in probe_findings({"world_size": 2, "rendezvous": {"missing": [1], "timeout_s": 30},
                                                 "drift": {"batch": 8, "tolerance": 1e-4, "reference": "rank 0",
                                                           "max_abs_logit_diff": [0.0, 0.7],
                                                           "argmax_disagreements": [0, 3]}})}
    assert found["probe.rendezvous"].status == "fail" and found["probe.rendezvous"].culprit == 1
    assert found["probe.drift"].status == "fail" and found["probe.drift"].culprit is None
