"""Benchmarks that cannot rot: every ``benchmarks/*.py`` runs with ``--smoke`` (small sizes, seconds) as a real
subprocess, must exit 0 and print its table and its checks' verdict. Each benchmark checks its own results
(methods agree, counts equal) and exits 1 on a mismatch, never on a time; the unit tests at the end feed its
check functions a mismatch. A new benchmark without ``--smoke`` fails here (argparse rejects the flag)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SAMPLE

BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))
# the start of each benchmark's table title (rich may wrap the rest); a new benchmark adds its own
TABLES = {"allocator.py": "allocator policies", "checkpoints.py": "checkpoints in one job",
          "bitwise_mode.py": "throughput, fashion-mnist", "coco_eval.py": "COCOeval.stats",
          "gather.py": "gathering float32 payloads", "heterogeneous.py": "the canary's cost", "knn.py": "sharded exact kNN",
          "prediction_store.py": "prediction store cost", "links.py": "links: compression",
          "model_parallel.py": "model parallelism on CPU",
          "segmentation.py": "segmentation statistics per batch", "startup.py": "start-up phases",
          "streaming.py": "streaming read+decode", "sync_overhead.py": "sync overhead:",
          "throughput.py": "loop throughput:", "input_pipeline.py": "input pipeline methods",
          "journal.py": "journal cost:"}
VERDICT = "checks passed"  # the last line of every benchmark whose checks passed
FASHION_ROOT = Path("/usr/share/datasets/fashion-mnist")
USES_LAB = {"links.py"}  # the network lab: one xdist worker runs every lab test (tests/conftest.py)
NEEDS_SAMPLE = {"input_pipeline.py"}  # its ImageNet-val-like tree is made from ../shared/data/imagenet-sample-224
NEEDS_FASHION = {"journal.py",
                 "bitwise_mode.py", "sync_overhead.py", "throughput.py", "links.py", "heterogeneous.py", "prediction_store.py",
                 "checkpoints.py"}


def _load(name: str):
    """Import ``benchmarks/<name>.py`` as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.netlab) if p.name in USES_LAB else p
                                    for p in BENCHMARKS], ids=lambda p: p.name)
def test_benchmark_smoke(script: Path, tmp_path):
    """``python benchmarks/X.py --smoke`` from outside the checkout: exit 0, its table, its verdict."""
    if script.name in NEEDS_FASHION and not any(FASHION_ROOT.glob("t10k-*")):
        pytest.skip(f"Fashion-MNIST not found at {FASHION_ROOT} (apt-get install dataset-fashion-mnist)")
    if script.name in NEEDS_SAMPLE and not SAMPLE.is_dir():
        pytest.skip(f"needs the shipped ImageNet sample images at {SAMPLE}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--smoke"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} --smoke exited {proc.returncode} after {seconds:.0f} s:\n{out[-6000:]}"
    assert TABLES.get(script.name, "") in proc.stdout, f"{script.name} --smoke printed no table:\n{out[-6000:]}"
    assert VERDICT in proc.stdout, f"{script.name} --smoke printed no '{VERDICT}' line:\n{out[-6000:]}"


def test_every_benchmark_has_a_table_marker():
    """TABLES names every benchmark, so the smoke test also checks that each one drew its table."""
    assert sorted(p.name for p in BENCHMARKS) == sorted(TABLES)


def test_sync_overhead_check_names_count_and_collective_mismatches():
    check = _load("sync_overhead").check
    rank = {"num_samples": 320, "max_batches": 3, "naive": [{"counts": [320, 200, 300], "collectives": 5}],
            "oneshot": [{"counts": [320, 200, 300], "collectives": 2}]}
    per_rank = {0: rank, 1: {**rank, "naive": [{"counts": [320, 201, 300], "collectives": 4}]}}
    assert check({0: rank, 1: rank}, 2) == []
    problems = check(per_rank, 2)
    assert any("rank 1 naive round 0: counts [320, 201, 300]" in p for p in problems)
    assert any("naive issued [4] collectives" in p for p in problems)
    assert check({0: {**rank, "num_samples": 321}}, 1) == ["W=1: synchronised count 320 != dataset size 321"]


def test_allocator_check_names_metric_coverage_and_allocator_mismatches():
    check = _load("allocator").check
    ok = {"seconds": 1.0, "minflt": 10, "samples": 4, "coverage_ok": True}

    def rec(expected, in_force, metrics, passes=(ok, ok)):
        return {"num_samples": 4, "passes": list(passes), "metrics": [metrics] * len(passes), "expected": expected,
                "in_force": {"in_force": in_force, "library": None, "glibc_tunables": None}}

    m = {"accuracy": 0.5, "nll": float("nan")}
    runs = {"system": [rec("system", "system", m)], "auto": [rec("tcmalloc", "tcmalloc", dict(m))]}
    assert check(runs) == []
    runs["jemalloc"] = [rec("jemalloc", "system", {"accuracy": 0.5000000000000001, "nll": float("nan")},
                            (ok, dict(ok, samples=3, coverage_ok=False)))]
    problems = check(runs)
    assert len(problems) == 4, problems
    assert "jemalloc round 0 pass 1: 3 samples of 4" in problems[0]
    assert all("metrics differ from system's in ['accuracy']" in p for p in problems[1:3])
    assert "jemalloc resolved but system in force" in problems[3]


def test_coco_check_requires_exact_pycocotools_stats():
    check = _load("coco_eval").check
    stats = [0.5] * 12
    rows = {"pycocotools": {"stats": stats}, "faster-coco-eval": {"stats": [0.5 + 1e-12] * 12},
            "disteval W=1": {"stats": list(stats)}}
    assert check(rows)[1] == []
    rows["disteval W=2"] = {"stats": stats[:11] + [0.5 + 1e-15]}
    rows["faster-coco-eval"] = {"stats": [0.6] * 12}
    problems = check(rows)[1]
    assert len(problems) == 2 and "disteval W=2" in problems[1] and "faster-coco-eval" in problems[0]
    assert check({"pycocotools": {"stats": stats}, "disteval W=1": {"stats": [float("nan")] * 12}})[1]


def test_gather_checks_payloads_bit_for_bit():
    import torch

    gather = _load("gather")
    a = torch.rand(10, dtype=torch.float64)
    assert gather._check_compressed("x/lossless", [a.clone()], [a], "lossless", {}) == []
    assert gather._check_compressed("x/lossless", [a + 1e-3], [a], "lossless", {})
    half = a.half().double()
    err = float((half - a).abs().max())
    assert gather._check_compressed("x/fp16", [half], [a], "fp16", {"max_abs_error": err}) == []
    assert len(gather._check_compressed("x/fp16", [a + 0.01], [a], "fp16", {"max_abs_error": err})) == 2
    want = gather._confusion_expected(5, 2)
    full = sum(torch.randint(0, 50, (5, 5), generator=torch.Generator().manual_seed(r), dtype=torch.int64)
               for r in range(2))
    assert torch.equal(want, torch.stack([full.diagonal(), full.sum(1), full.sum(0)], 1))


def test_bitwise_mode_check_metrics_compares_bitwise_runs_exactly():
    check = _load("bitwise_mode").check_metrics
    res = {"metrics": {"top1": 0.5, "nll": 1.25}}
    runs = {(w, name): [res] for w in (1, 2) for name in ("fast", "bitwise", "bitwise, no digests")}
    assert check([1, 2], runs) == []
    runs[(1, "fast")] = [{"metrics": {"top1": 0.5, "nll": 1.2500001}}]  # fast: values not compared
    assert check([1, 2], runs) == []
    runs[(2, "bitwise")] = [{"metrics": {"top1": 0.5, "nll": 1.2500000000000002}}]
    runs[(2, "fast")] = [{"metrics": {"top1": 0.5}}]
    problems = check([1, 2], runs)
    assert len(problems) == 2 and "W=2 bitwise" in problems[0] and "W=2 fast" in problems[1]


def _perf_table():
    """``scripts/perf_table.py`` as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("perf_table", REPO / "scripts" / "perf_table.py")
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    return perf


def test_docs_benchmarks_performance_table_is_generated_from_benchmark_results():
    """docs/benchmarks.md's table (README.md links to it) is exactly what scripts/perf_table.py renders from
    benchmarks/results/*.json."""
    assert _perf_table().PAGE == REPO / "docs" / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "perf_table.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_perf_table_renders_every_row_and_refuses_a_page_without_markers(tmp_path):
    perf = _perf_table()
    rec = {"benchmark": "x", "date": "2026-12-02", "commit": "abc1234", "command": "python benchmarks/x.py",
           "machine": {"cores": 2, "cpu": "c", "python": "3.11", "torch": "2.14.1"},
           "rows": [{"measure": "m1", "value": "1.00", "baseline": "2.00", "ratio": 0.5},
                    {"measure": "m2", "value": "3", "baseline": "", "ratio": None}]}
    (tmp_path / "x.json").write_text(json.dumps(rec))
    table = perf.render(tmp_path)
    assert "| `python benchmarks/x.py` | m1 | 1.00 | 2.00 | 0.50x | 2026-12-02, 2 cores, torch 2.14.1, commit abc1234 |" in table
    assert "| m2 | 3 |  |  |" in table
    page = f"intro\n{perf.START}\nold\n{perf.END}\nrest\n"
    assert perf.replace(page, table) == f"intro\n{perf.START}\n{table}\n{perf.END}\nrest\n"
    with pytest.raises(ValueError, match="perf-table:start"):
        perf.replace("no markers", table)


def test_throughput_check_compares_exact_counts_across_methods():
    check = _load("throughput").check
    ok = {"count": 1000, "top1": 900, "top5": 990}
    passes = {(1, "bare"): [{**ok, "top5": None}], (1, "disteval"): [ok, ok], (2, "torchmetrics"): [ok]}
    assert check(passes) == []
    passes[(2, "disteval")] = [ok, {**ok, "top1": 901}]
    passes[(2, "torchmetrics")] = [{**ok, "top5": 989}]
    problems = check(passes)
    assert len(problems) == 2 and "W=2 disteval pass 2: top1 901 != 900" in problems[0] and "top5 989" in problems[1]
    assert check({(1, "bare"): [{**ok, "top5": None}]}) == ["no method reported a top5 count"]


def test_model_parallel_check_names_coverage_and_layout_mismatches():
    check = _load("model_parallel").check
    ok = {"coverage_ok": True, "num_samples": 8, "top1": 3}
    good = {"dp=4": {"first": ok, "rounds": [ok]}, "dp_shard=4": {"first": ok, "rounds": [ok]}}
    assert check({0: good, 1: good}, 8) == []
    bad = {"dp=4": {"first": ok, "rounds": [ok]}, "dp_shard=4": {"first": ok, "rounds": [dict(ok, top1=4)]}}
    assert "top-1 counts differ between layouts or rounds" in check({0: bad}, 8)[0]
    short = {"dp=4": {"first": dict(ok, num_samples=16, coverage_ok=False), "rounds": [ok]}}
    assert check({1: short}, 8)[0].startswith("rank 1, dp=4: counted 16 of 8 samples")


def test_segmentation_check_compares_confusion_with_torchmetrics_exactly():
    import torch
    from torchmetrics.classification import MulticlassJaccardIndex

    from disteval.metrics.segmentation import SegmentationMetrics

    check = _load("segmentation").check
    labels = torch.tensor([[[0, 1, 2], [255, 1, 1]]], dtype=torch.uint8)
    logits = torch.zeros(1, 3, 2, 3)
    logits[0, 1] = 1.0  # predicts class 1 everywhere
    metric, tm = SegmentationMetrics(3), MulticlassJaccardIndex(3, ignore_index=255, average=None)
    metric.update(list(logits), list(labels), torch.tensor([0]))
    tm.update(logits, labels.long())
    assert check(metric, tm) == []
    tm.update(logits, labels.long())  # torchmetrics saw the batch twice
    problems = check(metric, tm)
    assert len(problems) == 1 and "confusion matrix differs from torchmetrics' confmat in 3 cells" in problems[0]


def test_a_benchmark_run_leaves_the_recorded_figures_alone(tmp_path, monkeypatch):
    """A benchmark's headline rows go to a folder of the user's (``DISTEVAL_BENCH_RESULTS``, else the cache), so
    running one from README never rewrites benchmarks/results/ (docs/benchmarks.md's table is generated from it)."""
    summary = _load("_summary")
    recorded = {p.name: p.read_bytes() for p in (REPO / "benchmarks" / "results").glob("*.json")}
    monkeypatch.delenv("DISTEVAL_BENCH_RESULTS", raising=False)
    monkeypatch.setenv("DISTEVAL_CACHE_DIR", str(tmp_path / "cache"))
    rows = [summary.row("m", "1", "2", 0.5)]
    path = summary.write("startup", rows, smoke=False)
    assert path == tmp_path / "cache" / "benchmarks" / "startup.json" and json.loads(path.read_text())["rows"] == rows
    monkeypatch.setenv("DISTEVAL_BENCH_RESULTS", str(tmp_path / "chosen"))
    assert summary.write("startup", rows, smoke=False) == tmp_path / "chosen" / "startup.json"
    assert summary.write("startup", rows, smoke=True) is None
    assert {p.name: p.read_bytes() for p in (REPO / "benchmarks" / "results").glob("*.json")} == recorded
